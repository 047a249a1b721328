"""Per-step cost of the tensor-parallel control exchange on 2 local gloo ranks: rank 0
broadcasting a Step and the ranks comparing their outcomes, with no model in between.

Compares the pickled exchange (``broadcast_object_list`` + ``all_gather_object``, what
lockstep.py used before) with the tensor one (``send_message``/``receive_message`` +
``exchange_outcomes``), on a decode Step of ``--sequences`` sequences (one token each, every
16th gaining a block) and on a prefill Step of 4 new sampled sequences of 512 tokens::

    python benchmarks/lockstep_bench.py --sequences 32 --iterations 2000
"""

from __future__ import annotations

import argparse
import os
import socket
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

from tgis.shard.native.runtime.lockstep import (
    Command,
    Message,
    exchange_outcomes,
    receive_message,
    send_message,
)
from tgis.shard.native.runtime.lockstep_wire import Outcome
from tgis.shard.parallel.group import TensorParallel
from tgis.shard_api.messages import NewSequence, SamplingParams, ScheduledSequence, StepPlan


def decode_step(n: int) -> StepPlan:
    scheduled = tuple(ScheduledSequence(i, 1, (1000 + i,) if i % 16 == 0 else ()) for i in range(n))
    return StepPlan(step_id=7, scheduled=scheduled, base_step_id=6)


def prefill_step() -> StepPlan:
    sampling = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=12345)
    new = tuple(NewSequence(i, tuple(range(i, i + 512)), sampling) for i in range(4))
    scheduled = tuple(
        ScheduledSequence(i, 512, tuple(range(32 * i, 32 * i + 32))) for i in range(4)
    )
    return StepPlan(step_id=1, new_sequences=new, scheduled=scheduled)


def pickled(tp: TensorParallel, message: Message, outcome: Outcome) -> None:
    box = [message if tp.rank == 0 else None]
    dist.broadcast_object_list(box, src=0, group=tp.control_group)
    out: list[Any] = [None] * tp.world_size
    dist.all_gather_object(out, outcome, group=tp.control_group)


def tensors(tp: TensorParallel, message: Message, outcome: Outcome) -> None:
    if tp.rank == 0:
        send_message(tp, message)
    else:
        receive_message(tp)
    exchange_outcomes(tp, outcome)


def _rank(rank: int, port: int, iterations: int, sequences: int, results: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    tp = TensorParallel(rank=rank, world_size=2, group=None, control_group=dist.new_group())
    cases = {
        f"decode, {sequences} sequences": decode_step(sequences),
        "prefill, 4 x 512 tokens": prefill_step(),
    }
    for case, plan in cases.items():
        message = Message(Command.STEP, plan)
        outcome = Outcome(tokens=tuple((s.request_id, 100 + s.request_id) for s in plan.scheduled))
        ways: dict[str, Callable[[TensorParallel, Message, Outcome], None]] = {
            "pickled objects": pickled,
            "tensors": tensors,
        }
        for name, way in ways.items():
            for _ in range(iterations // 10):  # warm-up
                way(tp, message, outcome)
            dist.barrier(group=tp.control_group)
            start = time.perf_counter()
            for _ in range(iterations):
                way(tp, message, outcome)
            elapsed = time.perf_counter() - start
            if rank == 0:
                results.put((case, name, elapsed / iterations * 1e6))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, default=32)
    parser.add_argument("--iterations", type=int, default=2000)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = mp.get_context("fork")
    results = context.SimpleQueue()
    mp.start_processes(
        _rank, args=(port, args.iterations, args.sequences, results), nprocs=2, start_method="fork"
    )
    print(f"{'Step':<28}{'exchange':<18}{'µs per step (rank 0)':>22}")
    while not results.empty():
        case, name, micros = results.get()
        print(f"{case:<28}{name:<18}{micros:>22.1f}")


if __name__ == "__main__":
    main()
