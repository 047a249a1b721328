"""The supervisor with real child processes standing in for shards and the router."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tgis.launcher.children import SIGBUS_MESSAGE, ChildSpec, Outcome, describe_status
from tgis.launcher.output import OutputForwarder
from tgis.launcher.supervisor import Supervisor

from .helpers import alive, fake, gone, read_pid, wait_for

LOG = logging.getLogger("test-supervisor")


def supervisor(**kwargs: float) -> Supervisor:
    kwargs.setdefault("router_stop_timeout", 5.0)
    kwargs.setdefault("shard_stop_timeout", 5.0)
    return Supervisor(LOG, OutputForwarder(), poll_interval=0.02, **kwargs)


def probe(directory: Path) -> Callable[[int], bool]:
    """Shard r is ready once it created shard<r>.ready."""
    return lambda rank: (directory / f"shard{rank}.ready").exists()


def stop_when_exists(sup: Supervisor, path: Path) -> None:
    """From another thread: request a stop once `path` exists."""

    def stop() -> None:
        wait_for(path)
        sup.request_stop()

    threading.Thread(target=stop, daemon=True).start()


def pids(directory: Path, *names: str) -> list[int]:
    return [read_pid(directory / f"{name}.pid") for name in names]


def test_describe_status() -> None:
    assert describe_status(0) == "exit status: 0"
    assert describe_status(3) == "exit status: 3"
    assert describe_status(-9) == "signal: 9 (SIGKILL)"
    assert describe_status(-15) == "signal: 15 (SIGTERM)"


def test_shard_death_stops_the_others(tmp_path: Path) -> None:
    sup = supervisor()
    outcome = sup.run(
        [fake(tmp_path, "shard0", "ready"), fake(tmp_path, "shard1", "ready", "exit=0.5:3")],
        fake(tmp_path, "router", "grandchild"),
        probe(tmp_path),
        startup_timeout=10,
        handle_signals=False,
    )
    assert outcome == Outcome(1, "Shard 1 failed: exit status: 3")
    shard0, router = pids(tmp_path, "shard0", "router")
    grandchild = read_pid(tmp_path / "router.grandchild")
    assert (tmp_path / "router.term").exists() and (tmp_path / "shard0.term").exists()
    assert gone(shard0, router, grandchild)


def test_router_exit_is_a_failure(tmp_path: Path) -> None:
    outcome = supervisor().run(
        [fake(tmp_path, "shard0", "ready")],
        fake(tmp_path, "router", "exit=0.3:0"),
        probe(tmp_path),
        startup_timeout=10,
        handle_signals=False,
    )
    assert outcome == Outcome(1, "Router exited unexpectedly: exit status: 0")
    assert (tmp_path / "shard0.term").exists()
    assert not alive(read_pid(tmp_path / "shard0.pid"))


def test_shard_killed_by_a_signal(tmp_path: Path) -> None:
    outcome = supervisor().run(
        [fake(tmp_path, "shard0", "ready", "signal=0.3:9")],
        fake(tmp_path, "router"),
        probe(tmp_path),
        startup_timeout=10,
        handle_signals=False,
    )
    assert outcome == Outcome(1, "Shard 0 failed: signal: 9 (SIGKILL)")


def test_sigbus_with_several_shards(tmp_path: Path) -> None:
    outcome = supervisor().run(
        [fake(tmp_path, "shard0", "ready", f"signal=0.3:{int(signal.SIGBUS)}"),
         fake(tmp_path, "shard1", "ready")],
        fake(tmp_path, "router"),
        probe(tmp_path),
        startup_timeout=10,
        handle_signals=False,
    )  # fmt: skip
    assert outcome == Outcome(1, SIGBUS_MESSAGE)


def two_shards(tmp_path: Path, sup: Supervisor, shard0: str, shard1: str) -> Outcome:
    """Run two ready fake shards with one more behaviour each (``""``: none) and a router."""
    shards = [
        fake(tmp_path, f"shard{rank}", "ready", *([extra] if extra else []))
        for rank, extra in enumerate((shard0, shard1))
    ]
    return sup.run(
        shards, fake(tmp_path, "router"), probe(tmp_path), startup_timeout=10, handle_signals=False
    )


def test_the_killed_shard_is_named_not_the_peer_that_aborted_first(tmp_path: Path) -> None:
    # Shard 0 aborts (as gloo does when a peer vanishes) before shard 1's kill is seen.
    abort = f"signal=0.3:{int(signal.SIGABRT)}"
    outcome = two_shards(tmp_path, supervisor(peer_settle=2.0), abort, "signal=0.6:9")
    assert outcome == Outcome(1, "Shard 1 failed: signal: 9 (SIGKILL)")


def test_a_shard_aborting_alone_is_named_after_the_settle_time(tmp_path: Path) -> None:
    abort = f"signal=0.3:{int(signal.SIGABRT)}"
    outcome = two_shards(tmp_path, supervisor(peer_settle=0.5), "", abort)
    assert outcome == Outcome(1, "Shard 1 failed: signal: 6 (SIGABRT)")
    assert (tmp_path / "shard0.term").exists()


def test_shard_failing_during_startup(tmp_path: Path) -> None:
    outcome = supervisor().run(
        [fake(tmp_path, "shard0", "exit=0:2"), fake(tmp_path, "shard1", "grandchild")],
        fake(tmp_path, "router"),
        probe(tmp_path),
        startup_timeout=10,
        handle_signals=False,
    )
    assert outcome == Outcome(1, "Shard 0 failed: exit status: 2")
    assert not (tmp_path / "router.json").exists()  # the router was never started
    shard1 = read_pid(tmp_path / "shard1.pid")
    assert gone(shard1, read_pid(tmp_path / "shard1.grandchild"))


def test_startup_timeout(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    sup = supervisor(waiting_log_interval=0.2)
    start = time.monotonic()
    with caplog.at_level(logging.INFO, logger=LOG.name):
        outcome = sup.run(
            [fake(tmp_path, "shard0", "ready"), fake(tmp_path, "shard1")],
            fake(tmp_path, "router"),
            probe(tmp_path),
            startup_timeout=0.8,
            handle_signals=False,
        )
    assert outcome.exit_code == 1
    assert outcome.reason == (
        "Shard 1 was not ready after 0.8 s (--shard-startup-timeout / SHARD_STARTUP_TIMEOUT)"
    )
    assert time.monotonic() - start < 5
    assert "Waiting for shard 1 to be ready..." in caplog.messages
    assert "Waiting for shard 0 to be ready..." not in caplog.messages
    assert not (tmp_path / "router.json").exists()
    assert not any(alive(pid) for pid in pids(tmp_path, "shard0", "shard1"))


def test_stop_request_stops_router_then_shards(tmp_path: Path) -> None:
    sup = supervisor()

    stop_when_exists(sup, tmp_path / "router.pid")
    outcome = sup.run(
        [fake(tmp_path, "shard0", "ready"), fake(tmp_path, "shard1", "ready")],
        fake(tmp_path, "router"),
        probe(tmp_path),
        startup_timeout=10,
        handle_signals=False,
    )
    assert outcome == Outcome(0)
    router_stopped = float((tmp_path / "router.term").read_text())
    for rank in (0, 1):
        assert float((tmp_path / f"shard{rank}.term").read_text()) > router_stopped
    assert not any(alive(pid) for pid in pids(tmp_path, "shard0", "shard1", "router"))


def test_child_ignoring_sigterm_is_killed(tmp_path: Path) -> None:
    sup = supervisor(router_stop_timeout=0.5, shard_stop_timeout=0.5)
    stop_when_exists(sup, tmp_path / "router.pid")
    start = time.monotonic()
    outcome = sup.run(
        [fake(tmp_path, "shard0", "ready", "ignore-term")],
        fake(tmp_path, "router", "ignore-term"),
        probe(tmp_path),
        startup_timeout=10,
        handle_signals=False,
    )
    # A stop that had to kill is not a clean one: exit 1, and the reason says what.
    assert outcome == Outcome(
        1,
        "router did not stop within 0.5 s: killed; shard0 did not stop within 0.5 s: killed",
    )
    assert time.monotonic() - start < 5
    assert sup.router is not None and sup.router.poll() == -signal.SIGKILL
    assert sup.shards[0].poll() == -signal.SIGKILL


def test_a_shard_that_fails_while_stopping_makes_the_stop_unclean(tmp_path: Path) -> None:
    sup = supervisor()
    stop_when_exists(sup, tmp_path / "router.pid")
    outcome = sup.run(
        [fake(tmp_path, "shard0", "ready", "term-signal=6", spec_name="Shard 0")],
        fake(tmp_path, "router", spec_name="Router"),
        probe(tmp_path),
        startup_timeout=10,
        handle_signals=False,
    )
    assert outcome == Outcome(1, "Shard 0 stopped with signal: 6 (SIGABRT)")


def test_children_are_told_the_launchers_pid(tmp_path: Path) -> None:
    sup = supervisor()
    stop_when_exists(sup, tmp_path / "router.pid")
    sup.run(
        [fake(tmp_path, "shard0", "ready")],
        fake(tmp_path, "router"),
        probe(tmp_path),
        startup_timeout=10,
        handle_signals=False,
    )
    for name in ("shard0", "router"):
        env = json.loads((tmp_path / f"{name}.json").read_text())["env"]
        assert env["TGIS_LAUNCHER_PID"] == str(os.getpid())


def test_stop_during_startup_exits_zero(tmp_path: Path) -> None:
    sup = supervisor()
    stop_when_exists(sup, tmp_path / "shard0.pid")
    outcome = sup.run(
        [fake(tmp_path, "shard0")],  # never ready
        fake(tmp_path, "router"),
        probe(tmp_path),
        startup_timeout=10,
        handle_signals=False,
    )
    assert outcome == Outcome(0)
    assert not (tmp_path / "router.json").exists()
    assert not alive(read_pid(tmp_path / "shard0.pid"))


def test_missing_program_is_a_failure(tmp_path: Path) -> None:
    outcome = supervisor().run(
        [fake(tmp_path, "shard0", "ready")],
        ChildSpec("Router", ["/nonexistent/router"]),
        probe(tmp_path),
        startup_timeout=10,
        handle_signals=False,
    )
    assert outcome.exit_code == 1
    assert outcome.reason is not None
    assert outcome.reason.startswith("Could not start Router: ")
    assert not alive(read_pid(tmp_path / "shard0.pid"))


def test_output_is_forwarded_with_a_prefix_without_blocking(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sup = supervisor()
    stop_when_exists(sup, tmp_path / "router.pid")
    outcome = sup.run(
        [fake(tmp_path, "shard0", "spam", "ready", spec_name="Shard 0")],
        fake(tmp_path, "router", spec_name="Router"),
        probe(tmp_path),
        startup_timeout=20,
        handle_signals=False,
    )
    assert outcome == Outcome(0)
    out, err = capsys.readouterr()
    assert "Shard 0: fake shard0 started\n" in out
    assert "Shard 0: stdout line 19999\n" in out
    assert "Shard 0: stderr line 19999\n" in err
    assert "Router: fake router says hello on stderr\n" in err


def test_json_output_lines() -> None:
    forwarder = OutputForwarder(json_output=True)
    wrapped = json.loads(forwarder.format_line("Shard 0", "plain text"))
    assert wrapped["source"] == "Shard 0" and wrapped["message"] == "plain text"
    passed = json.loads(forwarder.format_line("Router", '{"level": "WARN", "message": "m"}'))
    assert passed == {"level": "WARN", "message": "m", "source": "Router"}
    assert OutputForwarder().format_line("Router", "x") == "Router: x"


SUPERVISOR_SCRIPT = """
import logging, sys
from pathlib import Path
sys.path.insert(0, sys.argv[2])
from tests.launcher.helpers import fake
from tgis.launcher.supervisor import Supervisor
logging.basicConfig(level=logging.INFO)
d = Path(sys.argv[1])
sup = Supervisor(logging.getLogger("sup"), None, poll_interval=0.02)
outcome = sup.run(
    [fake(d, "shard0", "ready", "grandchild"), fake(d, "shard1", "ready")],
    fake(d, "router", "grandchild"),
    lambda rank: (d / f"shard{rank}.ready").exists(),
    startup_timeout=10,
)
sys.exit(outcome.exit_code)
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_signal_to_supervisor_process_leaves_no_child(tmp_path: Path, sig: signal.Signals) -> None:
    repo = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen(
        [sys.executable, "-c", SUPERVISOR_SCRIPT, str(tmp_path), str(repo)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        try:
            children = pids(tmp_path, "shard0", "shard1", "router")
        except AssertionError:
            proc.kill()
            raise AssertionError(proc.communicate()[1]) from None
        grandchildren = [read_pid(tmp_path / f"{n}.grandchild") for n in ("shard0", "router")]
        assert all(alive(pid) for pid in children + grandchildren)
        # children run in their own process groups, apart from the supervisor's
        assert all(os.getpgid(pid) == pid for pid in children)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=15)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert f"Received {sig.name}, shutting down" in err
    assert not any(alive(pid) for pid in children + grandchildren)


def run_supervisor_script(tmp_path: Path, router_behaviour: str) -> subprocess.Popen[str]:
    """SUPERVISOR_SCRIPT in a process of its own, with ``router_behaviour`` for the router."""
    router = 'fake(d, "router", "grandchild")'
    script = SUPERVISOR_SCRIPT.replace(
        router, router.replace('"grandchild"', repr(router_behaviour))
    )
    repo = Path(__file__).resolve().parents[2]
    return subprocess.Popen(
        [sys.executable, "-c", script, str(tmp_path), str(repo)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_a_second_signal_reaches_the_draining_router(tmp_path: Path) -> None:
    """The router drains on the first SIGTERM (this one waits for a second); a second
    SIGTERM to the launcher is passed on to it, long before the stop timeout (30 s)."""
    proc = run_supervisor_script(tmp_path, "terms=2")
    try:
        pids(tmp_path, "shard0", "shard1", "router")
        proc.send_signal(signal.SIGTERM)
        wait_for(tmp_path / "router.term1")
        assert not (tmp_path / "router.term").exists()
        again = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=15)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert float((tmp_path / "router.term").read_text()) - again < 2
    assert "Signal received again: passing it on" in err
