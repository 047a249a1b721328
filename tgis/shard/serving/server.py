"""The servers of a rank: ``ShardService`` (gRPC) on ``unix://{uds_path}-{rank}`` and, where
the rank runs Steps, the step channel on ``{uds_path}-{rank}.steps``.

Rank 0 alone serves the router: Info (which names the step channel), Health and Reset over
gRPC, Steps over the channel (``tgis.shard_api.channel``; the gRPC Step RPC answers too),
both through one ``StepExecutor``. With tensor parallelism its runner is a
``native.runtime.lockstep.LockstepRunner`` that broadcasts each StepPlan to the other ranks, whose
own servers answer only Info and Health (``tensor_parallel.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from pathlib import Path

import grpc

from tgis.pb import shard_pb2_grpc
from tgis.shard.serving.servicer import ShardServicer
from tgis.shard.serving.step_executor import StepExecutor
from tgis.shard.step.runner import Runner
from tgis.shard_api.channel import StepChannelServer, step_channel_path
from tgis.stop_requests import (
    POLL_S,
    ignore_stop_signals,
    launcher_pid,
    on_stop_signals,
    wait_until_orphaned,
)

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 256 * 1024 * 1024
SHUTDOWN_GRACE_S = 5.0
ORPHAN_WAIT_S = 5.0
"""Once the launcher is gone: how long the shard waits for the router to let go."""


class ShardServer:
    """A started/stopped gRPC server (and step channel) around a Runner."""

    def __init__(
        self, runner: Runner, socket_path: str, rank: int = 0, serves_steps: bool = True
    ) -> None:
        self.runner = runner
        self.socket_path = Path(socket_path)
        self.rank = rank
        self.executor = StepExecutor(runner)
        self._channel = (
            StepChannelServer(step_channel_path(socket_path), self.executor.step)
            if serves_steps
            else None
        )
        self._servicer = ShardServicer(
            self.executor, self._channel.path if self._channel is not None else ""
        )
        self._server: grpc.aio.Server | None = None

    @property
    def address(self) -> str:
        """The gRPC target clients connect to."""
        return f"unix://{self.socket_path}"

    async def start(self) -> None:
        """Remove a stale socket file, bind and start serving."""
        remove_socket(self.socket_path)
        self.socket_path.parent.mkdir(parents=True, exist_ok=True)
        server = grpc.aio.server(
            options=[
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ]
        )
        shard_pb2_grpc.add_ShardServiceServicer_to_server(self._servicer, server)
        server.add_insecure_port(self.address)
        if self._channel is not None:
            self._channel.start()
        await server.start()
        self._server = server
        log.info("Shard %d ready on %s", self.rank, self.address)

    async def stop(self, grace: float = SHUTDOWN_GRACE_S) -> None:
        """Finish in-flight RPCs (up to ``grace`` seconds), stop, remove the socket."""
        if self._server is not None:
            await self._server.stop(grace)
            self._server = None
        if self._channel is not None:
            await asyncio.to_thread(self._channel.close)
        await asyncio.to_thread(self._servicer.close)
        remove_socket(self.socket_path)

    async def serve_until_signal(self) -> None:
        """Start, serve until SIGTERM or SIGINT (or the launcher's end), then stop
        gracefully."""
        stop = asyncio.Event()
        on_stop_signals(stop.set)
        await self.start()
        signalled = asyncio.ensure_future(stop.wait())
        orphaned = asyncio.ensure_future(wait_until_orphaned(launcher_pid(os.environ)))
        try:
            await asyncio.wait((signalled, orphaned), return_when=asyncio.FIRST_COMPLETED)
            if orphaned.done() and not signalled.done():
                await self._let_the_router_go(stop)
            log.info("Shard %d shutting down", self.rank)
        finally:
            signalled.cancel()
            orphaned.cancel()
            ignore_stop_signals()
            await self.stop()

    async def _let_the_router_go(self, stop: asyncio.Event) -> None:
        """The launcher is gone: the router, gone too, ends its calls with its own message;
        the steps it still sends are served until it lets go of the step channel (or
        ``ORPHAN_WAIT_S`` pass, or a signal comes)."""
        log.warning(
            "Shard %d: the launcher is gone; stopping once the router has (at most %g s)",
            self.rank,
            ORPHAN_WAIT_S,
        )
        deadline = time.monotonic() + ORPHAN_WAIT_S
        channel = self._channel
        while channel is not None and channel.connected and not stop.is_set():
            if time.monotonic() >= deadline:
                break
            await asyncio.sleep(POLL_S)


def remove_socket(path: Path) -> None:
    """Delete a socket file if it exists."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
