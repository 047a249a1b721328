"""Graceful shutdown state: refuse new generation calls, count the ones still running.

On SIGTERM the router calls ``start``: from then on ``GET /health`` answers 503, the gRPC
health service NOT_SERVING, and ``enter`` refuses new Generate/GenerateStream calls (the
servicer answers UNAVAILABLE), while the calls already in flight run to their end;
``wait_idle`` returns when the last one has (or the grace period is over).
"""

from __future__ import annotations

import asyncio

SHUTTING_DOWN_MESSAGE = "Server is shutting down"


class Drain:
    """Used from the event loop's thread only."""

    def __init__(self) -> None:
        self.draining = False
        self._active = 0
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def active(self) -> int:
        """Generation calls in flight."""
        return self._active

    def start(self) -> None:
        self.draining = True

    def enter(self) -> bool:
        """Count a new call in; False (and not counted) once draining."""
        if self.draining:
            return False
        self._active += 1
        self._idle.clear()
        return True

    def exit(self) -> None:
        self._active -= 1
        if self._active <= 0:
            self._active = 0
            self._idle.set()

    async def wait_idle(self, timeout: float) -> bool:
        """True when no call is in flight within ``timeout`` seconds."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            return False
        return True
