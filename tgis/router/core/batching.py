"""The batching budgets and the KV capacity the router allocates, each decided once.

The composition root (``server.py``) calls :func:`scheduler_limits` and :func:`new_scheduler`
at start-up; the engine and the start-up checks use the scheduler this returns.
"""

from __future__ import annotations

from tgis.router.config import RouterConfig
from tgis.router.core.block_allocator import BlockAllocator, blocks_for
from tgis.router.core.scheduler import Scheduler, SchedulerLimits
from tgis.shard_api.messages import ShardInfo


def scheduler_limits(config: RouterConfig, info: ShardInfo) -> SchedulerLimits:
    """The scheduler's budgets from the flags and the shard's facts. Decided here only:
    an encoder-decoder shard, which cannot recompute generated tokens, gets no preemption
    (each request's worst case is reserved at admission instead)."""
    max_waiting_tokens, waiting_served_ratio = config.joining_rule
    return SchedulerLimits(
        max_batch_size=config.effective_max_batch_size,
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


def new_scheduler(limits: SchedulerLimits, info: ShardInfo) -> Scheduler:
    """An empty scheduler over the KV blocks the router may allocate
    (:func:`kv_capacity_blocks`)."""
    return Scheduler(BlockAllocator(kv_capacity_blocks(limits, info), info.block_size), limits)
