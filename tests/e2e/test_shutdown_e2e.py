"""How the server stops with calls in flight on both APIs, with the real launcher, router and
shard: at the end of the grace period, at a second SIGTERM, and when the launcher is killed.

Every call still running is ended in a way its client can tell from success (gRPC:
``UNAVAILABLE`` with a message saying why; an OpenAI stream: an error event in OpenAI's
shape and no ``[DONE]``, then a clean close; a unary OpenAI call: 503), and every process
exits by itself within seconds, no shard aborting. (A drain whose calls all finish inside
the grace period: test_operations_e2e.py and test_openai_operations_e2e.py.)
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from tests.e2e.probes import wait_until
from tests.e2e.server import LauncherProcess, descendants, is_alive, start_launcher
from tests.e2e.streams import (
    CallThread,
    EventStream,
    GrpcStream,
    UnaryCompletion,
    start_event_stream,
    start_stream,
)

pytestmark = pytest.mark.slow

TOKENS = 1000  # each call outlasts the grace period several times over
SHUTTING_DOWN = "Server is shutting down: the request was ended after "


@dataclass
class InFlight:
    """Calls of both APIs running on one server."""

    grpc_streams: list[GrpcStream]
    event_streams: list[EventStream]
    unary: UnaryCompletion

    def join(self, timeout: float) -> None:
        calls: list[CallThread] = [*self.grpc_streams, *self.event_streams, self.unary]
        deadline = time.monotonic() + timeout
        for call in calls:
            call.join(max(deadline - time.monotonic(), 0.0))
        assert not any(call.is_alive() for call in calls), "a call did not end"


def start_calls(launcher: LauncherProcess, channel: grpc.Channel) -> InFlight:
    """Two gRPC streams, two OpenAI streams and one unary OpenAI call, all running."""
    grpc_streams = [start_stream(channel, TOKENS) for _ in range(2)]
    event_streams = [start_event_stream(launcher, TOKENS) for _ in range(2)]
    unary = UnaryCompletion(launcher, TOKENS)
    unary.start()
    for stream in grpc_streams:
        assert stream.started.wait(60) and stream.error is None, stream.error
    for event_stream in event_streams:
        assert event_stream.started.wait(60) and event_stream.error is None, event_stream.error
    return InFlight(grpc_streams, event_streams, unary)


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


@contextmanager
def calls_in_flight(
    tmp_path: Path, args: Sequence[str] = ()
) -> Iterator[tuple[LauncherProcess, InFlight]]:
    """A launched server with calls of both APIs running on it (``start_calls``); the
    server is stopped when the block ends, whatever is left of it."""
    launcher = start_launcher(tmp_path, list(args))
    try:
        launcher.wait_healthy()
        with grpc.insecure_channel(launcher.grpc_target) as channel:
            yield launcher, start_calls(launcher, channel)
    finally:
        launcher.stop()


def test_the_grace_period_ends_every_call_on_both_apis(tmp_path: Path) -> None:
    with calls_in_flight(tmp_path, ["--shutdown-grace-period", "1"]) as (launcher, calls):
        children = descendants(launcher.proc.pid)
        signalled = time.monotonic()
        launcher.proc.send_signal(signal.SIGTERM)
        calls.join(60)
        ended_in = time.monotonic() - signalled
        assert_ended_because(calls, "the 1 s grace period")
        assert launcher.proc.wait(30) == 0, launcher.log_tail()
        stopped_in = time.monotonic() - signalled
        assert ended_in >= 1.0, ended_in
        print(f"calls ended after {ended_in:.2f} s, the launcher exited after {stopped_in:.2f} s")
        assert stopped_in < 1 + 10, launcher.log_tail()
        assert_stopped_cleanly(launcher, children)


def test_a_second_sigterm_ends_the_drain_at_once(tmp_path: Path) -> None:
    with calls_in_flight(tmp_path, ["--shutdown-grace-period", "300"]) as (launcher, calls):
        children = descendants(launcher.proc.pid)
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


def test_the_router_and_shard_stop_by_themselves_when_the_launcher_is_killed(
    tmp_path: Path,
) -> None:
    with calls_in_flight(tmp_path) as (launcher, calls):
        roles = launcher.process_pids()
        children = set(roles["router"] + roles["shard"])
        assert roles["router"] and roles["shard"]
        killed = time.monotonic()
        os.kill(launcher.proc.pid, signal.SIGKILL)
        calls.join(60)
        assert_ended_because(calls, "the launcher is gone")
        wait_until(lambda: not [p for p in children if is_alive(p)], timeout=15)
        print(f"router and shard gone {time.monotonic() - killed:.2f} s after the launcher")
        # The sockets are freed: a new server can take the same ports at once.
        assert not list(launcher.socket_dir.glob("shard-*")), "sockets left behind"
