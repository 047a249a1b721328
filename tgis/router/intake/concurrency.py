"""The concurrency limit: inputs in flight (queued or running), all-or-nothing per RPC."""

from __future__ import annotations


class ConcurrencyLimiter:
    """Non-blocking permits; used only from the event loop thread, so no lock is needed."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.in_use = 0

    def try_acquire(self, count: int) -> bool:
        if self.in_use + count > self.limit:
            return False
        self.in_use += count
        return True

    def release(self, count: int) -> None:
        """Give back ``count`` permits; RuntimeError (nothing changed) if fewer are in use,
        so a double release cannot leave the count negative and so raise the limit."""
        if count > self.in_use:
            raise RuntimeError("more concurrency permits released than acquired")
        self.in_use -= count
