"""Faults under the real launcher (issue 11, item 3) and a shard that fails (item 8).

For each fault: how long until both health endpoints stop saying "serving" (HTTP /health
not 200, gRPC health not SERVING, or the connection refused), what the stream in flight
gets, the launcher's exit code and termination log, and that no process or socket is left.

- a shard killed (SIGKILL), with one rank and with each of two ranks;
- the router killed;
- a shard that hangs (SIGSTOP): the router's step timeout (``TGIS_STEP_TIMEOUT``) finds it;
- a shard whose every step fails (``benchmarks/fake_shard.py --fail-steps``, behind the real
  router): NOT_SERVING before the first token, /health 503, and both recover when it does.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest

from tests.e2e.probes import (
    NOT_SERVING,
    SERVING,
    greedy,
    health_status,
    wait_until,
)
from tests.e2e.server import BIN_DIR, LauncherProcess, descendants, free_port, free_ports, is_alive
from tests.e2e.server import start_launcher as _start_launcher
from tests.e2e.streams import long_stream
from tgis.embedded_model import MODEL_DIR
from tgis.pb import generation_pb2 as pb
from tgis.pb import generation_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow

DETECTION_S = 2.0
"""The promise: both health endpoints report the fault within this many seconds."""
STEP_TIMEOUT_S = 3.0
FAKE_SHARD = Path(__file__).resolve().parents[2] / "benchmarks" / "fake_shard.py"


def start_launcher(tmp_path: Path, args: list[str], env: dict[str, str]) -> LauncherProcess:
    return _start_launcher(
        tmp_path,
        ["--max-sequence-length", "1024", "--shutdown-grace-period", "10", *args],
        {"TGIS_TERMINATION_LOG": str(tmp_path / "termination-log"), **env},
    )


def http_serving(launcher: LauncherProcess) -> bool:
    try:
        return launcher.http_get("/health", timeout=1.0)[0] == 200
    except OSError:  # refused or reset: the router is gone
        return False


def grpc_serving(target: str) -> bool:
    with grpc.insecure_channel(target) as channel:
        try:
            return health_status(channel, timeout=1.0) == SERVING
        except grpc.RpcError:
            return False


def seconds_until_not_serving(
    launcher: LauncherProcess, since: float, limit: float = 30.0
) -> tuple[float, float]:
    """Seconds from ``since`` until /health stopped answering 200, and until gRPC health
    stopped answering SERVING (each probed every 20 ms)."""
    http_at: float | None = None
    grpc_at: float | None = None
    while http_at is None or grpc_at is None:
        assert time.monotonic() - since < limit, "still serving after the fault"
        if http_at is None and not http_serving(launcher):
            http_at = time.monotonic() - since
        if grpc_at is None and not grpc_serving(launcher.grpc_target):
            grpc_at = time.monotonic() - since
        time.sleep(0.02)
    return http_at, grpc_at


def child_pid(launcher: LauncherProcess, role: str, rank: int = 0) -> int:
    """The pid of the launcher's own child: the router, or the shard of ``rank``."""
    for pid in launcher.process_pids()[role]:
        status = Path(f"/proc/{pid}/status").read_text()
        parent = next(line.split()[1] for line in status.splitlines() if line.startswith("PPid"))
        if int(parent) != launcher.proc.pid:
            continue
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        if role == "router" or f"RANK={rank}".encode() in environ:
            return pid
    raise AssertionError(f"no {role} {rank} among {launcher.process_pids()}")


def signal_child(launcher: LauncherProcess, role: str, rank: int, sig: signal.Signals) -> None:
    os.kill(child_pid(launcher, role, rank), sig)


def assert_everything_stopped(launcher: LauncherProcess, children: set[int]) -> list[str]:
    """The launcher exits 1, leaving no process and no socket; its termination log lines."""
    assert launcher.proc.wait(60) == 1, launcher.log_tail()
    wait_until(lambda: not [p for p in children if is_alive(p)], timeout=10)
    assert not list(launcher.socket_dir.glob("shard*")), "sockets left behind"
    return (launcher.log_path.parent / "termination-log").read_text().splitlines()


@contextmanager
def serving(
    tmp_path: Path, args: list[str] | None = None, env: dict[str, str] | None = None
) -> Iterator[tuple[LauncherProcess, set[int]]]:
    """A launched server that has generated (gRPC health SERVING) and its processes."""
    launcher = start_launcher(tmp_path, args or [], env or {})
    try:
        launcher.wait_healthy()
        wait_until(lambda: grpc_serving(launcher.grpc_target), timeout=30)
        yield launcher, descendants(launcher.proc.pid)
    finally:
        launcher.stop()


def assert_failed_during_generation(error: BaseException | None) -> None:
    """A stream cut by a fault ends with the generation failure status, or UNAVAILABLE
    when the router went first."""
    assert isinstance(error, grpc.RpcError), error
    code, details = error.code(), error.details() or ""
    assert code in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.UNAVAILABLE), (code, details)
    if code == grpc.StatusCode.UNKNOWN:
        assert details.startswith("Request failed during generation: "), details


@pytest.mark.parametrize(("num_shard", "rank"), [(1, 0), (2, 0), (2, 1)])
def test_a_killed_shard_stops_the_server_and_says_why(
    tmp_path: Path, num_shard: int, rank: int
) -> None:
    with serving(tmp_path, ["--num-shard", str(num_shard)]) as (launcher, children):
        with (
            grpc.insecure_channel(launcher.grpc_target) as channel,
            long_stream(channel, 900) as stream,
        ):
            killed_at = time.monotonic()
            signal_child(launcher, "shard", rank, signal.SIGKILL)
            http_s, grpc_s = seconds_until_not_serving(launcher, killed_at)
        assert_failed_during_generation(stream.error)
        lines = assert_everything_stopped(launcher, children)
    print(f"shard {rank}/{num_shard} killed: /health {http_s:.2f} s, gRPC {grpc_s:.2f} s")
    assert http_s <= DETECTION_S and grpc_s <= DETECTION_S, (http_s, grpc_s)
    assert lines[-1] == f"Shard {rank} failed: signal: 9 (SIGKILL)", lines


def test_a_killed_router_stops_the_server_and_says_why(tmp_path: Path) -> None:
    with serving(tmp_path) as (launcher, children):
        with (
            grpc.insecure_channel(launcher.grpc_target) as channel,
            long_stream(channel, 900) as stream,
        ):
            killed_at = time.monotonic()
            signal_child(launcher, "router", 0, signal.SIGKILL)
            http_s, grpc_s = seconds_until_not_serving(launcher, killed_at)
        assert isinstance(stream.error, grpc.RpcError)
        assert stream.error.code() == grpc.StatusCode.UNAVAILABLE, stream.error
        lines = assert_everything_stopped(launcher, children)
    print(f"router killed: /health {http_s:.2f} s, gRPC {grpc_s:.2f} s")
    assert http_s <= DETECTION_S and grpc_s <= DETECTION_S, (http_s, grpc_s)
    assert lines[-1] == "Router exited unexpectedly: signal: 9 (SIGKILL)", lines


def test_a_hung_shard_is_found_by_the_step_timeout(tmp_path: Path) -> None:
    env = {"TGIS_STEP_TIMEOUT": str(STEP_TIMEOUT_S)}
    with serving(tmp_path, env=env) as (launcher, children):
        with (
            grpc.insecure_channel(launcher.grpc_target) as channel,
            long_stream(channel, 900) as stream,
        ):
            stopped_at = time.monotonic()
            signal_child(launcher, "shard", 0, signal.SIGSTOP)
            http_s, grpc_s = seconds_until_not_serving(launcher, stopped_at)
            stream.done.wait(30)
            failed_after = time.monotonic() - stopped_at
        assert_failed_during_generation(stream.error)
        assert isinstance(stream.error, grpc.RpcError)
        assert "did not answer step" in (stream.error.details() or ""), stream.error
        lines = assert_everything_stopped(launcher, children)
    print(
        f"shard stopped: /health {http_s:.2f} s, gRPC {grpc_s:.2f} s, stream {failed_after:.2f} s"
    )
    # /health asks the shard itself (a Health call that times out); gRPC health follows
    # the step timeout.
    assert grpc_s <= STEP_TIMEOUT_S + DETECTION_S, grpc_s
    assert http_s <= STEP_TIMEOUT_S + DETECTION_S, http_s
    assert failed_after <= STEP_TIMEOUT_S + DETECTION_S, failed_after
    hung, launcher_reason = lines[-2:]
    assert hung.startswith("the shard did not answer step "), lines
    assert hung.endswith(f"within {STEP_TIMEOUT_S:g} s (TGIS_STEP_TIMEOUT): it is hung"), hung
    assert launcher_reason == "Router exited unexpectedly: exit status: 1", lines


# ---- a shard that fails every step, behind the real router ------------------------------------


@contextmanager
def router_on_failing_shard(
    tmp_path: Path,
) -> Iterator[tuple[subprocess.Popen[bytes], subprocess.Popen[bytes], str, str]]:
    """The fake shard with ``--fail-steps`` and the real router in front of it; yields the
    two processes, the gRPC target and the /health URL."""
    uds = f"/tmp/tgis-fail-{free_port()}"
    grpc_port, http_port = free_ports(2)
    ready = tmp_path / "fake-shard-ready"
    with open(tmp_path / "fake-shard.log", "wb") as shard_log:
        shard = subprocess.Popen(
            [sys.executable, str(FAKE_SHARD), "--uds", uds, "--fail-steps", "--ready-file", ready],
            stdout=shard_log,
            stderr=subprocess.STDOUT,
        )
    router: subprocess.Popen[bytes] | None = None
    try:
        wait_until(ready.exists, timeout=30)
        with open(tmp_path / "router.log", "wb") as router_log:
            router = subprocess.Popen(
                [
                    str(BIN_DIR / "text-generation-router"),
                    "--master-shard-uds-path",
                    uds,
                    "--tokenizer-path",
                    str(MODEL_DIR / "tokenizer.json"),
                    "--grpc-port",
                    str(grpc_port),
                    "--port",
                    str(http_port),
                ],
                stdout=router_log,
                stderr=subprocess.STDOUT,
            )
        yield shard, router, f"127.0.0.1:{grpc_port}", f"http://127.0.0.1:{http_port}/health"
    finally:
        for proc in (router, shard):
            if proc is not None:
                proc.terminate()
                proc.wait(30)


def http_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            return int(response.status)
    except urllib.error.HTTPError as err:
        return err.code


def test_health_reports_a_shard_whose_steps_fail(tmp_path: Path) -> None:
    with (
        router_on_failing_shard(tmp_path) as (shard, router, target, health_url),
        grpc.insecure_channel(target) as channel,
    ):
        wait_until(lambda: router.poll() is None and _answers(channel), timeout=60)
        # No token yet: gRPC health has never said SERVING, and /health's one-token
        # generation fails.
        assert health_status(channel) == NOT_SERVING
        assert http_status(health_url) == 503
        request = pb.BatchedGenerationRequest(
            requests=[pb.GenerationRequest(text="hello")], params=greedy(3)
        )
        stub = pb_grpc.GenerationServiceStub(channel)
        with pytest.raises(grpc.RpcError) as failed:
            stub.Generate(request, timeout=30)
        assert failed.value.code() == grpc.StatusCode.UNKNOWN
        assert failed.value.details() == (
            "Request failed during generation: injected fault: this fake shard fails every step"
        )
        # The shard recovers: /health generates again and says so; the first token
        # turns gRPC health to SERVING.
        toggle_fault(shard, tmp_path / "fake-shard.log", failing=False)
        assert http_status(health_url) == 200
        wait_until(lambda: health_status(channel) == SERVING)
        assert stub.Generate(request, timeout=30).responses[0].generated_token_count == 3
        # It fails again: the failed step makes /health check generation again.
        toggle_fault(shard, tmp_path / "fake-shard.log", failing=True)
        with pytest.raises(grpc.RpcError):
            stub.Generate(request, timeout=30)
        assert http_status(health_url) == 503


def toggle_fault(shard: subprocess.Popen[bytes], log: Path, failing: bool) -> None:
    """SIGUSR1 to the fake shard, then wait until it says it switched: its event loop
    handles the signal when it next runs, which on a busy machine can be after the next
    request arrives."""
    line = f"fake shard: fail_steps={failing}"
    before = log.read_text().count(line)
    shard.send_signal(signal.SIGUSR1)
    wait_until(lambda: log.read_text().count(line) > before, timeout=30)


def _answers(channel: grpc.Channel) -> bool:
    try:
        health_status(channel, timeout=1.0)
        return True
    except grpc.RpcError:
        return False
