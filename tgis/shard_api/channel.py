"""The step channel: Steps over a Unix stream socket, in order, without gRPC's per-call cost.

Wire format (``protos/shard.proto``, "step channel"): each frame is a 4-byte little-endian
length and a serialized message, ``StepRequest`` from the router, one ``StepReply`` per
request from the shard, in the order the requests came. Because the shard runs Steps in
arrival order, the router can send Step n+1 while Step n runs (``StepPlan.base_step_id``
guards against running a step planned on top of one that failed).

``StepChannelServer`` (shard side) serves one blocking thread per connection: read a
request, run the handler, write the reply; the handler raises ``StepFailed`` for the
failures the protocol names, anything else is reported as ``INTERNAL``.
``StepChannelClient`` (router side) is an asyncio protocol: ``send`` writes a request at
once and returns a future for its reply; replies resolve futures first-in first-out.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Callable

import grpc

from tgis.pb import shard_pb2
from tgis.shard_api.codec import output_from_pb, output_to_pb, plan_from_pb, plan_to_pb
from tgis.shard_api.messages import StepErrorCode, StepOutput, StepPlan

log = logging.getLogger(__name__)

_LENGTH = struct.Struct("<I")
STEP_CHANNEL_SUFFIX = ".steps"
MAX_FRAME_BYTES = 256 * 1024 * 1024
CLOSE_JOIN_S = 8.0
"""How long closing the server waits for a step that is still running."""

# Each failure code of a Step: its value in the step channel's ``StepFailure`` and the gRPC
# status the ``Step`` RPC answers with (``shard.proto``). The one map of both, for the
# shard's two ways of answering a Step and the router's way of reading the channel's.
_CODES: dict[StepErrorCode, tuple[shard_pb2.StepFailure.Code, grpc.StatusCode]] = {
    StepErrorCode.INVALID_PLAN: (
        shard_pb2.StepFailure.INVALID_PLAN,
        grpc.StatusCode.INVALID_ARGUMENT,
    ),
    StepErrorCode.OUT_OF_MEMORY: (
        shard_pb2.StepFailure.OUT_OF_MEMORY,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    ),
    StepErrorCode.STALE_BASE: (shard_pb2.StepFailure.STALE_BASE, grpc.StatusCode.ABORTED),
    StepErrorCode.INTERNAL: (shard_pb2.StepFailure.INTERNAL, grpc.StatusCode.INTERNAL),
}
_FROM_WIRE = {wire: code for code, (wire, _) in _CODES.items()}


class StepFailed(Exception):
    """A whole Step failed on the shard, for one of the protocol's reasons (``code``), as
    the step channel carries it (``to_wire``, ``from_wire``) and as the ``Step`` RPC
    answers it (``grpc_status``)."""

    def __init__(self, code: StepErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message

    @classmethod
    def internal(cls, error: BaseException) -> StepFailed:
        """A failure the protocol does not name: ``INTERNAL``, with the error's message (its
        type's name when it has none)."""
        return cls(StepErrorCode.INTERNAL, str(error) or type(error).__name__)

    @classmethod
    def from_wire(cls, failure: shard_pb2.StepFailure) -> StepFailed:
        """The failure a step channel reply carries (an unknown code reads as INTERNAL)."""
        return cls(_FROM_WIRE.get(failure.code, StepErrorCode.INTERNAL), failure.message)

    def to_wire(self, failure: shard_pb2.StepFailure) -> None:
        """Fill a step channel reply's ``failure``."""
        failure.code = _CODES[self.code][0]
        failure.message = self.message

    @property
    def grpc_status(self) -> grpc.StatusCode:
        """The status the ``Step`` RPC answers this failure with."""
        return _CODES[self.code][1]


def step_channel_path(shard_socket_path: str) -> str:
    """Where a shard serving ``unix://<shard_socket_path>`` listens for Steps."""
    return shard_socket_path + STEP_CHANNEL_SUFFIX


def encode_frame(message: bytes) -> bytes:
    return _LENGTH.pack(len(message)) + message


# ---- shard side ------------------------------------------------------------------------------


class StepChannelServer:
    """Accepts connections on ``path`` and answers each StepRequest with ``handle(plan)``.

    ``handle`` is called from the connection's thread, one request at a time.
    """

    def __init__(self, path: str, handle: Callable[[StepPlan], StepOutput]) -> None:
        self.path = path
        self.handle = handle
        self._sock: socket.socket | None = None
        self._closed = threading.Event()
        self._connections: set[socket.socket] = set()
        self._threads: set[threading.Thread] = set()
        self._lock = threading.Lock()

    def start(self) -> None:
        """Bind (replacing a stale socket file) and accept in a background thread."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(self.path)
        sock.listen(4)
        self._sock = sock
        threading.Thread(target=self._accept, name="step-channel", daemon=True).start()

    @property
    def connected(self) -> int:
        """Connections open now (the router's, while it runs)."""
        with self._lock:
            return len(self._connections)

    def close(self, join_timeout: float = CLOSE_JOIN_S) -> None:
        """Stop accepting, drop connections, remove the socket file, and wait (up to
        ``join_timeout`` seconds) for a step still running on a connection's thread, so that
        the process never exits in the middle of one (the runtime aborts if it does)."""
        self._closed.set()
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)
            self._sock.close()
        with self._lock:
            for conn in list(self._connections):
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)
            threads = list(self._threads)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        deadline = time.monotonic() + join_timeout
        for thread in threads:
            thread.join(max(deadline - time.monotonic(), 0.0))
            if thread.is_alive():
                log.warning("step channel: a step still running after %g s", join_timeout)

    def _accept(self) -> None:
        assert self._sock is not None
        while not self._closed.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            thread = threading.Thread(
                target=self._serve, args=(conn,), name="step-channel-conn", daemon=True
            )
            with self._lock:  # started inside: close() joins only started threads
                self._connections.add(conn)
                self._threads.add(thread)
                thread.start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            while True:
                payload = _recv_frame(conn)
                if payload is None:
                    return
                conn.sendall(encode_frame(self._reply(payload)))
        except OSError as e:
            if not self._closed.is_set():
                log.warning("step channel connection lost: %s", e)
        finally:
            with self._lock:
                self._connections.discard(conn)
                self._threads.discard(threading.current_thread())
            conn.close()

    def _reply(self, payload: bytes) -> bytes:
        reply = shard_pb2.StepReply()
        try:
            plan = plan_from_pb(shard_pb2.StepRequest.FromString(payload))
            reply.response.CopyFrom(output_to_pb(self.handle(plan)))
        except StepFailed as e:
            e.to_wire(reply.failure)
        except Exception as e:  # a bug must fail the step, not the channel
            log.exception("step failed")
            StepFailed.internal(e).to_wire(reply.failure)
        return reply.SerializeToString()


def _recv_exactly(conn: socket.socket, size: int) -> bytes | None:
    chunks: list[bytes] = []
    while size:
        chunk = conn.recv(size)
        if not chunk:
            return None
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


def _recv_frame(conn: socket.socket) -> bytes | None:
    header = _recv_exactly(conn, _LENGTH.size)
    if header is None:
        return None
    (size,) = _LENGTH.unpack(header)
    if size > MAX_FRAME_BYTES:
        raise OSError(f"step channel frame of {size} bytes is too large")
    return _recv_exactly(conn, size) if size else b""


# ---- router side -----------------------------------------------------------------------------


class StepChannelClient(asyncio.Protocol):
    """The router's end of the step channel (one per shard endpoint)."""

    def __init__(self) -> None:
        self._transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self._pending: collections.deque[asyncio.Future[StepOutput]] = collections.deque()
        self._lost: BaseException | None = None

    @classmethod
    async def connect(cls, path: str) -> StepChannelClient:
        loop = asyncio.get_running_loop()
        _, protocol = await loop.create_unix_connection(cls, path)
        return protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport

    def send(self, plan: StepPlan) -> asyncio.Future[StepOutput]:
        """Write ``plan`` now; the future resolves with its output, or raises StepFailed
        (or ConnectionError when the channel is gone)."""
        future: asyncio.Future[StepOutput] = asyncio.get_running_loop().create_future()
        if self._lost is not None or self._transport is None:
            future.set_exception(ConnectionError(f"step channel closed: {self._lost}"))
            return future
        self._pending.append(future)
        self._transport.write(encode_frame(plan_to_pb(plan).SerializeToString()))
        return future

    @property
    def in_flight(self) -> int:
        """Steps sent and not answered yet."""
        return len(self._pending)

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer
        buffer += data
        offset = 0
        while len(buffer) - offset >= _LENGTH.size:
            (size,) = _LENGTH.unpack_from(buffer, offset)
            end = offset + _LENGTH.size + size
            if len(buffer) < end:
                break
            payload = bytes(buffer[offset + _LENGTH.size : end])
            offset = end
            self._resolve(payload)
        del buffer[:offset]

    def _resolve(self, payload: bytes) -> None:
        if not self._pending:
            log.error("step channel: a reply nobody asked for")
            return
        future = self._pending.popleft()
        if future.done():  # cancelled by its caller
            return
        try:
            reply = shard_pb2.StepReply.FromString(payload)
            if reply.HasField("failure"):
                future.set_exception(StepFailed.from_wire(reply.failure))
            else:
                future.set_result(output_from_pb(reply.response))
        except Exception as e:  # undecodable reply
            future.set_exception(e)

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = exc or ConnectionError("closed by the shard")
        while self._pending:
            future = self._pending.popleft()
            if not future.done():
                future.set_exception(ConnectionError(f"step channel lost: {self._lost}"))

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()
