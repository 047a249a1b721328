"""What the operations and fault tests watch on a launched server: a long stream consumed
by a thread (gRPC, or OpenAI's server-sent events read off the wire), the gRPC health
status, and waiting for a condition."""

from __future__ import annotations

import http.client
import json
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

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


@dataclass
class EventStream:
    """An OpenAI streamed completion read off the wire by a thread: every ``data:``
    payload parsed (JSON objects), whether ``data: [DONE]`` came, how the connection ended."""

    status: int = 0
    events: list[dict[str, Any]] = field(default_factory=list)
    done_marker: bool = False
    error: BaseException | None = None  # the connection failed (not a clean close)
    started: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)

    @property
    def chunks(self) -> int:
        """Events with choices (the text chunks)."""
        return sum(1 for event in self.events if event.get("choices"))

    @property
    def last(self) -> dict[str, Any] | None:
        return self.events[-1] if self.events else None


def start_event_stream(
    launcher: LauncherProcess,
    tokens: int,
    prompt: str = "Once upon a time",
    started_after: int = 5,
) -> tuple[EventStream, threading.Thread]:
    """A streamed ``/v1/completions`` of exactly ``tokens`` greedy tokens, consumed by a
    new thread; ``started`` is set after ``started_after`` chunks (or at its end)."""
    stream = EventStream()
    body = {
        "prompt": prompt, "max_tokens": tokens, "min_tokens": tokens, "temperature": 0,
        "stream": True,
    }  # fmt: skip

    def consume() -> None:
        connection = _http_connection(launcher)
        try:
            connection.request(
                "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
            )
            response = connection.getresponse()
            stream.status = response.status
            for raw in response:
                line = raw.decode().strip()
                if not line.startswith("data: "):
                    continue
                payload = line.removeprefix("data: ")
                if payload == "[DONE]":
                    stream.done_marker = True
                    continue
                stream.events.append(json.loads(payload))
                if stream.chunks >= started_after:
                    stream.started.set()
        except BaseException as err:
            stream.error = err
        finally:
            connection.close()
            stream.started.set()
            stream.done.set()

    thread = threading.Thread(target=consume, daemon=True)
    thread.start()
    return stream, thread


def _http_connection(launcher: LauncherProcess) -> http.client.HTTPConnection:
    if launcher.http_ca is None:
        return http.client.HTTPConnection("127.0.0.1", launcher.http_port, timeout=120)
    context = ssl.create_default_context(cafile=str(launcher.http_ca))
    return http.client.HTTPSConnection(
        "127.0.0.1", launcher.http_port, timeout=120, context=context
    )


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
