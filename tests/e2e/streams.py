"""Calls to a launched server consumed by a thread of their own, the one harness of the e2e
tests: a gRPC GenerateStream (``GrpcStream``, ``start_stream``, ``long_stream``), an OpenAI
streamed completion read off the wire (``EventStream``, ``start_event_stream``) or through
the real ``openai`` client (``OpenAIStream``), and a unary OpenAI completion
(``UnaryCompletion``).

Each is a ``CallThread``: start it (or let ``start_*`` do it), then watch ``started`` (set
once it has produced ``started_after`` tokens or chunks, or at its end), ``done`` (its end),
``error`` (what ended it otherwise than cleanly: ``None`` for a clean end) and ``ended_at``;
what it received so far is on its attributes (``tokens``, ``text``, ...), and ``join`` waits
for it. Give several the same ``go`` event to start their calls at once.
"""

from __future__ import annotations

import http.client
import json
import ssl
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import grpc

from tests.e2e.probes import greedy
from tgis.launcher.local_process import LauncherProcess
from tgis.pb import generation_pb2 as pb
from tgis.pb import generation_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    import openai


class CallThread(threading.Thread):
    """A call consumed by this (daemon) thread: ``consume`` runs it and reports its progress
    through ``progressed``; anything it raises is the call's ``error``."""

    def __init__(self, started_after: int = 5, go: threading.Event | None = None) -> None:
        super().__init__(daemon=True)
        self.started_after = started_after
        self.go = go
        self.error: BaseException | None = None
        self.ended_at: float | None = None  # time.monotonic() at its end
        self.started = threading.Event()
        self.done = threading.Event()

    def run(self) -> None:
        if self.go is not None:
            self.go.wait()
        try:
            self.consume()
        except BaseException as err:
            self.error = err
        finally:
            self.ended_at = time.monotonic()
            self.started.set()
            self.done.set()

    def consume(self) -> None:
        raise NotImplementedError

    def progressed(self, count: int) -> None:
        if count >= self.started_after:
            self.started.set()


class GrpcStream(CallThread):
    """A GenerateStream: the generated token count, each message's text and token texts (when
    the request asks for them), the last message's stop reason and stop sequence. With
    ``cancel_after`` the call is cancelled once that many tokens have come (its CANCELLED is
    then no error)."""

    def __init__(
        self,
        target: grpc.Channel | pb_grpc.GenerationServiceStub,
        request: pb.SingleGenerationRequest,
        *,
        started_after: int = 5,
        cancel_after: int | None = None,
        go: threading.Event | None = None,
        timeout: float = 120,
    ) -> None:
        super().__init__(started_after, go)
        self.stub = (
            target
            if isinstance(target, pb_grpc.GenerationServiceStub)
            else pb_grpc.GenerationServiceStub(target)
        )
        self.request, self.cancel_after, self.timeout = request, cancel_after, timeout
        self.tokens = 0
        self.text = ""
        self.token_texts: list[str] = []
        self.stop_reason: int = pb.NOT_FINISHED
        self.stop_sequence = ""

    def consume(self) -> None:
        call = self.stub.GenerateStream(self.request, timeout=self.timeout)
        try:
            for message in call:
                self.tokens = max(self.tokens, message.generated_token_count)
                self.text += message.text
                self.token_texts += [t.text for t in message.tokens]
                self.stop_reason, self.stop_sequence = message.stop_reason, message.stop_sequence
                self.progressed(self.tokens)
                if self.cancel_after is not None and self.tokens >= self.cancel_after:
                    call.cancel()
                    return
        except grpc.RpcError as err:
            if err.code() != grpc.StatusCode.CANCELLED or self.cancel_after is None:
                raise

    def outcome(self) -> tuple[str, list[str], int, int, str]:
        return self.text, self.token_texts, self.tokens, self.stop_reason, self.stop_sequence


def stream_request(text: str, params: pb.Parameters) -> pb.SingleGenerationRequest:
    return pb.SingleGenerationRequest(request=pb.GenerationRequest(text=text), params=params)


def start_stream(
    target: grpc.Channel | pb_grpc.GenerationServiceStub,
    tokens: int,
    text: str = "Once upon a time",
    started_after: int = 5,
) -> GrpcStream:
    """A started stream of exactly ``tokens`` greedy tokens."""
    stream = GrpcStream(target, stream_request(text, greedy(tokens)), started_after=started_after)
    stream.start()
    return stream


@contextmanager
def long_stream(
    channel: grpc.Channel, tokens: int, text: str = "Once upon a time"
) -> Iterator[GrpcStream]:
    """Start a stream of ``tokens`` tokens; yields once it has produced some (5), and
    waits for its end when the block ends."""
    stream = start_stream(channel, tokens, text)
    assert stream.started.wait(60)
    assert stream.error is None, stream.error
    try:
        yield stream
    finally:
        stream.join(120)


class EventStream(CallThread):
    """A streamed ``/v1/completions`` read off the wire: the HTTP status, every ``data:``
    payload parsed (JSON objects), whether ``data: [DONE]`` came; ``error`` is set when the
    connection failed (not a clean close). ``started_after`` counts chunks."""

    def __init__(
        self, launcher: LauncherProcess, request_body: dict[str, Any], *, started_after: int = 5
    ) -> None:
        super().__init__(started_after)
        self.launcher, self.request_body = launcher, request_body
        self.status = 0
        self.events: list[dict[str, Any]] = []
        self.done_marker = False

    @property
    def chunks(self) -> int:
        """Events with choices (the text chunks)."""
        return sum(1 for event in self.events if event.get("choices"))

    @property
    def text(self) -> str:
        return "".join(c.get("text", "") for e in self.events for c in e.get("choices") or ())

    @property
    def last(self) -> dict[str, Any] | None:
        return self.events[-1] if self.events else None

    def consume(self) -> None:
        connection = _http_connection(self.launcher)
        try:
            connection.request(
                "POST",
                "/v1/completions",
                json.dumps(self.request_body),
                {"Content-Type": "application/json"},
            )
            response = connection.getresponse()
            self.status = response.status
            for raw in response:
                line = raw.decode().strip()
                if not line.startswith("data: "):
                    continue
                payload = line.removeprefix("data: ")
                if payload == "[DONE]":
                    self.done_marker = True
                    continue
                self.events.append(json.loads(payload))
                self.progressed(self.chunks)
        finally:
            connection.close()


def start_event_stream(
    launcher: LauncherProcess,
    tokens: int,
    prompt: str = "Once upon a time",
    started_after: int = 5,
) -> EventStream:
    """A started streamed ``/v1/completions`` of exactly ``tokens`` greedy tokens."""
    body = {
        "prompt": prompt, "max_tokens": tokens, "min_tokens": tokens, "temperature": 0,
        "stream": True,
    }  # fmt: skip
    stream = EventStream(launcher, body, started_after=started_after)
    stream.start()
    return stream


def _http_connection(launcher: LauncherProcess) -> http.client.HTTPConnection:
    if launcher.http_ca is None:
        return http.client.HTTPConnection("127.0.0.1", launcher.http_port, timeout=120)
    context = ssl.create_default_context(cafile=str(launcher.http_ca))
    return http.client.HTTPSConnection(
        "127.0.0.1", launcher.http_port, timeout=120, context=context
    )


class OpenAIStream(CallThread):
    """A streamed completion through the real ``openai`` client (``create`` gets ``kwargs``
    and ``stream=True``): the chunks with choices, their text, the last usage reported.
    ``started_after`` counts chunks."""

    def __init__(self, client: openai.OpenAI, *, started_after: int = 5, **kwargs: Any) -> None:
        super().__init__(started_after)
        self.client, self.kwargs = client, kwargs
        self.chunks = 0
        self.text = ""
        self.usage: Any = None

    def consume(self) -> None:
        for chunk in self.client.completions.create(stream=True, **self.kwargs):
            self.chunks += bool(chunk.choices)
            self.text += "".join(choice.text for choice in chunk.choices)
            self.usage = chunk.usage or self.usage
            self.progressed(self.chunks)


class UnaryCompletion(CallThread):
    """A non-streamed ``/v1/completions`` of exactly ``tokens`` greedy tokens: its HTTP
    status and body (an HTTP error status is an answer, not an ``error``)."""

    def __init__(self, launcher: LauncherProcess, tokens: int, prompt: str = "Hello") -> None:
        super().__init__(started_after=1)
        self.launcher = launcher
        self.request_body = {
            "prompt": prompt, "max_tokens": tokens, "min_tokens": tokens, "temperature": 0
        }  # fmt: skip
        self.status = 0
        self.body: dict[str, Any] = {}

    def consume(self) -> None:
        request = urllib.request.Request(
            self.launcher.http_base + "/v1/completions",
            data=json.dumps(self.request_body).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=120) as response:
                self.status, self.body = response.status, json.loads(response.read())
        except urllib.error.HTTPError as err:
            self.status, self.body = err.code, json.loads(err.read())
