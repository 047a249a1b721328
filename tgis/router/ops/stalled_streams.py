"""Streams whose client stopped reading: found and cancelled after a limit.

A GenerateStream hands each message to gRPC and waits until gRPC has sent it; when the
client stops reading, HTTP/2 flow control stops that send, and the call would hold its
concurrency permit, its queued token events and its connection for as long as the client
likes. Generation itself never waits for a client (the engine only queues events), so the
batch goes on either way; this bounds what a stalled client can hold.

Each stream marks when it hands a message over and when gRPC has taken it (two attribute
writes per message); one check a second cancels the call of every stream whose message has
waited longer than the limit. Cancelling the call's task ends the RPC (the client sees
``CANCELLED``) and the stream's own clean-up frees the request and its permit.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from tgis.router.config import DEFAULT_STREAM_STALL_TIMEOUT_S

log = logging.getLogger(__name__)

CHECK_INTERVAL_S = 1.0


@dataclass(slots=True, eq=False)
class WatchedStream:
    """One stream's call: its task and, while gRPC is sending a message, since when."""

    task: asyncio.Task[object]
    request_id: int = 0
    sending_since: float | None = None


class StalledStreams:
    """Cancels the streams whose client has taken no message for ``limit`` seconds."""

    def __init__(self, limit: float = DEFAULT_STREAM_STALL_TIMEOUT_S) -> None:
        self.limit = limit
        self.check_interval = min(CHECK_INTERVAL_S, limit / 2)
        self._streams: set[WatchedStream] = set()
        self._checker: asyncio.Task[None] | None = None

    def watch(self) -> WatchedStream:
        """Watch the stream served by the running task (the call's own)."""
        task = asyncio.current_task()
        assert task is not None, "watch() runs inside the call's task"
        stream = WatchedStream(task)
        self._streams.add(stream)
        if self._checker is None or self._checker.done():
            self._checker = asyncio.create_task(self._check_forever(), name="stalled-streams")
        return stream

    def forget(self, stream: WatchedStream) -> None:
        self._streams.discard(stream)

    def cancel_stalled(self, now: float) -> int:
        """Cancel every stream whose current message has waited past the limit; how many."""
        stalled = [
            s
            for s in self._streams
            if s.sending_since is not None and now - s.sending_since > self.limit
        ]
        for stream in stalled:
            log.warning(
                "request %d: its client took no message for %g s, cancelling the stream",
                stream.request_id,
                self.limit,
            )
            self._streams.discard(stream)
            stream.task.cancel()
        return len(stalled)

    async def _check_forever(self) -> None:
        while self._streams:
            await asyncio.sleep(self.check_interval)
            self.cancel_stalled(time.monotonic())
