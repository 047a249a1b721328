"""The servers of a rank: ``ShardService`` (gRPC) on ``unix://{uds_path}-{rank}`` and, where
the rank runs Steps, the step channel on ``{uds_path}-{rank}.steps``.

Rank 0 alone serves the router: Info (which names the step channel), Health and Reset over
gRPC, Steps over the channel (``tgis.shard_api.channel``; the gRPC Step RPC answers too),
both through one ``StepExecutor``. With tensor parallelism its runner is a
``native.lockstep.LockstepRunner`` that broadcasts each StepPlan to the other ranks, whose
own servers answer only Info and Health (``tensor_parallel.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from pathlib import Path

import grpc

from tgis.pb import shard_pb2_grpc
from tgis.shard.serving.servicer import ShardServicer
from tgis.shard.serving.step_executor import StepExecutor
from tgis.shard.step.runner import Runner
from tgis.shard_api.channel import StepChannelServer, step_channel_path

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 256 * 1024 * 1024
SHUTDOWN_GRACE_S = 5.0


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
            self._channel.close()
        await asyncio.to_thread(self._servicer.close)
        remove_socket(self.socket_path)

    async def serve_until_signal(self) -> None:
        """Start, serve until SIGTERM or SIGINT, then stop gracefully."""
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await self.start()
        try:
            await stop.wait()
            log.info("Shard %d shutting down", self.rank)
        finally:
            await self.stop()


def remove_socket(path: Path) -> None:
    """Delete a socket file if it exists."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
