"""Run the same Step plans on any model directory with 1 or N tensor-parallel ranks (gloo).

For model-family tests::

    from tests.shard.tp_utils import Request, assert_tensor_parallel_matches, make_plans

    plans = make_plans([Request(1, prompt, max_new_tokens=6)], block_size=16)
    reports = assert_tensor_parallel_matches(model_dir, plans, world_size=2)

or, step by step::

    single = run_plans(model_dir, plans, world_size=1)
    double = run_plans(model_dir, plans, world_size=2)
    assert_same_outputs(single[0].outputs, double[0].outputs, atol=1e-4)

`run_plans` with N > 1 starts N Python processes (this module, ``python -m
tests.shard.tp_utils`` from the repository root), each joining a gloo
group through `init_distributed` and loading the model with its `TensorParallel`; rank 0
drives the plans through the real `LockstepRunner` and the others run the real `run_worker`
loop, exactly as `text-generation-server serve --sharded` does. With N = 1 the plans run in
this process on a plain `ModelRunner`. Every rank reports what it read from the safetensors
files (elements per tensor name, counted at the safetensors calls) and its KV-cache shape.
"""

from __future__ import annotations

import contextlib
import math
import os
import pickle
import random
import socket
import subprocess
import sys
import tempfile
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import tgis.shard.device as device_module
from tgis.shard.checkpoints.weights import Weights
from tgis.shard.config import ShardConfig
from tgis.shard.loader import load_runner
from tgis.shard.native.runtime.model_runner import ModelRunner
from tgis.shard_api.messages import (
    DetailOptions,
    NewSequence,
    SamplingParams,
    ScheduledSequence,
    StepOutput,
    StepPlan,
)

ROOT = Path(__file__).resolve().parents[2]  # the repository root: `tests` is importable there
RANK_TIMEOUT_S = 90.0
JOIN_TIMEOUT_S = 30.0
"""How long each rank may take to join the group (the shard's --distributed-timeout)."""
LOGPROB_ATOL = 1e-4
JOB_TIMEOUT_S = 30.0
"""What each further job of `run_plans_on_each` adds to the ranks' timeout."""


@dataclass(frozen=True)
class Request:
    """A sequence for `make_plans`: prompt, how many tokens to generate, when it arrives."""

    request_id: int
    prompt: tuple[int, ...]
    max_new_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    details: DetailOptions = field(default_factory=DetailOptions)
    arrives: int = 0  # the step index at which it is announced
    chunk: int | None = None  # prefill chunk size (None: the whole prompt at once)
    prefix_id: str = ""  # a prompt-tuning prefix of `prefix_length` virtual tokens
    prefix_length: int = 0
    adapter_id: str = ""  # an adapter of the adapter cache

    @property
    def prompt_length(self) -> int:
        return self.prefix_length + len(self.prompt)


def make_plans(
    requests: Sequence[Request], block_size: int = 16, num_blocks: int = 64, seed: int = 0
) -> list[StepPlan]:
    """The Steps a router would send: chunked prefill, decodes, finishes, reused blocks.

    Plans do not depend on the sampled tokens (nothing stops early), so they are made up
    front and can be replayed on any number of ranks.
    """
    free = list(range(num_blocks))
    random.Random(seed).shuffle(free)
    tables: dict[int, list[int]] = {}
    computed: dict[int, int] = {}
    sampled: dict[int, int] = {}
    finished: list[int] = []
    plans: list[StepPlan] = []
    pending = sorted(requests, key=lambda r: r.arrives)
    active: list[Request] = []
    while pending or active:
        index = len(plans)
        new = [r for r in pending if r.arrives <= index]
        pending = [r for r in pending if r.arrives > index]
        active += new
        scheduled = []
        for r in active:
            prompt_left = r.prompt_length - computed.get(r.request_id, 0)
            n = min(prompt_left, r.chunk or prompt_left) if prompt_left > 0 else 1
            done = computed.get(r.request_id, 0) + n
            need = math.ceil(done / block_size) - len(tables.setdefault(r.request_id, []))
            blocks = [free.pop() for _ in range(max(need, 0))]
            tables[r.request_id] += blocks
            computed[r.request_id] = done
            if done >= r.prompt_length:
                sampled[r.request_id] = sampled.get(r.request_id, 0) + 1
            scheduled.append(ScheduledSequence(r.request_id, n, tuple(blocks)))
        plans.append(
            StepPlan(
                step_id=index + 1,
                new_sequences=tuple(
                    NewSequence(
                        r.request_id,
                        r.prompt,
                        r.sampling,
                        r.details,
                        prefix_id=r.prefix_id,
                        prefix_length=r.prefix_length,
                        adapter_id=r.adapter_id,
                    )
                    for r in new
                ),
                scheduled=tuple(scheduled),
                finished_request_ids=tuple(finished),
            )
        )
        finished = [r.request_id for r in active if sampled.get(r.request_id) == r.max_new_tokens]
        for rid in finished:
            free += tables.pop(rid)
        active = [r for r in active if r.request_id not in finished]
    return plans


@dataclass
class RankReport:
    """What one rank did: rank 0's Step outputs (or "ErrorType: message" per failed Step),
    the elements it read per tensor name, its KV-cache shape and its Info."""

    rank: int
    outputs: list[StepOutput | str] = field(default_factory=list)
    reads: dict[str, int] = field(default_factory=dict)
    kv_shape: tuple[int, ...] = ()
    num_blocks: int = 0
    world_size: int = 1
    worker_error: str | None = None  # a rank > 0 that left its loop with an error
    lookups: list[object] = field(default_factory=list)  # rank 0's prefix lookups
    adapter_lookups: list[object] = field(default_factory=list)  # rank 0's adapter lookups
    forward: str = ""  # the class of the rank's forward after the last Step (eager: "method")
    compiled_graphs: int = 0  # graphs torch.compile made in the rank's process


def run_plans(
    model_dir: Path | str,
    plans: Sequence[StepPlan],
    world_size: int = 1,
    *,
    diverge_at: int | None = None,
    timeout_s: float = RANK_TIMEOUT_S,
    lookups: Sequence[str] = (),
    adapter_lookups: Sequence[str] = (),
    **config: Any,
) -> list[RankReport]:
    """Run `plans` on `world_size` ranks of the model at `model_dir`; one report per rank.

    `config` goes to `ShardConfig` (default `kv_cache_blocks=64`). `diverge_at` (tests of
    the lock-step check) makes rank 1 fail after running that Step index. `lookups`: prompt
    prefix ids rank 0 looks up (on every rank) before the first Step; `adapter_lookups`,
    adapter ids, after them.
    """
    config.setdefault("kv_cache_blocks", 64)
    spec = {
        "model_dir": str(model_dir),
        "plans": list(plans),
        "config": config,
        "diverge_at": diverge_at,
        "lookups": list(lookups),
        "adapter_lookups": list(adapter_lookups),
    }
    if world_size == 1:
        return [_run_rank(spec, 0, 1)]
    spec["master_port"] = free_port()
    return _in_rank_processes(spec, world_size, timeout_s)


def _in_rank_processes(spec: Any, world_size: int, timeout_s: float) -> list[Any]:
    """Start `world_size` rank processes on `spec` (one job, or a list of them: see
    `_main`) and wait for them; what each rank reported."""
    with tempfile.TemporaryDirectory(prefix="tgis-tp-") as tmp:
        spec_path = Path(tmp) / "spec.pkl"
        spec_path.write_bytes(pickle.dumps(spec))
        env = {
            **os.environ,
            "MASTER_ADDR": "127.0.0.1",
            "WORLD_SIZE": str(world_size),
            "OMP_NUM_THREADS": "1",
        }
        procs = [
            subprocess.Popen(
                [sys.executable, "-m", "tests.shard.tp_utils", str(spec_path), str(rank)],
                cwd=ROOT,
                env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
            for rank in range(world_size)
        ]
        logs = _wait_all(procs, timeout_s)
        reports = []
        for rank, proc in enumerate(procs):
            out = Path(tmp) / f"rank-{rank}.pkl"
            if proc.returncode != 0 or not out.is_file():
                raise AssertionError(f"rank {rank} exited {proc.returncode}:\n{logs[rank]}")
            reports.append(pickle.loads(out.read_bytes()))
        return reports


def run_plans_on_each(
    jobs: Sequence[tuple[Path | str, Sequence[StepPlan]]],
    world_size: int,
    *,
    timeout_s: float = RANK_TIMEOUT_S,
    **config: Any,
) -> list[list[RankReport]]:
    """`run_plans` of each (model directory, plans) job on the same `world_size` rank
    processes, one job after the other, each in a process group of its own (a port of its
    own); one list of reports per job. The processes' start (Python, torch: ~3 s of a
    two-core host per `run_plans`) is paid once for all the jobs.

    `timeout_s` is the first job's; each further one adds `JOB_TIMEOUT_S`."""
    config.setdefault("kv_cache_blocks", 64)
    ports: list[int] = []
    while len(ports) < len(jobs):
        if (port := free_port()) not in ports:
            ports.append(port)
    specs = [
        {
            "model_dir": str(model_dir),
            "plans": list(plans),
            "config": config,
            "diverge_at": None,
            "lookups": [],
            "adapter_lookups": [],
            "master_port": port,
        }
        for (model_dir, plans), port in zip(jobs, ports, strict=True)
    ]
    timeout = timeout_s + JOB_TIMEOUT_S * (len(jobs) - 1)
    per_rank = _in_rank_processes(specs, world_size, timeout)
    return [list(reports) for reports in zip(*per_rank, strict=True)]


def assert_tensor_parallel_matches(
    model_dir: Path | str,
    plans: Sequence[StepPlan],
    world_size: int = 2,
    atol: float = LOGPROB_ATOL,
    ignore_requests: Collection[int] = (),
    **config: Any,
) -> list[RankReport]:
    """Run `plans` on 1 and on `world_size` ranks, assert the same outputs (see
    `assert_same_outputs`); the multi-rank reports (e.g. to check what each rank read)."""
    single = run_plans(model_dir, plans, 1, **config)[0]
    reports = run_plans(model_dir, plans, world_size, **config)
    assert_same_outputs(single.outputs, reports[0].outputs, atol, ignore_requests)
    return reports


def _wait_all(procs: list[subprocess.Popen[bytes]], timeout_s: float) -> list[str]:
    """Wait for every process (kill all on timeout); their combined output."""
    logs = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=timeout_s)
            logs.append(out.decode(errors="replace")[-4000:])
    except subprocess.TimeoutExpired:
        for proc in procs:
            proc.kill()
        raise AssertionError(f"ranks still running after {timeout_s:g} s (deadlock?)") from None
    return logs


def free_port() -> int:
    """A TCP port nobody listens on (for MASTER_PORT)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def assert_same_outputs(
    expected: Sequence[StepOutput | str],
    got: Sequence[StepOutput | str],
    atol: float = LOGPROB_ATOL,
    ignore_requests: Collection[int] = (),
) -> None:
    """Same tokens, errors and detail token ids step by step; logprobs within `atol`.

    `ignore_requests`: ids whose sampled tokens may differ (e.g. sampled without a seed)."""
    assert len(expected) == len(got)
    for step, (a, b) in enumerate(zip(expected, got, strict=True)):
        if isinstance(a, str) or isinstance(b, str):
            assert a == b, f"step {step}"
            continue
        assert [t.request_id for t in a.tokens] == [t.request_id for t in b.tokens]
        assert a.errors == b.errors, f"step {step}"
        for ta, tb in zip(a.tokens, b.tokens, strict=True):
            if ta.request_id in ignore_requests:
                continue
            _assert_detail(ta.token, tb.token, atol, f"step {step} request {ta.request_id}")
        assert [i.request_id for i in a.input_tokens] == [i.request_id for i in b.input_tokens]
        for ia, ib in zip(a.input_tokens, b.input_tokens, strict=True):
            assert len(ia.tokens) == len(ib.tokens)
            for pos, (da, db) in enumerate(zip(ia.tokens, ib.tokens, strict=True)):
                _assert_detail(da, db, atol, f"step {step} input {ia.request_id}[{pos}]")


def _assert_detail(a: Any, b: Any, atol: float, where: str) -> None:
    assert a.token_id == b.token_id, f"{where}: token {a.token_id} != {b.token_id}"
    assert a.rank == b.rank, where
    both_nan = math.isnan(a.logprob) and math.isnan(b.logprob)  # the first prompt token's
    assert both_nan or math.isclose(a.logprob, b.logprob, abs_tol=atol), (
        f"{where}: logprob {a.logprob} vs {b.logprob}"
    )
    assert [t.token_id for t in a.top_tokens] == [t.token_id for t in b.top_tokens], where
    for x, y in zip(a.top_tokens, b.top_tokens, strict=True):
        assert math.isclose(x.logprob, y.logprob, abs_tol=atol), f"{where}: top {x} vs {y}"


# ---- what each rank runs -------------------------------------------------------------------


class _CountingSlice:
    def __init__(self, view: Any, name: str, reads: dict[str, int]) -> None:
        self._view, self._name, self._reads = view, name, reads

    def get_shape(self) -> Any:
        return self._view.get_shape()

    def get_dtype(self) -> Any:
        return self._view.get_dtype()

    def __getitem__(self, index: Any) -> torch.Tensor:
        tensor = self._view[index]
        self._reads[self._name] = self._reads.get(self._name, 0) + tensor.numel()
        return tensor


class _CountingHandle:
    """A safe_open handle that counts the elements each call reads from the file."""

    def __init__(self, handle: Any, reads: dict[str, int]) -> None:
        self._handle, self._reads = handle, reads

    def get_tensor(self, name: str) -> torch.Tensor:
        tensor = self._handle.get_tensor(name)
        self._reads[name] = self._reads.get(name, 0) + tensor.numel()
        return tensor

    def get_slice(self, name: str) -> _CountingSlice:
        return _CountingSlice(self._handle.get_slice(name), name, self._reads)

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._handle, attr)


@contextlib.contextmanager
def count_reads() -> Iterator[dict[str, int]]:
    """Elements read per tensor name by every `Weights` while the context is open."""
    reads: dict[str, int] = {}
    original = Weights._handle

    def counting(self: Weights, name: str) -> Any:
        return _CountingHandle(original(self, name), reads)

    Weights._handle = counting  # type: ignore[method-assign]
    try:
        yield reads
    finally:
        Weights._handle = original  # type: ignore[method-assign]


def _run_rank(spec: dict[str, Any], rank: int, world_size: int) -> RankReport:
    from tgis.shard.native.runtime.lockstep import LockstepRunner, run_worker
    from tgis.shard.parallel.distributed import destroy, init_distributed
    from tgis.shard.serving.tensor_parallel import native_runner

    tp = init_distributed(rank, world_size, timeout_s=JOIN_TIMEOUT_S)
    config = ShardConfig(
        model_name=spec["model_dir"],
        rank=rank,
        world_size=world_size,
        sharded=world_size > 1,
        **spec["config"],
    )
    with count_reads() as reads:
        runner = native_runner(load_runner(config, tp))
    report = RankReport(
        rank=rank,
        reads=dict(reads),
        kv_shape=tuple(runner.kv_cache.k[0].shape),
        num_blocks=runner.info.num_blocks,
        world_size=runner.info.world_size,
    )
    if rank > 0:
        _sabotage(runner, spec["diverge_at"])
        try:
            run_worker(runner, tp)
        except Exception as e:
            report.worker_error = f"{type(e).__name__}: {e}"
        destroy()
        return _with_forward(report, runner)
    driver: ModelRunner | LockstepRunner = LockstepRunner(runner, tp) if tp.is_parallel else runner
    for prefix_id in spec["lookups"]:
        try:
            report.lookups.append(driver.lookup_prefix(prefix_id))
        except Exception as e:
            report.lookups.append(f"{type(e).__name__}: {e}")
    for adapter_id in spec.get("adapter_lookups", ()):
        try:
            report.adapter_lookups.append(driver.lookup_adapter(adapter_id))
        except Exception as e:
            report.adapter_lookups.append(f"{type(e).__name__}: {e}")
    for plan in spec["plans"]:
        try:
            report.outputs.append(driver.step(plan))
        except Exception as e:
            report.outputs.append(f"{type(e).__name__}: {str(e).splitlines()[0]}")
    if isinstance(driver, LockstepRunner):
        driver.close()
    destroy()
    return _with_forward(report, runner)


def _with_forward(report: RankReport, runner: ModelRunner) -> RankReport:
    report.forward = type(runner.forward).__name__
    report.compiled_graphs = int(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    return report


def _sabotage(runner: ModelRunner, diverge_at: int | None) -> None:
    """Make this rank raise after running Step index `diverge_at` (rank 0 does not)."""
    if diverge_at is None:
        return
    step = runner.step

    def failing(plan: StepPlan) -> StepOutput:
        output = step(plan)
        if plan.step_id == diverge_at + 1:
            raise RuntimeError("injected failure on this rank only")
        return output

    runner.step = failing  # type: ignore[method-assign]


def _main() -> None:
    spec_path, rank = Path(sys.argv[1]), int(sys.argv[2])
    torch.set_num_threads(1)
    # As in the test process (tests/conftest.py): `--dtype auto` is float32 here.
    device_module.cpu_bf16_flags = lambda *args: ()
    spec = pickle.loads(spec_path.read_bytes())
    world_size = int(os.environ["WORLD_SIZE"])
    # One job (run_plans), or a list of them (run_plans_on_each) run in turn.
    reports = []
    for job in spec if isinstance(spec, list) else [spec]:
        os.environ["MASTER_PORT"] = str(job["master_port"])
        reports.append(_run_rank(job, rank, world_size))
    result = reports if isinstance(spec, list) else reports[0]
    (spec_path.parent / f"rank-{rank}.pkl").write_bytes(pickle.dumps(result))


if __name__ == "__main__":
    # This file as a module, so the reports unpickle as tests.shard.tp_utils.RankReport.
    from tests.shard import tp_utils

    tp_utils._main()
