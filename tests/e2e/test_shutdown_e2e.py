"""How the server stops with calls in flight on both APIs, with the real launcher, router and
shard: at the end of the grace period, at a second SIGTERM, and when the launcher is killed.

Every call still running is ended in a way its client can tell from success (gRPC:
``UNAVAILABLE`` with a message saying why; an OpenAI stream: an error event in OpenAI's
shape and no ``[DONE]``, then a clean close; a unary OpenAI call: 503), and every process
exits by itself within seconds, no shard aborting. (A drain whose calls all finish inside
the grace period: test_operations_e2e.py and test_openai_operations_e2e.py.)
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest

from tests.e2e.probes import (
    EventStream,
    Stream,
    start_event_stream,
    start_stream,
    wait_until,
)
from tests.e2e.server import LauncherProcess, descendants, is_alive, start_launcher

pytestmark = pytest.mark.slow

TOKENS = 1000  # each call outlasts the grace period several times over
SHUTTING_DOWN = "Server is shutting down: the request was ended after "


@dataclass
class UnaryCompletion:
    """A non-streamed /v1/completions in a thread: its HTTP status and body."""

    status: int = 0
    body: dict[str, Any] = field(default_factory=dict)
    error: BaseException | None = None


def start_unary_completion(
    launcher: LauncherProcess, tokens: int
) -> tuple[UnaryCompletion, threading.Thread]:
    result = UnaryCompletion()
    body = {"prompt": "Hello", "max_tokens": tokens, "min_tokens": tokens, "temperature": 0}

    def call() -> None:
        request = urllib.request.Request(
            launcher.http_base + "/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=120) as response:
                result.status, result.body = response.status, json.loads(response.read())
        except urllib.error.HTTPError as err:
            result.status, result.body = err.code, json.loads(err.read())
        except BaseException as err:
            result.error = err

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    return result, thread


@dataclass
class InFlight:
    """Calls of both APIs running on one server."""

    grpc_streams: list[Stream]
    event_streams: list[EventStream]
    unary: UnaryCompletion
    threads: list[threading.Thread]

    def join(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for thread in self.threads:
            thread.join(max(deadline - time.monotonic(), 0.0))
        assert not any(thread.is_alive() for thread in self.threads), "a call did not end"


def start_calls(launcher: LauncherProcess, channel: grpc.Channel) -> InFlight:
    """Two gRPC streams, two OpenAI streams and one unary OpenAI call, all running."""
    grpc_started = [start_stream(channel, TOKENS) for _ in range(2)]
    sse_started = [start_event_stream(launcher, TOKENS) for _ in range(2)]
    unary, unary_thread = start_unary_completion(launcher, TOKENS)
    for stream, _ in grpc_started:
        assert stream.started.wait(60) and stream.error is None, stream.error
    for event_stream, _ in sse_started:
        assert event_stream.started.wait(60) and event_stream.error is None, event_stream.error
    threads = [t for _, t in grpc_started] + [t for _, t in sse_started] + [unary_thread]
    return InFlight([s for s, _ in grpc_started], [s for s, _ in sse_started], unary, threads)


def assert_ended_because(calls: InFlight, why: str) -> None:
    """Every call ended before its last token, its client told ``why``."""
    message = SHUTTING_DOWN + why
    for stream in calls.grpc_streams:
        assert isinstance(stream.error, grpc.RpcError), stream.error
        assert stream.error.code() == grpc.StatusCode.UNAVAILABLE
        assert stream.error.details() == message
        assert stream.tokens < TOKENS
    error = {"message": message, "type": "service_unavailable", "param": None, "code": None}
    for event_stream in calls.event_streams:
        assert event_stream.error is None, event_stream.error  # a clean close, not a cut
        assert event_stream.status == 200
        assert event_stream.last == {"error": error}
        assert not event_stream.done_marker
        assert 0 < event_stream.chunks < TOKENS
    assert calls.unary.error is None, calls.unary.error
    assert (calls.unary.status, calls.unary.body) == (503, {"error": error})


def assert_stopped_cleanly(launcher: LauncherProcess, children: set[int]) -> None:
    wait_until(lambda: not [p for p in children if is_alive(p)], timeout=15)
    log = launcher.log_tail(400000)
    assert "Router stopped: exit status: 0" in log
    assert "Shard 0 stopped: exit status: 0" in log
    for bad in ("SIGABRT", "terminate called", "killing it", "Traceback"):
        assert bad not in log, log


def test_the_grace_period_ends_every_call_on_both_apis(tmp_path: Path) -> None:
    launcher = start_launcher(tmp_path, ["--shutdown-grace-period", "1"])
    try:
        launcher.wait_healthy()
        children = descendants(launcher.proc.pid)
        with grpc.insecure_channel(launcher.grpc_target) as channel:
            calls = start_calls(launcher, channel)
            signalled = time.monotonic()
            launcher.proc.send_signal(signal.SIGTERM)
            calls.join(60)
            ended_in = time.monotonic() - signalled
        assert_ended_because(calls, "the 1 s grace period")
        assert launcher.proc.wait(30) == 0, launcher.log_tail()
        stopped_in = time.monotonic() - signalled
        assert ended_in >= 1.0, ended_in
        print(
            f"calls ended {ended_in:.2f} s after SIGTERM, launcher exited after {stopped_in:.2f} s"
        )
        assert stopped_in < 1 + 10, launcher.log_tail()
        assert_stopped_cleanly(launcher, children)
    finally:
        launcher.stop()


def test_a_second_sigterm_ends_the_drain_at_once(tmp_path: Path) -> None:
    launcher = start_launcher(tmp_path, ["--shutdown-grace-period", "300"])
    try:
        launcher.wait_healthy()
        children = descendants(launcher.proc.pid)
        with grpc.insecure_channel(launcher.grpc_target) as channel:
            calls = start_calls(launcher, channel)
            launcher.proc.send_signal(signal.SIGTERM)
            wait_until(lambda: launcher.http_get("/health", timeout=5)[0] == 503)
            assert not any(stream.done.is_set() for stream in calls.grpc_streams)
            again = time.monotonic()
            launcher.proc.send_signal(signal.SIGTERM)
            calls.join(60)
        assert_ended_because(calls, "a second signal")
        assert launcher.proc.wait(30) == 0, launcher.log_tail()
        assert time.monotonic() - again < 10, launcher.log_tail()
        assert_stopped_cleanly(launcher, children)
    finally:
        launcher.stop()


def test_the_router_and_shard_stop_by_themselves_when_the_launcher_is_killed(
    tmp_path: Path,
) -> None:
    launcher = start_launcher(tmp_path)
    try:
        launcher.wait_healthy()
        roles = launcher.process_pids()
        children = set(roles["router"] + roles["shard"])
        assert roles["router"] and roles["shard"]
        with grpc.insecure_channel(launcher.grpc_target) as channel:
            calls = start_calls(launcher, channel)
            killed = time.monotonic()
            os.kill(launcher.proc.pid, signal.SIGKILL)
            calls.join(60)
        assert_ended_because(calls, "the launcher is gone")
        wait_until(lambda: not [p for p in children if is_alive(p)], timeout=15)
        print(f"router and shard gone {time.monotonic() - killed:.2f} s after the launcher")
        # The sockets are freed: a new server can take the same ports at once.
        assert not list(launcher.socket_dir.glob("shard-*")), "sockets left behind"
    finally:
        launcher.stop()
