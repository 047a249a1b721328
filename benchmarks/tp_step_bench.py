"""Decode step time of tensor-parallel ranks, the eager step against the compiled one
(``TGIS_COMPILE=0`` / ``1``), alternating in one run on local gloo ranks (the CPU).

Each of ``--world-size`` ranks loads the model twice, once per form, as a shard rank does
(``load_runner`` with its ``TensorParallel``: the compiled form compiles at load), and every
rank runs the same Steps on its ``ModelRunner`` directly, so each step's all-reduces pair
up; rank 0 times ``ModelRunner.step`` (plan, forward, logits gathered, sampling). The
control exchange of a served step (``lockstep.py``: the same for both forms) is left out;
``lockstep_bench.py`` measures it. For each batch size ``B`` (``--batches``), ``B``
sequences of ``--context``-token prompts are prefilled on both runners, then ``--rounds``
rounds alternate ``--steps`` decode steps of the eager runner with as many of the compiled
one. Reported per B: each form's median ms per step and compiled / eager::

    python benchmarks/tp_step_bench.py --batches 1,8,32 --rounds 6 --steps 20
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tgis.shard.config import EngineSettings, ShardConfig  # noqa: E402
from tgis.shard.loader import load_runner  # noqa: E402
from tgis.shard.native.graphs.compiled import CompiledForward  # noqa: E402
from tgis.shard.native.runtime.model_runner import ModelRunner  # noqa: E402
from tgis.shard.parallel.distributed import destroy, gather_objects, init_distributed  # noqa: E402
from tgis.shard_api.messages import NewSequence, ScheduledSequence, StepPlan  # noqa: E402

BLOCK = 16
FORMS = ("eager", "compiled")


class Sequences:
    """Step plans for one runner: ``batch`` sequences prefilled, then decoded together,
    each gaining a block when its last one is full."""

    def __init__(self, batch: int, context: int, first_id: int) -> None:
        self.ids = list(range(first_id, first_id + batch))
        self.length = dict.fromkeys(self.ids, 0)
        self.next_block = 0
        self.step_id = 0
        self.context = context

    def _blocks(self, rid: int, tokens: int) -> tuple[int, ...]:
        have = -(-self.length[rid] // BLOCK)
        need = -(-(self.length[rid] + tokens) // BLOCK) - have
        blocks = tuple(range(self.next_block, self.next_block + need))
        self.next_block += need
        self.length[rid] += tokens
        return blocks

    def prefill(self) -> StepPlan:
        prompt = tuple(3 + i % 200 for i in range(self.context))
        self.step_id += 1
        return StepPlan(
            self.step_id,
            tuple(NewSequence(rid, prompt) for rid in self.ids),
            tuple(
                ScheduledSequence(rid, self.context, self._blocks(rid, self.context))
                for rid in self.ids
            ),
        )

    def decode(self) -> StepPlan:
        self.step_id += 1
        scheduled = tuple(ScheduledSequence(rid, 1, self._blocks(rid, 1)) for rid in self.ids)
        return StepPlan(self.step_id, (), scheduled)


def load(args: argparse.Namespace, rank: int, tp: Any, compiled: bool) -> ModelRunner:
    config = ShardConfig(
        model_name=args.model,
        rank=rank,
        world_size=args.world_size,
        sharded=args.world_size > 1,
        kv_cache_blocks=args.blocks,
        engine=EngineSettings(compile="1" if compiled else "0"),
    )
    runner = load_runner(config, tp)
    assert isinstance(runner, ModelRunner)
    assert isinstance(runner.forward, CompiledForward) == compiled
    return runner


def rank_main(rank: int, args: argparse.Namespace, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    tp = init_distributed(rank, args.world_size, timeout_s=600)
    started = time.monotonic()
    runners = {"eager": load(args, rank, tp, False)}
    loaded = time.monotonic()
    runners["compiled"] = load(args, rank, tp, True)
    if rank == 0:
        print(
            f"loaded: eager {loaded - started:.1f} s, compiled {time.monotonic() - loaded:.1f} s "
            f"(world {args.world_size}, {runners['eager'].kv_cache.k[0].dtype})",
            flush=True,
        )
        print("batch  eager ms/step  compiled ms/step  compiled/eager", flush=True)
    for batch in args.batches:
        plans = {form: Sequences(batch, args.context, 1) for form in FORMS}
        for form in FORMS:
            runners[form].step(plans[form].prefill())
        times: dict[str, list[float]] = {form: [] for form in FORMS}
        for _ in range(args.rounds):
            for form in FORMS:
                for _ in range(args.steps):
                    plan = plans[form].decode()
                    begun = time.perf_counter()
                    runners[form].step(plan)
                    times[form].append(time.perf_counter() - begun)
        for form in FORMS:
            runners[form].reset()
        medians = {form: statistics.median(t) * 1e3 for form, t in times.items()}
        if tp.is_parallel:
            gather_objects(tp, 0)  # the ranks leave the batch together
        if rank == 0:
            print(
                f"{batch:5d}  {medians['eager']:13.2f}  {medians['compiled']:16.2f}  "
                f"{medians['compiled'] / medians['eager']:14.2f}",
                flush=True,
            )
    destroy()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(ROOT / "tgis" / "embedded_model" / "data"))
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    args.batches = [int(b) for b in args.batches.split(",") if b.strip()]
    per_sequence = -(-(args.context + args.rounds * args.steps + 1) // BLOCK)
    args.blocks = max(args.batches) * per_sequence + 1
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(rank_main, args=(args, port), nprocs=args.world_size)


if __name__ == "__main__":
    main()
