"""Two real `text-generation-server serve --sharded` processes (gloo): rank 0 serves and
drives rank 1, rank 1 answers Health on its own socket, SIGTERM ends both cleanly, and a
lost rank makes rank 0 unhealthy and exit 1."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from tests.shard.models import TinyModel
from tests.shard.tp_utils import free_port
from tgis.pb import shard_pb2, shard_pb2_grpc

pytestmark = pytest.mark.slow  # starts tensor-parallel shard servers

SERVER = str(Path(sys.executable).parent / "text-generation-server")
PROMPT = list(range(5, 25))


@dataclass
class Ranks:
    procs: list[subprocess.Popen[bytes]]
    sockets: list[Path]
    logs: list[Path]

    def stub(self, rank: int) -> shard_pb2_grpc.ShardServiceStub:
        return shard_pb2_grpc.ShardServiceStub(
            grpc.insecure_channel(f"unix://{self.sockets[rank]}")
        )

    def log(self, rank: int) -> str:
        return self.logs[rank].read_text(errors="replace")

    def wait(self, rank: int, timeout: float = 20.0) -> int:
        try:
            return self.procs[rank].wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"rank {rank} still running:\n{self.log(rank)}") from None


@pytest.fixture
def ranks(tiny_model: TinyModel) -> Iterator[Ranks]:
    """Two ranks of the tiny model, both answering Health."""
    tmp = Path(tempfile.mkdtemp(prefix="tgis-tp-"))  # short: Unix socket paths are limited
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "WORLD_SIZE": "2",
        "TGIS_KV_CACHE_BLOCKS": "16",
        "OMP_NUM_THREADS": "1",
    }
    args = [SERVER, "serve", str(tiny_model.path), "--sharded", "--uds-path", str(tmp / "s")]
    logs = [tmp / f"rank-{rank}.log" for rank in (0, 1)]
    procs = []
    for rank in (0, 1):
        with open(logs[rank], "wb") as log:
            procs.append(
                subprocess.Popen(
                    args,
                    env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
    served = Ranks(procs, [tmp / f"s-{rank}" for rank in (0, 1)], logs)
    try:
        deadline = time.monotonic() + 60
        for rank in (0, 1):
            while True:
                assert procs[rank].poll() is None, served.log(rank)
                try:
                    served.stub(rank).Health(shard_pb2.HealthRequest(), timeout=2)
                    break
                except grpc.RpcError:
                    assert time.monotonic() < deadline, served.log(rank)
                    time.sleep(0.2)
        yield served
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)


def prefill() -> shard_pb2.StepRequest:
    request = shard_pb2.StepRequest(step_id=1)
    request.new_sequences.add(request_id=1, prompt_token_ids=PROMPT)
    request.scheduled.add(request_id=1, num_tokens=len(PROMPT), new_block_ids=[3, 7])
    return request


def test_rank_0_serves_rank_1_answers_health_and_sigterm_stops_both(
    ranks: Ranks, tiny_model: TinyModel
) -> None:
    info = ranks.stub(0).Info(shard_pb2.InfoRequest(), timeout=10)
    assert (info.world_size, info.num_blocks) == (2, 16)
    response = ranks.stub(0).Step(prefill(), timeout=30)
    assert [t.token.token_id for t in response.tokens] == tiny_model.greedy(PROMPT, 1)[0]
    with pytest.raises(grpc.RpcError) as err:
        ranks.stub(1).Step(prefill(), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == "rank 1 does not serve Step; rank 0 does"
    ranks.stub(0).Health(shard_pb2.HealthRequest(), timeout=10)  # a round trip to rank 1
    ranks.stub(0).Reset(shard_pb2.ResetRequest(), timeout=10)

    for proc in ranks.procs:
        proc.send_signal(signal.SIGTERM)
    assert (ranks.wait(0), ranks.wait(1)) == (0, 0), ranks.log(0) + ranks.log(1)
    assert not any(s.exists() for s in ranks.sockets)
    assert "stop received from rank 0" in ranks.log(1)


def test_lost_rank_makes_rank_0_unhealthy_and_exit_1(ranks: Ranks) -> None:
    ranks.procs[1].kill()
    ranks.procs[1].wait()
    with pytest.raises(grpc.RpcError) as err:
        ranks.stub(0).Health(shard_pb2.HealthRequest(), timeout=20)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert ranks.wait(0) == 1, ranks.log(0)
    assert "Tensor parallelism failed, stopping: lost contact" in ranks.log(0)
    assert not ranks.sockets[0].exists()
