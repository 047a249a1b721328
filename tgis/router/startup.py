"""What the router checks and logs once it knows the shard: the model, the KV capacity
against ``--max-sequence-length``, the batching budgets, and the limits it adjusts."""

from __future__ import annotations

import logging

from tgis.router.config import RouterConfig
from tgis.router.core.batching import SchedulerLimits
from tgis.router.core.block_pool import blocks_for
from tgis.router.core.speculation import SpeculationConfig
from tgis.router.errors import StartupError
from tgis.shard_api.messages import ShardInfo

log = logging.getLogger(__name__)


def log_shard(info: ShardInfo) -> None:
    log.info(
        "shard: %s on %s (%s, %s attention), %d KV blocks of %d tokens, %d rank(s)",
        info.model_type,
        info.device,
        info.dtype,
        info.attention_backend,
        info.num_blocks,
        info.block_size,
        info.world_size,
    )
    if info.adapters_enabled:
        log.info("adapters: enabled, up to %d LoRA adapters per step", info.max_loras)


def check_capacity(config: RouterConfig, info: ShardInfo, capacity: int) -> None:
    """StartupError unless one request of ``max_sequence_length`` fits in the ``capacity``
    blocks the router may allocate; a warning when ``--max-batch-total-tokens`` asks for
    more than the shard has."""
    needed = blocks_for(config.max_sequence_length, info.block_size)
    if needed > capacity:
        raise StartupError(
            f"The provided max_sequence length ({config.max_sequence_length}) needs "
            f"{needed} KV blocks, more than the KV capacity ({capacity} blocks of "
            f"{info.block_size} tokens)"
        )
    total = config.max_batch_total_tokens
    if total is not None and blocks_for(total, info.block_size) > info.num_blocks:
        log.warning(
            "max_batch_total_tokens (%d) is more than the shard's KV capacity (%d tokens)",
            total,
            info.num_blocks * info.block_size,
        )


def log_batching(limits: SchedulerLimits, capacity: int, info: ShardInfo) -> None:
    log.info(
        "batching: up to %d sequences and %d KV tokens, %d prompt tokens per step, "
        "max_waiting_tokens %d, waiting_served_ratio %g, %s",
        limits.max_batch_size,
        capacity * info.block_size,
        limits.max_batch_prefill_tokens,
        limits.max_waiting_tokens,
        limits.waiting_served_ratio,
        "preemption" if limits.preemption else "worst case reserved (encoder-decoder)",
    )


def log_prefix_caching(asked: bool, info: ShardInfo) -> None:
    """Say once whether prompts' cached KV blocks are reused, and why not."""
    if not asked:
        log.info("prefix caching: off (--disable-prefix-caching)")
    elif info.state_slots:
        log.info("prefix caching: off, the model keeps recurrent state (Mamba layers)")
    elif not info.prefix_caching:
        log.info(
            "prefix caching: off, the %s engine does not support it (%s)",
            info.attention_backend,
            "encoder-decoder model" if info.is_seq2seq else "transformers fallback",
        )
    else:
        log.info("prefix caching: on, in blocks of %d tokens", info.block_size)


def log_speculation(speculation: SpeculationConfig | None, info: ShardInfo) -> None:
    """Say once whether decodes carry drafted tokens, and why not."""
    if speculation is None:
        log.info("speculative decoding: off (--speculate 0)")
    elif info.state_slots:
        log.info("speculative decoding: off, the model keeps recurrent state (Mamba layers)")
    elif not info.speculation:
        log.info(
            "speculative decoding: off, the %s engine does not verify drafts",
            info.attention_backend,
        )
    elif info.draft_model:
        log.info(
            "speculative decoding: up to %d tokens drafted on the shard by --speculator-name "
            "(a draft model or an MLP speculator) while at most %d sequences run",
            speculation.tokens,
            speculation.max_batch_size,
        )
    else:
        log.info(
            "speculative decoding: up to %d tokens drafted by prompt lookup (suffixes of %d to "
            "%d tokens) while at most %d sequences run; those steps run one at a time",
            speculation.tokens,
            speculation.min_ngram,
            speculation.max_ngram,
            speculation.max_batch_size,
        )


def warn_adjusted_limits(config: RouterConfig) -> None:
    if config.max_new_tokens >= config.max_sequence_length:
        log.warning(
            "adjusting max_new_tokens (%d) down to max_sequence_length - 1 (%d)",
            config.max_new_tokens,
            config.max_sequence_length - 1,
        )
