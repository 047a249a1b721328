"""The gRPC server on a real Unix socket: in-process, and as the CLI's subprocess."""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
import torch

from tests.shard.models import EOS, VOCAB, TinyModel
from tgis.pb import shard_pb2, shard_pb2_grpc
from tgis.shard.native.runtime.model_runner import ModelRunner
from tgis.shard.serving.server import ShardServer
from tgis.shard_api.codec import plan_from_pb
from tgis.shard_api.messages import DetailOptions, NewSequence, ScheduledSequence, StepPlan

PROMPT = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23]  # 17: two blocks


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A temporary directory with a short path (Unix socket paths are limited to ~107 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="tgis-shard-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def serving(runner: ModelRunner, socket_path: Path) -> Iterator[ShardServer]:
    """A ShardServer for ``runner`` running on its own event-loop thread."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    server = ShardServer(runner, str(socket_path))
    asyncio.run_coroutine_threadsafe(server.start(), loop).result(30)
    try:
        yield server
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(0), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


@pytest.fixture
def served(make_runner: Callable[..., ModelRunner], short_dir: Path) -> Iterator[ShardServer]:
    """A ShardServer running on its own event-loop thread."""
    with serving(make_runner(), short_dir / "shard-0") as server:
        yield server


def stub_for(address: str) -> shard_pb2_grpc.ShardServiceStub:
    return shard_pb2_grpc.ShardServiceStub(grpc.insecure_channel(address))


def step_request(step_id: int, first: bool) -> shard_pb2.StepRequest:
    """Prefill PROMPT as request 1 (with details) when ``first``, else decode it."""
    request = shard_pb2.StepRequest(step_id=step_id)
    if first:
        request.new_sequences.add(
            request_id=1,
            prompt_token_ids=PROMPT,
            details=shard_pb2.TokenDetailOptions(
                logprobs=True, ranks=True, top_n=2, input_tokens=True, generated_tokens=True
            ),
        )
        request.scheduled.add(request_id=1, num_tokens=len(PROMPT), new_block_ids=[5, 2])
    else:
        request.scheduled.add(request_id=1, num_tokens=1)
    return request


def test_info_and_health(served: ShardServer, tiny_model: TinyModel) -> None:
    stub = stub_for(served.address)
    info = stub.Info(shard_pb2.InfoRequest(), timeout=10)
    assert info.model_kind == shard_pb2.CAUSAL_LM
    assert list(info.eos_token_ids) == [EOS]
    assert info.vocab_size == VOCAB
    assert (info.block_size, info.num_blocks, info.world_size) == (16, 64, 1)
    assert info.max_position_embeddings == 512
    assert (info.model_type, info.dtype, info.device) == ("llama", "float32", "cpu")
    assert info.attention_backend == served.runner.info.attention_backend
    assert info.attention_backend in ("cpu_paged", "torch_paged")  # the CPU default
    assert info.step_channel == f"{served.socket_path}.steps"
    stub.Health(shard_pb2.HealthRequest(), timeout=10)


def test_step_over_the_wire_matches_the_runner(
    served: ShardServer, make_runner: Callable[..., ModelRunner]
) -> None:
    stub = stub_for(served.address)
    direct = make_runner()
    for step_id in range(1, 6):
        request = step_request(step_id, first=step_id == 1)
        response = stub.Step(request, timeout=30)
        expected = direct.step(plan_from_pb(request))
        assert response.step_id == step_id
        assert [t.request_id for t in response.tokens] == [1]
        got, want = response.tokens[0].token, expected.tokens[0].token
        assert got.token_id == want.token_id and got.rank == want.rank
        assert got.logprob == pytest.approx(want.logprob, abs=1e-6)
        assert [t.token_id for t in got.top_tokens] == [t.token_id for t in want.top_tokens]
        assert response.forward_time_ns > 0
    first = stub.Step(step_request(10, first=False), timeout=30)
    assert first.tokens  # state persisted across calls


def test_input_tokens_over_the_wire(served: ShardServer) -> None:
    response = stub_for(served.address).Step(step_request(1, first=True), timeout=30)
    (inputs,) = response.input_tokens
    assert [t.token_id for t in inputs.tokens] == PROMPT
    assert math.isnan(inputs.tokens[0].logprob)
    assert all(t.rank >= 1 and len(t.top_tokens) >= 2 for t in inputs.tokens[1:])


def test_protocol_errors_map_to_status_codes(served: ShardServer) -> None:
    stub = stub_for(served.address)
    bad = shard_pb2.StepRequest(step_id=1)
    bad.scheduled.add(request_id=42, num_tokens=1)
    with pytest.raises(grpc.RpcError) as err:
        stub.Step(bad, timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "unknown request id 42" in (err.value.details() or "")
    stub.Step(step_request(2, first=True), timeout=30)
    stub.Reset(shard_pb2.ResetRequest(), timeout=10)
    with pytest.raises(grpc.RpcError) as err:
        stub.Step(step_request(3, first=False), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_prefix_lookup_over_the_wire(
    make_runner: Callable[..., ModelRunner], short_dir: Path
) -> None:
    """A prefix's length, NOT_FOUND and INVALID_ARGUMENT with TGIS's shard messages."""
    store = short_dir / "store"
    (store / "a" / "b").mkdir(parents=True)
    torch.save(torch.zeros(3, 64), store / "a" / "b" / "decoder.pt")
    (store / "nan").mkdir()
    torch.save(torch.full((2, 64), math.nan), store / "nan" / "decoder.pt")
    (short_dir / "outside").mkdir()
    torch.save(torch.zeros(3, 64), short_dir / "outside" / "decoder.pt")
    (store / "out").symlink_to(short_dir / "outside")
    runner = make_runner(prefix_store_path=str(store))
    with serving(runner, short_dir / "shard-0") as server:
        stub = stub_for(server.address)
        lookup = stub.PrefixLookup
        assert lookup(shard_pb2.PrefixLookupRequest(prefix_id="a/b")).prefix_length == 3
        cases = {
            "x": (grpc.StatusCode.NOT_FOUND, 'prefix id "x" not found'),
            "nan": (
                grpc.StatusCode.INVALID_ARGUMENT,
                "Unexpected <class 'Exception'>: Prefix contains non-finite elements",
            ),
            "a/../..": (
                grpc.StatusCode.INVALID_ARGUMENT,
                "Unexpected <class 'Exception'>: Invalid prefix id a/../.., must contain only "
                "alphanumeric, _ and - and /",
            ),
            "out": (  # a symlink leading out of the store
                grpc.StatusCode.INVALID_ARGUMENT,
                "Unexpected <class 'Exception'>: Invalid prefix id out",
            ),
        }
        for prefix_id, (code, message) in cases.items():
            with pytest.raises(grpc.RpcError) as caught:
                lookup(shard_pb2.PrefixLookupRequest(prefix_id=prefix_id))
            assert caught.value.code() == code, prefix_id
            assert caught.value.details() == message, prefix_id


def test_unexpected_failure_is_internal(served: ShardServer) -> None:
    def broken(plan: StepPlan) -> None:
        raise RuntimeError("kernel exploded")

    served.runner.step = broken  # type: ignore[method-assign,assignment]
    with pytest.raises(grpc.RpcError) as err:
        stub_for(served.address).Step(step_request(1, first=True), timeout=10)
    assert err.value.code() == grpc.StatusCode.INTERNAL
    assert err.value.details() == "kernel exploded"


def test_plan_conversion_reads_unset_fields_as_disabled() -> None:
    request = step_request(1, first=True)
    request.new_sequences[0].sampling.CopyFrom(shard_pb2.SamplingParams(temperature=0.5, seed=3))
    plan = plan_from_pb(request)
    (new,) = plan.new_sequences
    assert new == NewSequence(
        1,
        tuple(PROMPT),
        new.sampling,
        DetailOptions(True, True, 2, True, True),
    )
    assert (new.sampling.top_p, new.sampling.typical_p, new.sampling.repetition_penalty) == (
        1.0,
        1.0,
        1.0,
    )
    assert new.sampling.seed == 3 and new.sampling.length_penalty is None
    assert plan.scheduled == (ScheduledSequence(1, len(PROMPT), (5, 2)),)


def server_command() -> list[str]:
    script = Path(sys.executable).with_name("text-generation-server")
    return [str(script)] if script.exists() else [sys.executable, "-m", "tgis.shard"]


def test_cli_subprocess_serves_and_stops_on_sigterm(tiny_model: TinyModel, short_dir: Path) -> None:
    uds = short_dir / "sock"
    env = {**os.environ, "TGIS_KV_CACHE_BLOCKS": "40", "RANK": "0", "WORLD_SIZE": "1"}
    proc = subprocess.Popen(
        [*server_command(), "serve", str(tiny_model.path), "--uds-path", str(uds)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    socket = Path(f"{uds}-0")
    try:
        deadline = time.monotonic() + 60
        while not socket.exists():
            assert proc.poll() is None, proc.communicate()[0]
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.1)
        stub = stub_for(f"unix://{socket}")
        info = stub.Info(shard_pb2.InfoRequest(), timeout=30, wait_for_ready=True)
        assert info.num_blocks == 40 and info.vocab_size == VOCAB
        response = stub.Step(step_request(1, first=True), timeout=30)
        assert len(response.tokens) == 1
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, output
    assert f"Shard 0 ready on unix://{socket}" in output
    assert not socket.exists()
