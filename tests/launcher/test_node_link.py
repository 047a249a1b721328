"""The link between the launchers of a group over several nodes (``node_link.py``), on
loopback: each side learns how the other ended, or that it vanished; and the supervisor of
each side ends with the other node (fake children stand in for the shards)."""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tgis.launcher.children import Outcome
from tgis.launcher.node_link import GroupEnd, LeaderLink, NodeLink, WorkerLink
from tgis.launcher.output import OutputForwarder
from tgis.launcher.supervisor import NodeGroup, Supervisor

from .helpers import fake, gone, read_pid

LOG = logging.getLogger("test-node-link")


def until(check: Callable[[], GroupEnd | None], timeout: float = 10.0) -> GroupEnd:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        end = check()
        if end is not None:
            return end
        time.sleep(0.01)
    raise AssertionError("no end within the timeout")


def linked(leader: LeaderLink, node_rank: int = 1) -> WorkerLink:
    worker = WorkerLink("127.0.0.1", leader.port, node_rank, 10.0, LOG)
    deadline = time.monotonic() + 10
    while node_rank not in leader._workers and time.monotonic() < deadline:
        time.sleep(0.01)
    assert node_rank in leader._workers
    return worker


@pytest.fixture
def leader() -> Iterator[LeaderLink]:
    link = LeaderLink(0, 3, LOG)
    yield link
    link.finish(1, "test over")


def test_a_worker_ending_ends_the_leader_naming_the_node(leader: LeaderLink) -> None:
    worker = linked(leader, 2)
    assert leader.group_end() is None and worker.group_end() is None
    worker.finish(1, "Shard 5 failed: signal: 9 (SIGKILL)")
    assert until(leader.group_end) == GroupEnd(1, "node 2: Shard 5 failed: signal: 9 (SIGKILL)")


def test_a_worker_stopping_cleanly_still_ends_the_leader(leader: LeaderLink) -> None:
    linked(leader).finish(0, None)
    assert until(leader.group_end) == GroupEnd(1, "node 1: its launcher stopped")


def test_a_worker_asked_to_stop_asks_the_leader_to_drain_once(leader: LeaderLink) -> None:
    worker = linked(leader)
    worker.request_stop()
    assert until(leader.group_end) == GroupEnd(0, None, drain=True)
    assert leader.group_end() is None  # a request, not an end: handed over once
    worker.finish(0, None)
    assert until(leader.group_end) == GroupEnd(1, "node 1: its launcher stopped")


def test_the_leader_ending_ends_each_worker_with_its_exit_code(leader: LeaderLink) -> None:
    workers = [linked(leader, 1), linked(leader, 2)]
    leader.finish(0, None)
    assert [until(w.group_end) for w in workers] == [GroupEnd(0, None)] * 2


def test_the_leader_failing_fails_the_workers_with_its_reason(leader: LeaderLink) -> None:
    worker = linked(leader)
    leader.finish(1, "Shard 0 failed: exit status: 1")
    assert until(worker.group_end) == GroupEnd(1, "node 0: Shard 0 failed: exit status: 1")


def test_a_link_closed_without_a_word_is_lost_contact(leader: LeaderLink) -> None:
    """A launcher killed (SIGKILL) closes its link with no end line."""
    with socket.create_connection(("127.0.0.1", leader.port)) as sock:
        sock.sendall(b'{"node": 1}\n')
        time.sleep(0.1)
    assert until(leader.group_end) == GroupEnd(1, "lost contact with node 1's launcher (127.0.0.1)")
    other_leader = LeaderLink(0, 2, LOG)
    worker = linked(other_leader)
    other_leader._workers[1].shutdown(socket.SHUT_RDWR)  # as if node 0's launcher vanished
    end = until(worker.group_end)
    assert end == GroupEnd(1, "lost contact with node 0's launcher (127.0.0.1)")


def test_a_stranger_is_ignored(leader: LeaderLink) -> None:
    for hello in (b"GET / HTTP/1.1\n", b'{"node": 0}\n', b'{"node": 3}\n'):
        with socket.create_connection(("127.0.0.1", leader.port)) as sock:
            sock.sendall(hello)
    time.sleep(0.2)
    assert leader.group_end() is None


def test_a_worker_that_cannot_reach_node_0_fails_after_its_timeout() -> None:
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
        worker = WorkerLink("127.0.0.1", port, 1, 0.3, LOG)
        end = until(worker.group_end)
    assert end.exit_code == 1
    assert end.reason is not None
    assert end.reason.startswith(f"could not reach node 0's launcher at 127.0.0.1:{port} within")


class FakeLink:
    """A link whose other node ends when the test says; records this node's end."""

    def __init__(self) -> None:
        self.end: GroupEnd | None = None
        self.finished: tuple[int, str | None] | None = None
        self.stop_requests = 0

    def group_end(self) -> GroupEnd | None:
        return self.end

    def finish(self, exit_code: int, reason: str | None) -> None:
        self.finished = (exit_code, reason)

    def request_stop(self) -> None:
        self.stop_requests += 1


def run_node(
    tmp_path: Path,
    link: NodeLink,
    shards: list[tuple[str, ...]],
    *,
    first_rank: int,
    router: bool,
    sup: Supervisor | None = None,
) -> Outcome:
    sup = sup or node_supervisor()
    return sup.run(
        [fake(tmp_path, f"shard{first_rank + i}", "ready", *b) for i, b in enumerate(shards)],
        fake(tmp_path, "router") if router else None,
        lambda rank: (tmp_path / f"shard{rank}.ready").exists(),
        startup_timeout=10,
        handle_signals=False,
        group=NodeGroup(first_rank, link, settle=0.3),
    )


def node_supervisor() -> Supervisor:
    return Supervisor(
        LOG, OutputForwarder(), poll_interval=0.02, router_stop_timeout=5, shard_stop_timeout=5
    )


def later(seconds: float, action: Callable[[], None]) -> None:
    threading.Timer(seconds, action).start()


def test_a_worker_node_ends_cleanly_with_node_0(tmp_path: Path) -> None:
    link = FakeLink()

    def node_0_stops() -> None:
        link.end = GroupEnd(0, None)

    later(0.5, node_0_stops)
    outcome = run_node(tmp_path, link, [(), ()], first_rank=2, router=False)
    assert outcome == Outcome(0)
    assert link.finished == (0, None)
    assert gone(*(read_pid(tmp_path / f"shard{r}.pid") for r in (2, 3)))
    assert not (tmp_path / "router.pid").exists()


def test_a_worker_shard_exiting_0_is_rank_0_ending_the_group(tmp_path: Path) -> None:
    """Rank 0's Stop reached this node's shard before node 0's word."""
    link = FakeLink()
    outcome = run_node(tmp_path, link, [("exit=0.3:0",)], first_rank=1, router=False)
    assert outcome == Outcome(0)


def test_a_local_shard_failure_is_named_by_its_global_rank_and_told(tmp_path: Path) -> None:
    link = FakeLink()
    outcome = run_node(tmp_path, link, [(), ("exit=0.3:3",)], first_rank=2, router=False)
    assert outcome == Outcome(1, "Shard 3 failed: exit status: 3")
    assert link.finished == (1, "Shard 3 failed: exit status: 3")


def test_another_nodes_report_names_the_cause_of_a_local_shards_end(tmp_path: Path) -> None:
    """Node 0's rank 0 lost its peer on node 1 and exited 1 itself: node 1's word, which
    comes within the settle time, is the reason."""
    link = FakeLink()

    def node_1_reports() -> None:
        link.end = GroupEnd(1, "node 1: Shard 1 failed: signal: 9 (SIGKILL)")

    later(0.5, node_1_reports)
    outcome = run_node(tmp_path, link, [("exit=0.4:1",)], first_rank=0, router=True)
    assert outcome == Outcome(1, "node 1: Shard 1 failed: signal: 9 (SIGKILL)")
    assert (tmp_path / "router.term").exists()


def test_a_worker_asked_to_stop_keeps_its_ranks_until_node_0_ends_the_group(
    tmp_path: Path,
) -> None:
    """SIGTERM on a worker node (its pod deleted): node 0 must drain first, with every rank
    still running; so the worker asks node 0 to stop and waits for the group's end."""
    link = FakeLink()
    sup = node_supervisor()
    later(0.5, sup.request_stop)

    seen: list[tuple[int, bool]] = []

    def node_0_ends() -> None:
        seen.append((link.stop_requests, (tmp_path / "shard1.term").exists()))
        link.end = GroupEnd(0, None)

    later(1.5, node_0_ends)
    outcome = run_node(tmp_path, link, [()], first_rank=1, router=False, sup=sup)
    assert seen == [(1, False)]  # asked once, its shard not told to stop
    assert outcome == Outcome(0)
    assert (tmp_path / "shard1.term").exists()  # then stopped
    assert link.stop_requests == 1 and link.finished == (0, None)


def test_node_0_drains_when_a_worker_asks(tmp_path: Path) -> None:
    link = FakeLink()

    def a_worker_asks() -> None:
        link.end = GroupEnd(0, None, drain=True)

    later(0.5, a_worker_asks)
    outcome = run_node(tmp_path, link, [()], first_rank=0, router=True)
    assert outcome == Outcome(0)
    assert (tmp_path / "router.term").exists()  # stopped like on SIGTERM: router first
    assert link.finished == (0, None)
