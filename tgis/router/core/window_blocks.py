"""KV blocks behind a sliding window go back to the pool while their sequence runs, when
every layer of the model slides one (``ShardInfo.kv_window``, the largest window).

A query at position ``p`` reads the keys at ``p - kv_window < t <= p`` only
(``AttentionBackend.forward``). Once a step's output is back with a sequence's first
``computed`` positions computed, every later query is at ``computed`` or after: a step
planned on top of that one starts there, and a failed later step rolls back to there. So
the blocks wholly before ``computed - kv_window + 1`` are never read again and go back
(``Scheduler.update`` calls this after registering the step's blocks in the prefix cache).
Their ids stay at their places in ``RequestState.block_ids`` (``released_blocks`` counts
them) and in the shard's block table, which reads nothing outside the window.

With the prefix cache only registered blocks go: a given-back cached block stays idle and
findable, like a finished request's, until it is evicted. A preempted sequence is
admitted again with blocks for every known position, as without a window, and gives back
those behind the window as its recompute passes them.
"""

from __future__ import annotations

from tgis.router.core.prefix_cache import PrefixCache
from tgis.router.core.request_state import RequestState

__all__ = ["blocks_behind", "release_behind_window"]


def blocks_behind(computed: int, window: int, block_size: int) -> int:
    """How many first blocks no query at ``computed`` or after reads."""
    return max(computed - window + 1, 0) // block_size


def release_behind_window(
    cache: PrefixCache, state: RequestState, computed: int, window: int
) -> int:
    """Give back ``state``'s blocks behind the window of a query at ``computed`` to
    ``cache.pool``; returns how many went."""
    behind = blocks_behind(computed, window, cache.pool.block_size)
    if cache.enabled:
        behind = min(behind, state.registered_blocks)
    released = state.released_blocks
    if behind <= released:
        return 0
    cache.pool.release(state.block_ids[released:behind])
    state.released_blocks = behind
    return behind - released
