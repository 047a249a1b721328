"""Load the native engine's runner: this rank's weights, the KV cache sized for the device,
the request stores, and the forward compiled and captured in CUDA graphs where that applies
(``forward.py``).

``load_native_runner`` is what ``tgis.shard.loader.load_runner`` delegates to when the
native engine serves the model.
"""

from __future__ import annotations

import importlib.util
import logging
import time
from dataclasses import replace
from pathlib import Path

import torch

from tgis.shard.adapters.prefixes import Prefixes
from tgis.shard.adapters.request_adapters import NO_ADAPTERS, Adapters
from tgis.shard.adapters.startup import (
    build_adapters,
    build_prefix_store,
    placeholder_token_id,
    with_adapters,
)
from tgis.shard.capacity import blocks_for, check_fits, configured_blocks
from tgis.shard.checkpoints.dummy_weights import DummyWeights, parameter_count
from tgis.shard.checkpoints.model_config import ModelConfig
from tgis.shard.checkpoints.quantized.scheme import QuantScheme
from tgis.shard.checkpoints.weights import Weights
from tgis.shard.config import ShardConfig
from tgis.shard.cpu_threads import MIN_PARALLEL_SECONDS
from tgis.shard.device import dtype_name, select_device, select_dtype
from tgis.shard.errors import StartupError
from tgis.shard.native.attention.interface import AttentionBackend
from tgis.shard.native.attention.kv_cache import BLOCK_SIZE, KVCache, KVCacheSpec
from tgis.shard.native.attention.selection import start_attention_backend
from tgis.shard.native.linear.quantized_linear import quant_kernel
from tgis.shard.native.loading.cpu_warmup import warm_up_cpu
from tgis.shard.native.loading.cuda_capacity import measure_cuda_blocks
from tgis.shard.native.loading.forward import (
    capture_decode_graphs,
    choose_forward,
    compile_step,
    pack_cpu_weights,
)
from tgis.shard.native.loading.recurrent import recurrent_states
from tgis.shard.native.models import CausalLM, ForwardFn, ModelFactory, model_class
from tgis.shard.native.models.decoder import DecoderLM
from tgis.shard.native.models.kv_window import kv_window
from tgis.shard.native.models.recurrent_state import RecurrentStates
from tgis.shard.native.runtime.model_runner import ModelRunner
from tgis.shard.native.speculation.draft_loading import load_draft
from tgis.shard.parallel.distributed import min_over_ranks
from tgis.shard.parallel.group import TensorParallel
from tgis.shard_api.messages import DEFAULT_MAX_BATCH_SIZE, ModelKind, ShardInfo

log = logging.getLogger(__name__)


def load_native_runner(
    config: ShardConfig,
    model_dir: Path,
    model_config: ModelConfig,
    tp: TensorParallel,
    quantization: QuantScheme | None = None,
) -> ModelRunner:
    """Load ``model_config``'s model onto this rank's device and size its KV cache.

    With tensor parallelism this rank reads only its slice of each tensor and every rank
    gets the same number of KV blocks (the smallest that fits on all of them).
    ``quantization``: the checkpoint's quantization or the one applied at load.
    """
    with quant_kernel(config.engine.quant_kernel):  # the kernels of the layers built here
        return _load(config, model_dir, model_config, tp, quantization)


def _load(
    config: ShardConfig,
    model_dir: Path,
    model_config: ModelConfig,
    tp: TensorParallel,
    quantization: QuantScheme | None,
) -> ModelRunner:
    factory = model_class(model_config)  # fail on the architecture before touching devices
    device = select_device(config.rank, config.world_size, config.cuda_process_memory_fraction)
    dtype = select_dtype(config.dtype, model_config.torch_dtype, device)
    attention = start_attention_backend(
        device,
        BLOCK_SIZE,
        dtype,
        _attention_choice(config.engine.attention_backend, model_config, device),
        config.engine.flash_attention,
    )
    if tp.world_size != config.world_size:
        raise StartupError(f"{tp.world_size} ranks joined but WORLD_SIZE={config.world_size}")
    model = _build_model(config, factory, model_config, attention, device, dtype, tp, quantization)
    _log_quantization(model, quantization)
    spec = model.kv_cache_spec
    info = _info(config, model_config, spec, attention, device, dtype, kv_window(model))
    states = recurrent_states(config, model, device, tp)
    if states is not None:  # no prefix cache, no speculation: recurrent.py says why
        info = replace(info, state_slots=states.num_slots, prefix_caching=False, speculation=False)
    forward = model.forward if states else choose_forward(model, device, config.engine)
    pack_cpu_weights(model, forward, device, dtype)
    draft = None if states else load_draft(config, model_config, attention, device, dtype, tp)
    draft_bytes = 0 if draft is None else draft.bytes_per_block
    num_blocks = min_over_ranks(
        tp,
        _kv_cache_blocks(
            config, model, spec, attention, info, device, forward, draft_bytes, states
        ),
    )
    kv_cache = KVCache(spec, num_blocks, device, commit=config.prefix_caching)
    info = replace(info, num_blocks=num_blocks)
    _log_loaded(config, model_config, model_dir, info)
    prefixes, adapters = _stores(config, model_config, model, device, dtype)
    if config.adapter_cache:
        info = with_adapters(info, adapters)
    runner = ModelRunner(
        model, kv_cache, attention, info, device, forward, prefixes, adapters, states
    )
    runner.use_lora_kernel(config.engine.lora_kernel)
    if draft is not None:
        runner.attach_draft(
            draft.with_cache(
                num_blocks, attention, device, config.prefix_caching, info.eos_token_ids
            )
        )
    compile_step(runner, model, config.engine, tp)
    if states is None:
        capture_decode_graphs(runner, config, tp)
    _calibrate_cpu_threads(runner)
    warm_up_cpu(runner, config.max_batch_prefill_tokens, config.max_sequence_length)
    return runner


def _calibrate_cpu_threads(runner: ModelRunner) -> None:
    """On the CPU, measure the model's step cost for the thread policy and say what it
    chose (``ModelRunner.calibrate_cpu_threads``)."""
    timing = runner.calibrate_cpu_threads()
    if timing is not None and runner.threads is not None:
        log.info(
            "CPU threads: %d for a step under %.1f ms (or short next to the router's work "
            "for it), else %d; a one-token step takes %.1f ms, each further token %.2f ms",
            runner.threads.small,
            MIN_PARALLEL_SECONDS * 1e3,
            runner.threads.large,
            timing.one_token_s * 1e3,
            timing.per_token_s * 1e3,
        )


def _log_loaded(
    config: ShardConfig, model_config: ModelConfig, model_dir: Path, info: ShardInfo
) -> None:
    log.info(
        "Loaded %s (%s) from %s%s: %s on %s, %d KV blocks of %d tokens",
        model_config.architecture,
        model_config.model_type,
        model_dir,
        " with dummy weights" if config.load_format == "dummy" else "",
        info.dtype,
        info.device,
        info.num_blocks,
        info.block_size,
    )


def _info(
    config: ShardConfig,
    model_config: ModelConfig,
    spec: KVCacheSpec,
    attention: AttentionBackend,
    device: torch.device,
    dtype: torch.dtype,
    window: int,
) -> ShardInfo:
    """The runner's facts, its number of KV blocks still to be measured (0); ``window``:
    the model's ``kv_window``."""
    return ShardInfo(
        model_kind=ModelKind.CAUSAL_LM,
        eos_token_ids=model_config.eos_token_ids,
        vocab_size=model_config.vocab_size,
        block_size=spec.block_size,
        num_blocks=0,  # measured next
        world_size=config.world_size,
        max_position_embeddings=model_config.max_position_embeddings,
        model_type=model_config.model_type,
        dtype=dtype_name(dtype),
        device=str(device),
        attention_backend=attention.name,
        prefix_caching=config.prefix_caching,
        speculation=True,
        kv_window=window,
    )


def _stores(
    config: ShardConfig,
    model_config: ModelConfig,
    model: CausalLM,
    device: torch.device,
    dtype: torch.dtype,
) -> tuple[Prefixes, Adapters]:
    """The prompt-prefix store of ``PREFIX_STORE_PATH`` and the adapters of
    ``ADAPTER_CACHE``, each empty when its setting is unset."""
    prefix_store = None
    if config.prefix_store_path:
        prefix_store = build_prefix_store(
            config,
            "PREFIX_STORE_PATH",
            config.prefix_store_path,
            _embedding_dim(model),
            device,
            dtype,
        )
    prefixes = Prefixes(store=prefix_store, placeholder_id=placeholder_token_id(model_config))
    adapters = NO_ADAPTERS
    if config.adapter_cache:
        prompt_tuning = build_prefix_store(
            config, "ADAPTER_CACHE", config.adapter_cache, _embedding_dim(model), device, dtype
        )
        adapters = build_adapters(config, model.lora_sites(), prompt_tuning, device, dtype)
    return prefixes, adapters


def _log_quantization(model: CausalLM, quantization: QuantScheme | None) -> None:
    """Name the quantization and the kernel of the linear layers (how many run each)."""
    if quantization is None or not isinstance(model, DecoderLM):
        return
    kernels = model.linear_kernels()
    log.info(
        "Quantization: %s; linear layers: %s",
        quantization.describe(),
        ", ".join(f"{count} {kernel}" for kernel, count in sorted(kernels.items())),
    )
    if any(kernel.startswith("dequantized") for kernel in kernels):
        log.info(
            "Dequantized layers hold dense weights: they compute what the checkpoint's "
            "values say, without the memory saving (native/linear/quantized_linear.py)"
        )


def _embedding_dim(model: CausalLM) -> int:
    """The width of a native model's input embeddings (a prefix row's width)."""
    if not isinstance(model, DecoderLM):
        raise StartupError("prompt prefixes need a native decoder model")
    return int(model.embed.weight.shape[1])


def _build_model(
    config: ShardConfig,
    factory: ModelFactory,
    model_config: ModelConfig,
    attention: AttentionBackend,
    device: torch.device,
    dtype: torch.dtype,
    tp: TensorParallel,
    quantization: QuantScheme | None,
) -> CausalLM:
    """The model with this rank's weights: read from the safetensors files, or with
    ``--load-format dummy`` created at random on the device (nothing read but config.json;
    a quantized layout's integers at random too)."""
    if config.load_format != "dummy":
        weights = Weights(model_config.model_dir, device, dtype, tp=tp, quantization=quantization)
        model = factory(model_config, weights, attention, config.max_sequence_length)
        weights.close()
        return model
    started = time.monotonic()
    shapes = factory.checkpoint_shapes(model_config, config.max_sequence_length)
    dummy = DummyWeights(shapes, device, dtype, tp=tp, quantization=quantization)
    model = factory(model_config, dummy, attention, config.max_sequence_length)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    log.info(
        "Dummy weights (--load-format dummy): %s random parameters on %s (rank %d of %d; "
        "%s in the model) in %.2f s",
        f"{dummy.created:,}",
        device,
        tp.rank,
        tp.world_size,
        f"{parameter_count(shapes):,}",
        time.monotonic() - started,
    )
    return model


def _kv_cache_blocks(  # noqa: PLR0913 - the model, its cache and what shares the memory
    config: ShardConfig,
    model: CausalLM,
    spec: KVCacheSpec,
    attention: AttentionBackend,
    info: ShardInfo,
    device: torch.device,
    forward: ForwardFn,
    draft_bytes: int = 0,
    states: RecurrentStates | None = None,
) -> int:
    """This rank's KV capacity in blocks (``tgis.shard.capacity`` and ``cuda_capacity``
    explain the rules); ``draft_bytes``: a draft model's cache bytes per block, which every
    block also takes; ``states``: a model's recurrent-state slots (the GPU warm-up runs on
    them)."""
    block_size = spec.block_size
    if device.type != "cuda" or config.kv_cache_blocks is not None:
        return configured_blocks(
            block_size,
            max_batch_size=config.max_batch_size,
            max_sequence_length=config.max_sequence_length,
            max_batch_total_tokens=config.max_batch_total_tokens if device.type != "cuda" else None,
            override=config.kv_cache_blocks,
            bytes_per_block=spec.bytes_per_block + draft_bytes,
        )
    measured = measure_cuda_blocks(
        model,
        spec,
        attention,
        info,
        device,
        forward=forward,
        max_prefill_tokens=config.max_batch_prefill_tokens,
        max_sequence_length=config.max_sequence_length,
        max_batch_size=config.max_batch_size or DEFAULT_MAX_BATCH_SIZE,
        memory_fraction=config.cuda_process_memory_fraction,
        safety_margin=config.batch_safety_margin,
        held_back=config.prompt_cache_bytes if config.prefix_store_path else 0,
        states=states,
    )
    # The warm-up measured the target's bytes per block; the draft's cache shares the room.
    measured = measured * spec.bytes_per_block // (spec.bytes_per_block + draft_bytes)
    check_fits(measured, block_size, config.max_sequence_length, "GPU memory after the warm-up")
    if config.max_batch_total_tokens is not None:
        measured = min(measured, blocks_for(config.max_batch_total_tokens, block_size))
    log.info("KV cache: %d blocks of %d tokens fit after the warm-up", measured, block_size)
    return measured


def _attention_choice(
    forced: str | None, model_config: ModelConfig, device: torch.device
) -> str | None:
    """The attention backend to start: the one forced, else, for a model that soft-caps
    its attention scores (Gemma 2) on CUDA, the reference, the CUDA backend that caps them
    exactly (``layers.check_softcap``); for a model with attention sinks (gpt-oss) on CUDA,
    triton_paged (the reference without Triton), even where ``FLASH_ATTENTION`` asks for
    flash-attn, which has no sinks (``layers.check_sinks``); else the device's default
    (None)."""
    if forced or device.type != "cuda":
        return forced
    if model_config.raw.get("attn_logit_softcapping"):
        log.info("attention backend torch_paged: the model soft-caps its attention scores")
        return "torch_paged"
    if model_config.model_type == "gpt_oss":
        choice = "triton_paged" if importlib.util.find_spec("triton") else "torch_paged"
        log.info("attention backend %s: the model has attention sinks", choice)
        return choice
    return None
