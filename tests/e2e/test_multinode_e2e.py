"""Two launchers on loopback, ``--num-shard 2 --nnodes 2`` with ``--node-rank 0`` and ``1``,
form one tensor-parallel group (gloo on CPU), as two LeaderWorkerSet pods would: node 0
runs rank 0 and the router, node 1 only rank 1. Greedy texts equal one shard's (the oracle:
a ``--num-shard 1`` launcher); SIGTERM to node 0 ends node 1's launcher too, both with exit
0; SIGTERM to node 1 (its pod deleted) stops the group with node 0's drain, a stream in
flight finishing on both nodes' ranks; a rank killed on node 1 ends both launchers with
exit 1, node 0 naming node 1's rank and how it ended; a SIGKILL of node 1's launcher ends
node 0 ("lost contact") and node 1's orphaned rank."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from tests.e2e.server import LauncherProcess, free_port, is_alive, start_launcher
from tests.e2e.streams import long_stream
from tgis.launcher.node_link import LINK_PORT_OFFSET
from tgis.pb import generation_pb2 as pb
from tgis.pb import generation_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow

PROMPTS = ["Return the number of", "The file is", "A"]
NEW_TOKENS = 10
END_WITHIN_S = 30.0


def master_port() -> int:
    """A port free on loopback whose next port (the launchers' link) is free too."""
    for _ in range(50):
        port = free_port()
        with contextlib.suppress(OSError), socket.socket() as probe:
            probe.bind(("127.0.0.1", port + LINK_PORT_OFFSET))
            return port
    raise RuntimeError("no two free ports in a row")


def start(log_dir: Path, model: Path, *flags: str) -> LauncherProcess:
    return start_launcher(
        log_dir, ["--model-name", str(model), "--max-sequence-length", "256", *flags]
    )


def generate(launcher: LauncherProcess) -> list[str]:
    stopping = pb.StoppingCriteria(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
    request = pb.BatchedGenerationRequest(
        requests=[pb.GenerationRequest(text=p) for p in PROMPTS],
        params=pb.Parameters(method=pb.GREEDY, stopping=stopping),
    )
    with grpc.insecure_channel(launcher.grpc_target) as channel:
        response = pb_grpc.GenerationServiceStub(channel).Generate(request, timeout=60)
    assert all(r.generated_token_count == NEW_TOKENS for r in response.responses)
    return [r.text for r in response.responses]


@pytest.fixture(scope="module")
def single_shard_texts(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    launcher = start(tmp_path_factory.mktemp("tp1"), tiny_llama_dir, "--num-shard", "1")
    try:
        launcher.wait_healthy()
        return generate(launcher)
    finally:
        assert launcher.stop() == 0, launcher.log_tail()


@pytest.fixture
def two_nodes(
    tiny_llama_dir: Path, tmp_path: Path
) -> Iterator[tuple[LauncherProcess, LauncherProcess]]:
    """Node 0's and node 1's launchers, node 0 serving (the worker started first: it waits
    for node 0's launcher and rank 0)."""
    port = str(master_port())
    group = ["--num-shard", "2", "--nnodes", "2", "--master-addr", "127.0.0.1"]
    worker = start(tmp_path, tiny_llama_dir, *group, "--master-port", port, "--node-rank", "1")
    leader = start(tmp_path, tiny_llama_dir, *group, "--master-port", port, "--node-rank", "0")
    try:
        leader.wait_healthy()
        yield leader, worker
    finally:
        leader.stop()
        worker.stop()


def wait_exit(launcher: LauncherProcess, timeout: float = END_WITHIN_S) -> int:
    return launcher.proc.wait(timeout)


def test_two_nodes_generate_one_shards_text_and_stop_together(
    two_nodes: tuple[LauncherProcess, LauncherProcess], single_shard_texts: list[str]
) -> None:
    leader, worker = two_nodes
    assert generate(leader) == single_shard_texts
    assert [len(pids) for pids in leader.process_pids().values()] == [1, 1]  # router, shard
    assert [len(pids) for pids in worker.process_pids().values()] == [0, 1]
    assert sorted(p.name for p in worker.socket_dir.glob("shard-*")) == ["shard-1"]
    assert sorted(p.name for p in leader.socket_dir.glob("shard-*")) == [
        "shard-0",
        "shard-0.steps",
    ]

    leader.proc.send_signal(signal.SIGTERM)
    assert wait_exit(leader) == 0, leader.log_tail()
    assert wait_exit(worker) == 0, worker.log_tail()
    log = worker.log_tail(20000)
    assert "Rank 1: stop received from rank 0" in log, log  # a clean stop of the group
    # Whichever the worker's launcher saw first: node 0's word, or its shard's exit 0.
    assert "Node 0 stopped the group" in log or "rank 0 ended the group" in log, log


def test_sigterm_on_node_1_drains_the_group_through_node_0(
    two_nodes: tuple[LauncherProcess, LauncherProcess],
) -> None:
    """Node 1's launcher keeps its rank while node 0 drains: the stream in flight, which
    needs both ranks for every token, ends with all its tokens; then both exit 0."""
    leader, worker = two_nodes
    with grpc.insecure_channel(leader.grpc_target) as channel, long_stream(channel, 200) as stream:
        worker.proc.send_signal(signal.SIGTERM)
    assert stream.error is None, stream.error
    assert stream.tokens == 200
    assert wait_exit(leader) == 0, leader.log_tail()
    assert wait_exit(worker) == 0, worker.log_tail()
    assert "Node 1's launcher was asked to stop: stopping the group" in leader.log_tail(20000)
    assert "Rank 1: stop received from rank 0" in worker.log_tail(20000), worker.log_tail()


def test_a_rank_killed_on_node_1_ends_both_launchers_naming_it(
    two_nodes: tuple[LauncherProcess, LauncherProcess],
) -> None:
    leader, worker = two_nodes
    (shard,) = worker.process_pids()["shard"]
    killed = time.monotonic()
    os.kill(shard, signal.SIGKILL)
    assert wait_exit(worker) == 1, worker.log_tail()
    assert wait_exit(leader) == 1, leader.log_tail()
    assert time.monotonic() - killed < END_WITHIN_S
    assert "Shard 1 failed: signal: 9 (SIGKILL)" in worker.log_tail(), worker.log_tail()
    assert "node 1: Shard 1 failed: signal: 9 (SIGKILL)" in leader.log_tail(), leader.log_tail()


def test_node_1_launcher_killed_ends_node_0_and_its_own_rank(
    two_nodes: tuple[LauncherProcess, LauncherProcess],
) -> None:
    """SIGKILL leaves node 1's launcher no time to tell anyone: node 0 sees its link close,
    and node 1's orphaned rank stops by itself."""
    leader, worker = two_nodes
    (shard,) = worker.process_pids()["shard"]
    killed = time.monotonic()
    worker.proc.kill()
    assert wait_exit(leader) == 1, leader.log_tail()
    assert "lost contact with node 1's launcher (127.0.0.1)" in leader.log_tail()
    while is_alive(shard) and time.monotonic() - killed < END_WITHIN_S:
        time.sleep(0.1)
    assert not is_alive(shard), "node 1's rank outlived its launcher"
    assert time.monotonic() - killed < END_WITHIN_S
