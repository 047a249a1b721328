"""Which queued requests join the running batch at a step: the scheduler's admission policy.

From the front of the queue only (no skipping), while the batch has slots
(``max_batch_size``), the step's prefill budget lasts (the last one admitted may get a
partial chunk), their KV blocks fit with ``headroom`` free blocks left next to running
sequences (none into an empty batch), and their LoRA adapters fit in ``max_loras``. A
request's prefix-cache hit is found here: its cached tokens cost no budget, its cached
blocks no fresh block (an idle one still uses up a free block). Fresh
requests joining a non-empty batch must also pass TGI's joining rule; resumed (preempted)
requests, which always lead the queue, never wait for it.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Collection, Sequence

from tgis.router.core.batching import SchedulerLimits
from tgis.router.core.block_pool import BlockPool
from tgis.router.core.prefix_cache import CacheHit, PrefixCache
from tgis.router.core.request_state import RequestState

__all__ = ["NONE_JOIN", "Joiners", "admission_blocks", "choose_joiners", "may_join"]


def admission_blocks(state: RequestState, blocks: BlockPool, preemption: bool) -> int:
    """Blocks a request holds when admitted (cached ones included): every token it knows,
    or, without preemption (encoder-decoder), its worst case."""
    if preemption:
        return blocks.blocks_for(state.known_length)
    return blocks.blocks_for(state.worst_case_length)


def may_join(
    count: int, running: int, steps_since_admission: int, max_waiting_tokens: int, ratio: float
) -> bool:
    """TGI's rule for ``count`` fresh requests joining a batch of ``running`` sequences:
    at least ``floor(running × ratio)`` of them, or ``max_waiting_tokens`` steps since
    fresh requests last joined."""
    if steps_since_admission >= max_waiting_tokens:
        return True
    return count >= math.floor(running * ratio)


class Joiners:
    """The requests chosen at one step with their prefix-cache hits, whether any of them is
    fresh (never admitted before: the joining rule's clock restarts), and whether the head
    of the queue waited only because the prefill budget ran out (``budget_hold``)."""

    __slots__ = ("budget_hold", "chosen", "fresh", "hits")

    def __init__(
        self,
        chosen: Sequence[RequestState],
        hits: Sequence[CacheHit],
        fresh: bool,
        budget_hold: bool,
    ) -> None:
        self.chosen = chosen
        self.hits = hits
        self.fresh = fresh
        self.budget_hold = budget_hold


NONE_JOIN = Joiners((), (), False, False)
"""Nothing to admit (an empty queue)."""


def choose_joiners(
    waiting: Collection[RequestState],
    running: Collection[RequestState],
    cache: PrefixCache,
    limits: SchedulerLimits,
    headroom: int,
    budget: int,
    steps_since_admission: int,
) -> Joiners:
    """The requests to admit this step, in queue order (the block pool is only read)."""
    if not waiting:
        return NONE_JOIN
    slots = limits.max_batch_size - len(running)
    max_loras = limits.max_loras
    # The running batch's distinct LoRA adapters, only when their number is limited.
    loras = (
        {s.request.lora_id for s in running if s.request.lora_id}
        if max_loras is not None
        else set()
    )
    pool = cache.pool
    chosen: list[RequestState] = []
    hits: list[CacheHit] = []
    blocks = 0
    budget_hold = False
    for state in waiting:
        if len(chosen) >= slots or state.generation_scheduled:
            break
        if budget <= 0:
            budget_hold = True
            break
        lora = state.request.lora_id
        if max_loras is not None and lora and lora not in loras and len(loras) >= max_loras:
            break
        hit = cache.lookup(state)
        need = admission_blocks(state, pool, limits.preemption) - len(hit.blocks) + hit.idle
        if blocks + need + (headroom if running or chosen else 0) > pool.num_free:
            break
        if lora:
            loras.add(lora)
        chosen.append(state)
        hits.append(hit)
        blocks += need
        budget -= min(state.uncomputed - hit.tokens, budget)
    # Resumed requests are older than every fresh one, so they lead the queue.
    resumed = list(itertools.takewhile(lambda s: s.preemptions > 0, chosen))
    fresh = len(chosen) - len(resumed)
    if (
        fresh
        and running
        and not may_join(
            fresh,
            len(running),
            steps_since_admission,
            limits.max_waiting_tokens,
            limits.waiting_served_ratio,
        )
    ):
        return Joiners(resumed, hits[: len(resumed)], False, budget_hold)
    return Joiners(chosen, hits, fresh > 0, budget_hold)
