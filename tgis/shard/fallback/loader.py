"""Load a model through transformers for the fallback engine (``HfRunner``).

Decoder-only models load with ``AutoModelForCausalLM``, encoder-decoder models (T5, ...)
with ``AutoModelForSeq2SeqLM``; nothing is downloaded (``local_files_only``). A two-token
warm-up forward checks that the model's cache is made of plain key/value layers the
engine can batch (recurrent and hybrid caches are refused at start-up) and learns their
shapes.

There is no paging: ``Info`` reports 16-token blocks, enough of them for
``max_batch_size`` (default ``HF_DEFAULT_BATCH_SIZE``, TGIS's 12: this engine pads)
sequences of ``max_sequence_length`` tokens (or ``--max-batch-total-tokens``, or
``TGIS_KV_CACHE_BLOCKS``), so the router's block accounting runs unchanged and bounds the
batch the engine has to hold.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from tgis.shard.adapters.prefixes import Prefixes
from tgis.shard.adapters.startup import (
    build_adapters,
    build_prefix_store,
    placeholder_token_id,
    with_adapters,
)
from tgis.shard.capacity import configured_blocks
from tgis.shard.checkpoints.model_config import ModelConfig
from tgis.shard.config import EngineSettings, ShardConfig
from tgis.shard.device import dtype_name, select_device, select_dtype
from tgis.shard.errors import StartupError
from tgis.shard.fallback.causal import HfCausalEngine
from tgis.shard.fallback.engine import HfEngine
from tgis.shard.fallback.kv import CrossKV, KVBatch, cache_tensors, empty_rows
from tgis.shard.fallback.runner import HfRunner
from tgis.shard.fallback.seq2seq import RELATIVE_POSITION_DECODERS, HfSeq2SeqEngine, Seq2SeqSpec
from tgis.shard_api.messages import ModelKind, ShardInfo

log = logging.getLogger(__name__)

HF_DEFAULT_BATCH_SIZE = 12
"""Sequences the fallback's capacity is sized for when --max-batch-size is unset."""

BLOCK_SIZE = 16
ATTENTION_BACKEND = "hf_transformers"


def load_hf_runner(config: ShardConfig, model_dir: Path, model_config: ModelConfig) -> HfRunner:
    """Load ``model_dir`` with transformers onto this rank's device; StartupError if it can't."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # no progress bars in the shard's log
    if config.world_size > 1:
        raise StartupError("the transformers fallback engine runs on a single shard only")
    kind, hf_config = model_kind(model_dir, config.engine.trust_remote_code)
    device = select_device(config.rank, config.world_size, config.cuda_process_memory_fraction)
    dtype = select_dtype(config.dtype, model_config.torch_dtype, device)
    model = _from_pretrained(model_dir, kind, dtype, model_config, config.engine)
    model = model.to(device).eval()
    engine: HfEngine
    with torch.inference_mode():
        if kind is ModelKind.SEQ2SEQ_LM:
            engine = _seq2seq_engine(model, device, model_config)
        else:
            engine = HfCausalEngine(model, device, _warm_up_causal(model, device, model_config))
    text_config = hf_config.get_text_config()
    num_blocks = configured_blocks(
        BLOCK_SIZE,
        max_batch_size=config.max_batch_size or HF_DEFAULT_BATCH_SIZE,
        max_sequence_length=config.max_sequence_length,
        max_batch_total_tokens=config.max_batch_total_tokens,
        override=config.kv_cache_blocks,
        bytes_per_block=1,  # unused: the batch size is always set here
    )
    info = ShardInfo(
        model_kind=kind,
        eos_token_ids=model_config.eos_token_ids,
        vocab_size=model_config.vocab_size,
        block_size=BLOCK_SIZE,
        num_blocks=num_blocks,
        world_size=1,
        max_position_embeddings=int(getattr(text_config, "max_position_embeddings", 0) or 0),
        model_type=model_config.model_type,
        dtype=dtype_name(dtype),
        device=str(device),
        attention_backend=ATTENTION_BACKEND,
    )
    log.info(
        "Loaded %s (%s) from %s with transformers: %s on %s, %s attention, %s",
        type(model).__name__,
        model_config.model_type,
        model_dir,
        info.dtype,
        info.device,
        getattr(model.config, "_attn_implementation", "default"),
        "encoder-decoder" if kind is ModelKind.SEQ2SEQ_LM else "decoder-only",
    )
    return _with_stores(HfRunner(engine, info, device), config, model_config)


def _with_stores(runner: HfRunner, config: ShardConfig, model_config: ModelConfig) -> HfRunner:
    """``runner`` with the prompt-prefix store of ``PREFIX_STORE_PATH`` (rows as wide as the
    model's input embeddings) and, when ``ADAPTER_CACHE`` is set, an adapter cache that
    refuses every adapter (this engine runs none)."""
    if config.prefix_store_path:
        embeddings = runner.engine.model.get_input_embeddings().weight
        runner.prefixes = Prefixes(
            store=build_prefix_store(
                config,
                "PREFIX_STORE_PATH",
                config.prefix_store_path,
                embedding_dim=int(embeddings.shape[1]),
                device=runner.device,
                dtype=embeddings.dtype,
                is_encoder_decoder=runner.info.model_kind is ModelKind.SEQ2SEQ_LM,
            ),
            placeholder_id=placeholder_token_id(model_config),
        )
    if config.adapter_cache:
        log.warning(
            "ADAPTER_CACHE is set but the transformers engine runs no adapters: every "
            "adapter_id will be refused as not supported for this model"
        )
        runner.adapters = build_adapters(config, [], None, runner.device, torch.float32)
        runner.info = with_adapters(runner.info, runner.adapters)
    return runner


def model_kind(model_dir: Path, trust_remote_code: bool = False) -> tuple[ModelKind, Any]:
    """Whether transformers loads ``model_dir`` as a seq2seq or a causal LM, and its config
    (``trust_remote_code``: TRUST_REMOTE_CODE, may run the repository's own code)."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING,
        MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING,
    )

    try:
        hf_config = AutoConfig.from_pretrained(
            model_dir, local_files_only=True, trust_remote_code=trust_remote_code
        )
    except Exception as e:
        raise StartupError(
            f"transformers cannot read {model_dir}/config.json: {_one_line(e)}"
        ) from None
    seq2seq = type(hf_config) in MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING
    if getattr(hf_config, "is_encoder_decoder", False) and seq2seq:
        return ModelKind.SEQ2SEQ_LM, hf_config
    if type(hf_config) in MODEL_FOR_CAUSAL_LM_MAPPING:
        return ModelKind.CAUSAL_LM, hf_config
    if seq2seq:
        return ModelKind.SEQ2SEQ_LM, hf_config
    # Remote code registers its classes through auto_map rather than the mappings.
    auto_map = getattr(hf_config, "auto_map", None) or {}
    if "AutoModelForSeq2SeqLM" in auto_map:
        return ModelKind.SEQ2SEQ_LM, hf_config
    if "AutoModelForCausalLM" in auto_map:
        return ModelKind.CAUSAL_LM, hf_config
    raise StartupError(
        f"unsupported model type '{hf_config.model_type}': transformers has no causal or "
        f"encoder-decoder language model for it"
    )


def _from_pretrained(
    model_dir: Path,
    kind: ModelKind,
    dtype: torch.dtype,
    model_config: ModelConfig,
    engine: EngineSettings,
) -> Any:
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

    auto = AutoModelForSeq2SeqLM if kind is ModelKind.SEQ2SEQ_LM else AutoModelForCausalLM
    kwargs: dict[str, Any] = {
        "dtype": dtype,
        "local_files_only": True,
        "trust_remote_code": engine.trust_remote_code,
    }
    if engine.transformers_attn_impl:
        kwargs["attn_implementation"] = engine.transformers_attn_impl
    try:
        return auto.from_pretrained(model_dir, **kwargs)
    except Exception as e:
        name = model_config.architecture or model_config.model_type
        raise StartupError(
            f"transformers cannot load model architecture '{name}' from {model_dir}: "
            f"{type(e).__name__}: {_one_line(e)}"
        ) from None


def _warm_up_causal(model: Any, device: torch.device, model_config: ModelConfig) -> KVBatch:
    """Run two tokens through the model; the empty batch shaped like its cache."""
    from transformers import DynamicCache

    ids = torch.zeros(1, 2, dtype=torch.long, device=device)
    out = _warm_up(model, model_config, input_ids=ids, past_key_values=DynamicCache())
    keys, values = _checked_tensors(getattr(out, "past_key_values", None), model_config)
    warm = KVBatch((0,), keys, values, torch.ones(1, 2, dtype=torch.long, device=device), True)
    return empty_rows(warm, ())


def _seq2seq_engine(model: Any, device: torch.device, model_config: ModelConfig) -> HfSeq2SeqEngine:
    """The engine for an encoder-decoder model, after a warm-up forward."""
    from transformers import DynamicCache, EncoderDecoderCache

    gen = getattr(model, "generation_config", None)
    start = getattr(gen, "decoder_start_token_id", None)
    if start is None:
        start = model.config.decoder_start_token_id
    if start is None:
        raise StartupError(f"{model_config.model_dir}/config.json has no decoder_start_token_id")
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    ids = torch.zeros(1, 2, dtype=torch.long, device=device)
    out = _warm_up(
        model,
        model_config,
        input_ids=ids,
        decoder_input_ids=torch.full((1, 1), int(start), dtype=torch.long, device=device),
        past_key_values=EncoderDecoderCache(DynamicCache(), DynamicCache()),
    )
    cache = getattr(out, "past_key_values", None)
    if not isinstance(cache, EncoderDecoderCache):
        raise StartupError(f"unsupported cache type {type(cache).__name__} for the fallback")
    keys, values = _checked_tensors(cache.self_attention_cache, model_config)
    cross_keys, cross_values = _checked_tensors(cache.cross_attention_cache, model_config)
    mask = torch.ones(1, 1, dtype=torch.long, device=device)
    cross = CrossKV(cross_keys, cross_values, torch.ones(1, 2, dtype=torch.long, device=device))
    warm = KVBatch((0,), keys, values, mask, True, cross)
    spec = Seq2SeqSpec(
        decoder_start_token_id=int(start),
        pad_token_id=int(pad),
        encoder_width=int(out.encoder_last_hidden_state.shape[-1]),
        relative_positions=model_config.model_type in RELATIVE_POSITION_DECODERS,
    )
    return HfSeq2SeqEngine(model, device, spec, empty_rows(warm, ()))


def _warm_up(model: Any, model_config: ModelConfig, **inputs: Any) -> Any:
    """One forward with a cache; StartupError (one line) if the model cannot run it."""
    try:
        return model(**inputs, use_cache=True)
    except Exception as e:
        name = model_config.architecture or model_config.model_type
        raise StartupError(
            f"model architecture '{name}' failed its warm-up forward with transformers: "
            f"{type(e).__name__}: {_one_line(e)}"
        ) from None


def _one_line(error: Exception) -> str:
    return " ".join(str(error).split())


def _checked_tensors(
    cache: Any, model_config: ModelConfig
) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """The cache's 4-D key/value tensors; StartupError if it holds anything else."""
    name = model_config.architecture or model_config.model_type
    try:
        keys, values = cache_tensors(cache)
    except (TypeError, AttributeError) as e:
        raise StartupError(
            f"model architecture '{name}' keeps a cache the transformers fallback cannot "
            f"batch ({e})"
        ) from None
    if not keys or any(t.dim() != 4 for t in (*keys, *values)):
        raise StartupError(
            f"model architecture '{name}' keeps a cache the transformers fallback cannot batch"
        )
    return keys, values
