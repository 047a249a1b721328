"""Prompt-tuning prefix lengths (``prefix_id``, spec §1.6): asked of the shard, cached.

Validation needs a prefix's length (its virtual tokens count in the length limits, and the
scheduler allocates KV blocks for them) before it tokenizes. The shard answers
``PrefixLookup`` (loading the prefix into its own cache on the way); :class:`PrefixLengths`
keeps the successful answers as TGIS's router does in its Moka cache: at most 256 prefix
ids, each for one hour after it was looked up (a prefix changed on disk keeps its old
length that long), the least recently used dropped first beyond 256. Failures are not
cached: the next request asks again. Concurrent misses of one id share a single lookup,
whose failure they all get. Only lookups (cache misses) are timed and counted
(``tgi_prompt_load_duration``, ``tgi_prompt_load_failure``).
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable

from tgis.router.metrics import Metrics

__all__ = ["CACHE_CAPACITY", "CACHE_TTL_S", "PrefixLengths", "PrefixLookup"]

CACHE_CAPACITY = 256
"""Prefix ids whose length is kept (TGIS: ``max_capacity(256)``)."""
CACHE_TTL_S = 3600.0
"""Seconds a looked-up length is kept, counted from the lookup (TGIS: ``time_to_live``)."""

PrefixLookup = Callable[[str], Awaitable[int]]
"""Asks the shard for a prefix's length (``ShardClient.prefix_length``); raises
``PrefixLookupError`` or ``ShardError`` when it cannot."""


class PrefixLengths:
    """Lengths of prompt prefixes by id: cached, looked up on a miss."""

    def __init__(
        self,
        lookup: PrefixLookup,
        metrics: Metrics,
        *,
        capacity: int = CACHE_CAPACITY,
        ttl: float = CACHE_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self._lookup = lookup
        self._metrics = metrics
        self._capacity = capacity
        self._ttl = ttl
        self._clock = clock
        # prefix id -> (length, expiry on `clock`), least recently used first.
        self._entries: OrderedDict[str, tuple[int, float]] = OrderedDict()
        self._pending: dict[str, asyncio.Future[int]] = {}

    def __len__(self) -> int:
        """Entries held, expired ones not yet dropped included."""
        return len(self._entries)

    def cached(self, prefix_id: str) -> int | None:
        """The cached length of ``prefix_id`` (None when absent or expired); a use of the
        entry, as a lookup hit is."""
        entry = self._entries.get(prefix_id)
        if entry is None:
            return None
        length, expires = entry
        if self._clock() >= expires:
            del self._entries[prefix_id]
            return None
        self._entries.move_to_end(prefix_id)
        return length

    async def get(self, prefix_id: str) -> int:
        """The length of ``prefix_id``, from the cache or from the shard.

        Raises whatever the lookup raised (``PrefixLookupError``, ``ShardError``); a caller
        cancelled while it waits leaves the lookup running for the others.
        """
        length = self.cached(prefix_id)
        if length is not None:
            return length
        pending = self._pending.get(prefix_id)
        if pending is None:
            pending = asyncio.ensure_future(self._load(prefix_id))
            self._pending[prefix_id] = pending
            pending.add_done_callback(lambda done: self._settled(prefix_id, done))
        return await asyncio.shield(pending)

    async def _load(self, prefix_id: str) -> int:
        """One lookup: timed and stored when it succeeds, counted when it fails."""
        started = self._clock()
        try:
            length = await self._lookup(prefix_id)
        except Exception:
            self._metrics.prompt_load_failed()
            raise
        now = self._clock()
        self._metrics.prompt_loaded(now - started)
        self._store(prefix_id, length, now)
        return length

    def _store(self, prefix_id: str, length: int, now: float) -> None:
        self._entries[prefix_id] = (length, now + self._ttl)
        self._entries.move_to_end(prefix_id)
        if len(self._entries) <= self._capacity:
            return
        for key in [k for k, (_, expires) in self._entries.items() if now >= expires]:
            del self._entries[key]
        while len(self._entries) > self._capacity:
            self._entries.popitem(last=False)

    def _settled(self, prefix_id: str, done: asyncio.Future[int]) -> None:
        """Done callback of a lookup (it runs before any waiter resumes): it is no longer
        pending, so whoever asks next gets the cached length or a lookup of its own (also
        when it was cancelled before it ran); its error counts as retrieved even when every
        waiter left."""
        if self._pending.get(prefix_id) is done:
            del self._pending[prefix_id]
        if not done.cancelled():
            done.exception()
