"""A small async cache of answers the shard gives about ids (prompt prefixes, adapters).

:class:`LookupCache` keeps the successful answers of a lookup function as TGIS's router keeps
prefix lengths in its Moka cache: at most ``capacity`` ids, each for ``ttl`` seconds after
it was looked up (an item changed on disk keeps its old answer that long), the least
recently used dropped first beyond ``capacity``. Failures are not cached: the next request
asks again. Concurrent misses of one id share a single lookup, whose failure they all get.
Optional callbacks see each lookup (cache miss) end: its duration when it succeeded, or
that it failed (``PrefixInfos`` turns them into ``tgi_prompt_load_*``).
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

__all__ = ["CACHE_CAPACITY", "CACHE_TTL_S", "LookupCache"]

CACHE_CAPACITY = 256
"""Ids whose answer is kept (TGIS: ``max_capacity(256)``)."""
CACHE_TTL_S = 3600.0
"""Seconds an answer is kept, counted from the lookup (TGIS: ``time_to_live``)."""

V = TypeVar("V")


class LookupCache(Generic[V]):
    """Answers by id: cached, looked up with ``lookup`` on a miss."""

    def __init__(
        self,
        lookup: Callable[[str], Awaitable[V]],
        *,
        capacity: int = CACHE_CAPACITY,
        ttl: float = CACHE_TTL_S,
        clock: Callable[[], float] = time.monotonic,
        on_loaded: Callable[[float], None] | None = None,
        on_failed: Callable[[], None] | None = None,
    ) -> None:
        """``on_loaded(seconds)`` / ``on_failed()``: called when a lookup succeeds or fails."""
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self._lookup = lookup
        self._capacity = capacity
        self._ttl = ttl
        self._clock = clock
        self._on_loaded = on_loaded
        self._on_failed = on_failed
        # id -> (answer, expiry on `clock`), least recently used first.
        self._entries: OrderedDict[str, tuple[V, float]] = OrderedDict()
        self._pending: dict[str, asyncio.Future[V]] = {}

    def __len__(self) -> int:
        """Entries held, expired ones not yet dropped included."""
        return len(self._entries)

    def cached(self, key: str) -> V | None:
        """The cached answer for ``key`` (None when absent or expired); a use of the entry,
        as a lookup hit is."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        value, expires = entry
        if self._clock() >= expires:
            del self._entries[key]
            return None
        self._entries.move_to_end(key)
        return value

    def forget(self, key: str) -> None:
        """Drop ``key``'s answer: the next request looks it up again."""
        self._entries.pop(key, None)

    async def get(self, key: str) -> V:
        """The answer for ``key``, from the cache or from a lookup.

        Raises whatever the lookup raised; a caller cancelled while it waits leaves the
        lookup running for the others.
        """
        value = self.cached(key)
        if value is not None:
            return value
        pending = self._pending.get(key)
        if pending is None:
            pending = asyncio.ensure_future(self._load(key))
            self._pending[key] = pending
            pending.add_done_callback(lambda done: self._settled(key, done))
        return await asyncio.shield(pending)

    async def _load(self, key: str) -> V:
        """One lookup: timed and stored when it succeeds, reported when it fails."""
        started = self._clock()
        try:
            value = await self._lookup(key)
        except Exception:
            if self._on_failed is not None:
                self._on_failed()
            raise
        now = self._clock()
        if self._on_loaded is not None:
            self._on_loaded(now - started)
        self._store(key, value, now)
        return value

    def _store(self, key: str, value: V, now: float) -> None:
        self._entries[key] = (value, now + self._ttl)
        self._entries.move_to_end(key)
        if len(self._entries) <= self._capacity:
            return
        for stale in [k for k, (_, expires) in self._entries.items() if now >= expires]:
            del self._entries[stale]
        while len(self._entries) > self._capacity:
            self._entries.popitem(last=False)

    def _settled(self, key: str, done: asyncio.Future[V]) -> None:
        """Done callback of a lookup (it runs before any waiter resumes): it is no longer
        pending, so whoever asks next gets the cached answer or a lookup of its own (also
        when it was cancelled before it ran); its error counts as retrieved even when every
        waiter left."""
        if self._pending.get(key) is done:
            del self._pending[key]
        if not done.cancelled():
            done.exception()
