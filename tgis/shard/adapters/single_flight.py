"""Concurrent loads of one item share one read: the first caller loads, the others wait
for its result (or its error). Used by the prefix store and the adapter cache.

It caches nothing and has no lock of its own: the owner calls :meth:`SingleFlight.join`
under its own lock, in the same critical section as its cache lookup, so that an item is
never read twice (a hit, or a load in progress, or a new load: one of the three, decided
atomically). Failures are not remembered: the next caller starts a new load.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Generic, TypeVar

_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class Flight(Generic[_T]):
    """One caller's part in the load of ``key``: its owner runs it, the others wait."""

    key: str
    result: Future[_T]
    owner: bool


class SingleFlight(Generic[_T]):
    def __init__(self, lock: threading.Lock) -> None:
        self._lock = lock  # the owner's: held by the caller of join
        self._loading: dict[str, Future[_T]] = {}

    def join(self, key: str) -> Flight[_T]:
        """The load of ``key`` in progress, or a new one this caller owns. Call it with the
        owner's lock held, after a cache miss."""
        pending = self._loading.get(key)
        if pending is not None:
            return Flight(key, pending, owner=False)
        pending = self._loading[key] = Future()
        return Flight(key, pending, owner=True)

    def land(self, flight: Flight[_T], load: Callable[[], _T]) -> _T:
        """The flight's value: ``load()`` for its owner (shared with those waiting, its
        error too), the owner's for the others. Call it without the lock."""
        if not flight.owner:
            return flight.result.result()
        try:
            value = load()
        except BaseException as e:
            flight.result.set_exception(e)
            raise
        else:
            flight.result.set_result(value)
            return value
        finally:
            with self._lock:
                del self._loading[flight.key]
