"""Build a ready ModelRunner from a ShardConfig: find, check and load the model."""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from pathlib import Path

import torch

from tgis.model_files import resolve_model_dir
from tgis.shard.adapters.adapter_cache import AdapterCache
from tgis.shard.adapters.lora_layout import LoraSite
from tgis.shard.adapters.prefix_store import PrefixLoad, PrefixStore
from tgis.shard.adapters.prefixes import Prefixes
from tgis.shard.adapters.request_adapters import NO_ADAPTERS, Adapters
from tgis.shard.capacity import blocks_for, check_fits, configured_blocks
from tgis.shard.checkpoints.dummy_weights import DummyWeights, parameter_count
from tgis.shard.checkpoints.model_config import ModelConfig
from tgis.shard.checkpoints.weights import Weights
from tgis.shard.config import ShardConfig
from tgis.shard.device import dtype_name, select_device, select_dtype
from tgis.shard.engines import ENGINE_ENV, select_engine
from tgis.shard.errors import StartupError
from tgis.shard.native.attention.interface import AttentionBackend
from tgis.shard.native.attention.selection import start_attention_backend
from tgis.shard.native.compiled import CompiledForward, compile_mode, should_compile
from tgis.shard.native.cuda_capacity import measure_cuda_blocks
from tgis.shard.native.kv_cache import BLOCK_SIZE, KVCache, KVCacheSpec
from tgis.shard.native.model_runner import ModelRunner
from tgis.shard.native.models import CausalLM, ForwardFn, ModelFactory, check_config, model_class
from tgis.shard.native.models.layers import DecoderLM
from tgis.shard.parallel.distributed import min_over_ranks
from tgis.shard.parallel.group import SINGLE, TensorParallel
from tgis.shard.step.runner import Runner
from tgis.shard_api.messages import DEFAULT_MAX_BATCH_SIZE, ModelKind, ShardInfo

log = logging.getLogger(__name__)


def load_runner(config: ShardConfig, tp: TensorParallel = SINGLE) -> Runner:
    """Load the model named by ``config`` onto this rank's device and size its KV cache.

    With tensor parallelism (``tp`` from ``parallel.distributed.init_distributed``) this
    rank reads only its slice of each tensor and every rank gets the same number of KV
    blocks (the smallest that fits on all of them).

    Raises StartupError (or ModelNotFoundError) with a one-line message on any problem.
    """
    config.validate()
    model_dir = resolve_model_dir(config.model_name, config.revision)
    model_config = ModelConfig.from_dir(model_dir)
    engine = select_engine(
        config.deployment_framework,
        model_config,
        config.world_size,
        max_sequence_length=config.max_sequence_length,
    )
    if engine == "hf":
        if config.load_format == "dummy":
            raise StartupError(_no_dummy_fallback(model_config, config.max_sequence_length))
        from tgis.shard.fallback.loader import load_hf_runner  # imports transformers

        hf_runner = load_hf_runner(config, model_dir, model_config)
        if config.prefix_store_path:
            embeddings = hf_runner.engine.model.get_input_embeddings().weight
            hf_runner.prefixes = Prefixes(
                store=_prefix_store(
                    config,
                    "PREFIX_STORE_PATH",
                    config.prefix_store_path,
                    embedding_dim=int(embeddings.shape[1]),
                    device=hf_runner.device,
                    dtype=embeddings.dtype,
                    is_encoder_decoder=hf_runner.info.model_kind is ModelKind.SEQ2SEQ_LM,
                ),
                placeholder_id=placeholder_token_id(model_config),
            )
        if config.adapter_cache:
            log.warning(
                "ADAPTER_CACHE is set but the transformers engine runs no adapters: every "
                "adapter_id will be refused as not supported for this model"
            )
            hf_runner.adapters = _adapters(config, [], None, hf_runner.device, torch.float32)
            hf_runner.info = _with_adapters(hf_runner.info, hf_runner.adapters)
        return hf_runner
    factory = model_class(model_config)  # fail on the architecture before touching devices
    device = select_device(config.rank, config.world_size, config.cuda_process_memory_fraction)
    dtype = select_dtype(config.dtype, model_config.torch_dtype, device)
    attention = start_attention_backend(device, BLOCK_SIZE, dtype)
    if tp.world_size != config.world_size:
        raise StartupError(f"{tp.world_size} ranks joined but WORLD_SIZE={config.world_size}")
    model = _build_model(config, factory, model_config, attention, device, dtype, tp)
    spec = model.kv_cache_spec
    info = ShardInfo(
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
    )
    forward = _forward(model, tp, device)
    num_blocks = min_over_ranks(
        tp, _kv_cache_blocks(config, model, spec, attention, info, device, forward)
    )
    kv_cache = KVCache(spec, num_blocks, device)
    info = replace(info, num_blocks=num_blocks)
    log.info(
        "Loaded %s (%s) from %s%s: %s on %s, %d KV blocks of %d tokens",
        model_config.architecture,
        model_config.model_type,
        model_dir,
        " with dummy weights" if config.load_format == "dummy" else "",
        info.dtype,
        info.device,
        num_blocks,
        spec.block_size,
    )
    prefix_store = None
    if config.prefix_store_path:
        prefix_store = _prefix_store(
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
        prompt_tuning = _prefix_store(
            config, "ADAPTER_CACHE", config.adapter_cache, _embedding_dim(model), device, dtype
        )
        adapters = _adapters(config, model.lora_sites(), prompt_tuning, device, dtype)
        info = _with_adapters(info, adapters)
    runner = ModelRunner(model, kv_cache, attention, info, device, forward, prefixes, adapters)
    if isinstance(forward, CompiledForward):
        started = time.monotonic()
        try:
            runner.warm_up()
        except Exception as e:
            if compile_mode() == "on":
                raise StartupError(f"compiling the step failed (TGIS_COMPILE=1): {e}") from e
            log.warning("Compiling the step failed, running it eagerly: %s", e)
            runner.forward = model.forward
        else:
            log.info("Compiled the step in %.1f s", time.monotonic() - started)
    _capture_decode_graphs(runner, config, tp)
    return runner


def _adapters(
    config: ShardConfig,
    sites: list[LoraSite],
    prompt_tuning: PrefixStore | None,
    device: torch.device,
    dtype: torch.dtype,
) -> Adapters:
    """The adapter cache of ``ADAPTER_CACHE`` (LoRA onto ``sites``, prompt tuning through
    ``prompt_tuning``)."""
    assert config.adapter_cache
    root = Path(config.adapter_cache)
    if not root.is_dir():
        raise StartupError(f"ADAPTER_CACHE {root} is not a directory")
    log.info(
        "Adapters from %s (LoRA: %d sites, at most %d adapters per step, rank <= %d)",
        root,
        len(sites),
        config.max_loras,
        config.max_lora_rank,
    )
    cache = AdapterCache(
        root,
        sites=sites,
        dtype=dtype,
        device=device,
        max_rank=config.max_lora_rank,
        max_cached=config.max_loras,
        prefix_store=prompt_tuning,
    )
    return Adapters(cache, max_loras=config.max_loras if sites else 0)


def _with_adapters(info: ShardInfo, adapters: Adapters) -> ShardInfo:
    return replace(info, adapters_enabled=adapters.enabled, max_loras=adapters.max_loras)


def _embedding_dim(model: CausalLM) -> int:
    """The width of a native model's input embeddings (a prefix row's width)."""
    if not isinstance(model, DecoderLM):
        raise StartupError("prompt prefixes need a native decoder model")
    return int(model.embed.weight.shape[1])


def _prefix_store(
    config: ShardConfig,
    setting: str,
    path: str,
    embedding_dim: int,
    device: torch.device,
    dtype: torch.dtype,
    is_encoder_decoder: bool = False,
) -> PrefixStore:
    """A prompt-tuning prefix store over ``path``: ``PREFIX_STORE_PATH``, or the
    prompt-tuning adapters of ``ADAPTER_CACHE`` (``setting`` names it in errors)."""
    store_path = Path(path)
    if not store_path.is_dir():
        raise StartupError(f"{setting} {store_path} is not a directory")
    log.info(
        "Prompt prefixes from %s (cache %d MB, at most %d virtual tokens)",
        store_path,
        config.prompt_cache_bytes // (1024 * 1024),
        config.prefix_length_limit,
    )
    return PrefixStore(
        store_path,
        embedding_dim=embedding_dim,
        dtype=dtype,
        device=device,
        max_length=config.prefix_length_limit,
        cache_bytes=config.prompt_cache_bytes,
        is_encoder_decoder=is_encoder_decoder,
        on_load=_log_prefix_load,
    )


def _log_prefix_load(load: PrefixLoad) -> None:
    if load.ok:
        log.info("Loaded prompt prefix %s in %.3f s", load.prefix_id, load.seconds)
    else:
        log.warning("Prompt prefix %s cannot be used: %s", load.prefix_id, load.error)


def placeholder_token_id(model_config: ModelConfig) -> int:
    """The id that stands for a prefix's virtual tokens (TGIS shows the pad token there):
    ``pad_token_id``, else the first EOS id, else 0."""
    pad = model_config.raw.get("pad_token_id")
    if isinstance(pad, int) and 0 <= pad < model_config.vocab_size:
        return pad
    return model_config.eos_token_ids[0] if model_config.eos_token_ids else 0


def _capture_decode_graphs(runner: ModelRunner, config: ShardConfig, tp: TensorParallel) -> None:
    """CUDA graphs of the decode steps (``cuda_graphs.py``) where they apply: CUDA,
    ``triton_paged``, one rank, ``TGIS_CUDA_GRAPHS`` not 0."""
    from tgis.shard.native.cuda_graphs import DecodeGraphs, graph_buckets, graphs_mode

    mode = graphs_mode()
    applies = (
        runner.device.type == "cuda"
        and runner.attention.name == "triton_paged"
        and not tp.is_parallel
    )
    if mode == "off" or not applies:
        if mode == "on" and not applies:
            log.warning("TGIS_CUDA_GRAPHS=1 ignored: graphs need CUDA, triton_paged, one rank")
        return
    max_batch = min(config.max_batch_size or DEFAULT_MAX_BATCH_SIZE, runner.info.num_blocks)
    graphs = DecodeGraphs(
        runner.forward,
        runner.kv_cache,
        runner.device,
        graph_buckets(max_batch),
        config.max_sequence_length,
        runner.info.vocab_size,
    )
    try:
        seconds = graphs.capture()
        graphs.verify()
    except Exception as e:
        reason = " ".join(str(e).split())[:300]
        if mode == "on":
            raise StartupError(f"capturing the decode CUDA graphs failed: {reason}") from None
        log.warning("Capturing the decode CUDA graphs failed, running without: %s", reason)
        return
    runner.graphs = graphs
    log.info(
        "Captured decode CUDA graphs for %d batch sizes (1 to %d) in %.1f s",
        len(graphs.buckets),
        graphs.max_batch,
        seconds,
    )


def _build_model(
    config: ShardConfig,
    factory: ModelFactory,
    model_config: ModelConfig,
    attention: AttentionBackend,
    device: torch.device,
    dtype: torch.dtype,
    tp: TensorParallel,
) -> CausalLM:
    """The model with this rank's weights: read from the safetensors files, or with
    ``--load-format dummy`` created at random on the device (nothing read but config.json)."""
    if config.load_format != "dummy":
        weights = Weights(model_config.model_dir, device, dtype, tp=tp)
        model = factory(model_config, weights, attention, config.max_sequence_length)
        weights.close()
        return model
    started = time.monotonic()
    shapes = factory.checkpoint_shapes(model_config, config.max_sequence_length)
    dummy = DummyWeights(shapes, device, dtype, tp=tp)
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


def _no_dummy_fallback(model_config: ModelConfig, max_sequence_length: int) -> str:
    """Why ``--load-format dummy`` cannot serve a model the transformers fallback would."""
    try:
        check_config(model_config, max_sequence_length)
        reason = f"{ENGINE_ENV}=hf"  # a native model, but the fallback was asked for
    except StartupError as e:
        reason = str(e)
    name = model_config.architecture or model_config.model_type
    return (
        f"--load-format dummy needs the native engine, but {name} is served by the "
        f"transformers fallback: {reason}"
    )


def _forward(model: CausalLM, tp: TensorParallel, device: torch.device) -> ForwardFn:
    """The compiled forward (``compiled.py``: on CUDA, or with ``TGIS_COMPILE=1``), else the
    eager one; tensor parallelism always runs eagerly (its collectives are outside graphs)."""
    try:
        compiled = should_compile(device)
    except ValueError as e:
        raise StartupError(str(e)) from None
    if compiled and isinstance(model, DecoderLM) and not tp.is_parallel:
        return CompiledForward(model)
    log.info("The step runs eagerly (TGIS_COMPILE=%s)", compile_mode())
    return model.forward


def _kv_cache_blocks(
    config: ShardConfig,
    model: CausalLM,
    spec: KVCacheSpec,
    attention: AttentionBackend,
    info: ShardInfo,
    device: torch.device,
    forward: ForwardFn,
) -> int:
    """This rank's KV capacity in blocks (``capacity`` explains the rules)."""
    block_size = spec.block_size
    if device.type != "cuda" or config.kv_cache_blocks is not None:
        return configured_blocks(
            block_size,
            max_batch_size=config.max_batch_size,
            max_sequence_length=config.max_sequence_length,
            max_batch_total_tokens=config.max_batch_total_tokens if device.type != "cuda" else None,
            override=config.kv_cache_blocks,
            bytes_per_block=spec.bytes_per_block,
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
    )
    check_fits(measured, block_size, config.max_sequence_length, "GPU memory after the warm-up")
    if config.max_batch_total_tokens is not None:
        measured = min(measured, blocks_for(config.max_batch_total_tokens, block_size))
    log.info("KV cache: %d blocks of %d tokens fit after the warm-up", measured, block_size)
    return measured
