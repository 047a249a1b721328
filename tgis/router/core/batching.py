"""The batching budgets and the KV capacity the router allocates, each decided once.

The composition root (``server.py``) calls :func:`scheduler_limits`, then
``scheduler.py: new_scheduler``, at start-up; the engine and the start-up checks use the
scheduler that returns.
"""

from __future__ import annotations

from dataclasses import dataclass

from tgis.router.config import RouterConfig
from tgis.router.core.block_pool import blocks_for
from tgis.shard_api.messages import ShardInfo


@dataclass(frozen=True, slots=True)
class SchedulerLimits:
    """The scheduler's budgets and policy switches."""

    max_batch_size: int
    """Most sequences in the running batch."""
    max_batch_prefill_tokens: int
    """Most prompt (or recompute) tokens computed in one step; decode tokens come on top."""
    max_batch_total_tokens: int | None = None
    """KV tokens the running batch may hold; None: the shard's whole cache."""
    max_waiting_tokens: int = 0
    """Steps after which waiting requests join regardless of the ratio (0: at once)."""
    waiting_served_ratio: float = 0.0
    """Fresh requests join a running batch of n when at least floor(n × ratio) can."""
    preemption: bool = True
    """False: reserve each request's worst case at admission (no preemption needed)."""
    max_loras: int | None = None
    """Most different LoRA adapters in the running batch (the shard's ``max_loras``); None:
    no limit."""


def scheduler_limits(config: RouterConfig, info: ShardInfo) -> SchedulerLimits:
    """The scheduler's budgets from the flags and the shard's facts. Decided here only:
    an encoder-decoder shard, which cannot recompute generated tokens, gets no preemption
    (each request's worst case is reserved at admission instead); a model with recurrent
    state runs at most as many sequences as the shard has state slots."""
    max_waiting_tokens, waiting_served_ratio = config.joining_rule
    batch = config.effective_max_batch_size
    if info.state_slots:  # a model with recurrent state: one slot per running sequence
        batch = min(batch, info.state_slots)
    return SchedulerLimits(
        max_batch_size=batch,
        max_batch_prefill_tokens=config.prefill_budget(on_cpu=info.device == "cpu"),
        max_batch_total_tokens=config.max_batch_total_tokens,
        max_waiting_tokens=max_waiting_tokens,
        waiting_served_ratio=waiting_served_ratio,
        preemption=not info.is_seq2seq,
        # 0: adapters disabled or no LoRA (such requests are refused in validation)
        max_loras=info.max_loras or None,
    )


def kv_capacity_blocks(limits: SchedulerLimits, info: ShardInfo) -> int:
    """KV blocks the router allocates: the shard's, capped by max_batch_total_tokens
    (rounded up to whole blocks, so a total of max_sequence_length holds one request)."""
    if limits.max_batch_total_tokens is None:
        return info.num_blocks
    return min(info.num_blocks, blocks_for(limits.max_batch_total_tokens, info.block_size))
