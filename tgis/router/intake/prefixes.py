"""Prompt-tuning prefix lengths and versions (``prefix_id``, spec §1.6): asked of the
shard, cached.

Validation needs a prefix's length (its virtual tokens count in the length limits, and the
scheduler allocates KV blocks for them) before it tokenizes; the prefix cache keys KV blocks
by the version of its contents. The shard answers
``PrefixLookup`` (loading the prefix into its own cache on the way); :class:`PrefixInfos`
keeps the successful answers as TGIS's router does in its Moka cache (``lookup_cache.py``:
at most 256 prefix ids, each for one hour after it was looked up, least recently used out
first; failures not cached; concurrent misses of one id share a single lookup). Only
lookups (cache misses) are timed and counted (``tgi_prompt_load_duration``,
``tgi_prompt_load_failure``).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

from tgis.router.intake.lookup_cache import CACHE_CAPACITY, CACHE_TTL_S, LookupCache
from tgis.router.ops.metrics import Metrics
from tgis.shard_api.messages import PrefixInfo

__all__ = ["CACHE_CAPACITY", "CACHE_TTL_S", "PrefixInfos", "PrefixLookup"]

PrefixLookup = Callable[[str], Awaitable[PrefixInfo]]
"""Asks the shard for a prefix's length and version (``ShardClient.prefix_info``); raises
``PrefixLookupError`` or ``ShardError`` when it cannot."""


class PrefixInfos(LookupCache[PrefixInfo]):
    """Lengths and versions of prompt prefixes by id: cached, looked up on a miss, misses
    recorded in ``metrics``."""

    def __init__(
        self,
        lookup: PrefixLookup,
        metrics: Metrics,
        *,
        capacity: int = CACHE_CAPACITY,
        ttl: float = CACHE_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(
            lookup,
            capacity=capacity,
            ttl=ttl,
            clock=clock,
            on_loaded=metrics.prompt_loaded,
            on_failed=metrics.prompt_load_failed,
        )
