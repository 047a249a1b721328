"""What the operations and fault tests watch on a launched server: a long stream consumed
by a thread, the gRPC health status, and waiting for a condition."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tgis.launcher.local_process import LauncherProcess
from tgis.pb import generation_pb2 as pb
from tgis.pb import generation_pb2_grpc as pb_grpc

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def greedy(tokens: int) -> pb.Parameters:
    """Greedy decoding of exactly ``tokens`` tokens."""
    return pb.Parameters(
        method=pb.GREEDY,
        stopping=pb.StoppingCriteria(max_new_tokens=tokens, min_new_tokens=tokens),
    )


@dataclass
class Stream:
    """A GenerateStream consumed by a thread: its progress, end and error."""

    tokens: int = 0
    stop_reason: int = pb.NOT_FINISHED
    text: str = ""
    error: BaseException | None = None
    started: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)


def start_stream(
    channel: grpc.Channel, tokens: int, text: str = "Once upon a time", started_after: int = 5
) -> tuple[Stream, threading.Thread]:
    """A stream of exactly ``tokens`` greedy tokens consumed by a new thread; its
    ``started`` event is set once it has produced ``started_after`` tokens (or ended)."""
    stream = Stream()

    def consume() -> None:
        try:
            request = pb.SingleGenerationRequest(
                request=pb.GenerationRequest(text=text), params=greedy(tokens)
            )
            for message in pb_grpc.GenerationServiceStub(channel).GenerateStream(
                request, timeout=120
            ):
                stream.tokens = max(stream.tokens, message.generated_token_count)
                stream.stop_reason = message.stop_reason
                stream.text += message.text
                if stream.tokens >= started_after:
                    stream.started.set()
        except BaseException as err:
            stream.error = err
        finally:
            stream.started.set()
            stream.done.set()

    thread = threading.Thread(target=consume, daemon=True)
    thread.start()
    return stream, thread


@contextmanager
def long_stream(
    channel: grpc.Channel, tokens: int, text: str = "Once upon a time"
) -> Iterator[Stream]:
    """Start a stream of ``tokens`` tokens; yields once it has produced some (5), and
    waits for its end when the block ends."""
    stream, thread = start_stream(channel, tokens, text)
    assert stream.started.wait(60)
    assert stream.error is None, stream.error
    try:
        yield stream
    finally:
        thread.join(120)


def wait_until(condition: Callable[[], object], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def health_status(channel: grpc.Channel, timeout: float = 5.0) -> int:
    """grpc.health.v1 Check of the whole server."""
    stub = health_pb2_grpc.HealthStub(channel)
    return int(stub.Check(health_pb2.HealthCheckRequest(), timeout=timeout).status)


def metric_sample(server: LauncherProcess, sample: str) -> float | None:
    """The value of one unlabelled sample (or ``name{labels}`` as exposed) of the server's
    /metrics; None when it is not exposed."""
    _, body = server.http_get("/metrics")
    for line in body.decode().splitlines():
        if line.startswith(sample + " "):
            return float(line.split()[-1])
    return None
