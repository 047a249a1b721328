"""The stores a ShardConfig names, built at start-up for either engine: the prompt-prefix
store (``PREFIX_STORE_PATH``, and the prompt-tuning adapters of ``ADAPTER_CACHE``), the
adapter cache (``ADAPTER_CACHE``), and the id that stands for a prefix's virtual tokens."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import torch

from tgis.settings.features import adapter_ids
from tgis.shard.adapters.adapter_cache import AdapterCache
from tgis.shard.adapters.lora_layout import LoraSite
from tgis.shard.adapters.prefix_store import PrefixLoad, PrefixStore
from tgis.shard.adapters.request_adapters import Adapters
from tgis.shard.adapters.store_paths import StoreError
from tgis.shard.checkpoints.model_config import ModelConfig
from tgis.shard.config import ShardConfig
from tgis.shard.errors import StartupError
from tgis.shard_api.messages import AdapterKind, ShardInfo

log = logging.getLogger(__name__)


def build_adapters(
    config: ShardConfig,
    sites: list[LoraSite],
    prompt_tuning: PrefixStore | None,
    device: torch.device,
    dtype: torch.dtype,
) -> Adapters:
    """The adapter cache of ``ADAPTER_CACHE`` (LoRA onto ``sites``, prompt tuning through
    ``prompt_tuning``), with the adapters of ``--lora-adapters`` loaded."""
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
    preload_adapters(cache, adapter_ids(config.lora_adapters), config.max_loras)
    return Adapters(cache, max_loras=config.max_loras if sites else 0)


def preload_adapters(cache: AdapterCache, ids: Sequence[str], max_loras: int) -> None:
    """Load the adapters of ``--lora-adapters`` now, so that no request waits for them;
    StartupError naming the first that cannot be used, or when more LoRA adapters are named
    than the cache keeps loaded (``--max-loras``)."""
    loras = 0
    for adapter_id in ids:
        started = time.monotonic()
        try:
            info = cache.lookup(adapter_id)
        except StoreError as e:
            raise StartupError(f"--lora-adapters: {e.message}") from None
        loras += info.kind is AdapterKind.LORA
        if loras > max_loras:
            raise StartupError(
                f"--lora-adapters names more LoRA adapters than --max-loras ({max_loras}) "
                "keeps loaded: raise --max-loras or name fewer"
            )
        log.info(
            "Preloaded adapter %s (%s) in %.3f s",
            adapter_id,
            info.kind.name,
            time.monotonic() - started,
        )


def with_adapters(info: ShardInfo, adapters: Adapters) -> ShardInfo:
    """``info`` saying whether adapters are served, and how many LoRA adapters a step holds."""
    return replace(info, adapters_enabled=adapters.enabled, max_loras=adapters.max_loras)


def build_prefix_store(
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
