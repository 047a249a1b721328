"""The tensor-parallel ranks' wire: a Step with every field set and every kind of outcome
decode to what was encoded; on 2 gloo ranks a plan larger than one command tensor arrives
whole and differing outcomes travel in full."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.shard.tp_utils import free_port
from tgis.shard.native.runtime.lockstep import (
    Command,
    Message,
    exchange_outcomes,
    receive_message,
    send_message,
)
from tgis.shard.native.runtime.lockstep_wire import (
    Outcome,
    decode_outcome,
    decode_plan,
    encode_outcome,
    encode_plan,
)
from tgis.shard.parallel.distributed import COMMAND_BYTES
from tgis.shard.parallel.group import TensorParallel
from tgis.shard_api.messages import (
    AdapterInfo,
    AdapterKind,
    DetailOptions,
    LengthPenalty,
    NewSequence,
    PrefixInfo,
    SamplingParams,
    ScheduledSequence,
    StepPlan,
)

SAMPLING = SamplingParams(
    temperature=0.7,  # not a float32: must arrive exactly
    top_k=20,
    top_p=0.9,
    typical_p=0.95,
    seed=(1 << 64) - 3,
    repetition_penalty=1.2,
    min_new_tokens=3,
    length_penalty=LengthPenalty(start_index=5, decay_factor=1.5),
    grammar='{"type": "object"} — é',
    presence_penalty=0.5,
    frequency_penalty=-0.25,
    logit_bias=((7, 2.5), (3, -1.0)),
    min_p=0.05,
)
DETAILS = DetailOptions(
    logprobs=True, ranks=True, top_n=4, input_tokens=True, generated_tokens=True
)
BIG_ID = (1 << 64) - 1  # the step channel's ids are uint64
FULL = NewSequence(
    request_id=BIG_ID,
    prompt_token_ids=(1, 2, 3, 50_000),
    sampling=SAMPLING,
    details=DETAILS,
    prefix_id="pre/fix",
    prefix_length=8,
    adapter_id="lora-ü",
    prefix_version="v1",
    adapter_version="v2",
)
SCHEDULED = ScheduledSequence(
    request_id=BIG_ID,
    num_tokens=6,
    new_block_ids=(4, 5),
    cached_tokens=2,
    draft_token_ids=(9, 8),
    spec_tokens=3,
    state_slot=7,
)
PLAN = StepPlan(
    step_id=BIG_ID - 1,
    new_sequences=(FULL, NewSequence(12, (5,))),
    scheduled=(SCHEDULED, ScheduledSequence(12, 1, state_slot=0), ScheduledSequence(13, 1)),
    finished_request_ids=(1, 2),
    preempted_request_ids=(3,),
    base_step_id=41,
)


def non_default(obj: object) -> list[str]:
    """The fields of dataclass `obj` left at their default (recursively)."""
    left = []
    for f in dataclasses.fields(obj):  # type: ignore[arg-type]
        value = getattr(obj, f.name)
        if f.default is not dataclasses.MISSING and value == f.default:
            left.append(f.name)
        if dataclasses.is_dataclass(value):
            left += [f"{f.name}.{name}" for name in non_default(value)]
    return left


def test_a_plan_with_every_field_set_round_trips() -> None:
    for obj in (PLAN, FULL, SCHEDULED):
        assert non_default(obj) == []
    assert decode_plan(encode_plan(PLAN)) == PLAN
    assert decode_plan(encode_plan(StepPlan())) == StepPlan()


@pytest.mark.parametrize(
    "outcome",
    [
        Outcome(),
        Outcome(error="ValueError: bad — plan\nsecond line"),
        Outcome(tokens=((1, 5), (2, 7)), failed=(3,)),
        Outcome(prefix=PrefixInfo(8, "v1")),
        Outcome(adapter=AdapterInfo(AdapterKind.PROMPT_TUNING, 4, "v9")),
        Outcome(adapter=AdapterInfo(AdapterKind.LORA)),
    ],
)
def test_outcomes_round_trip(outcome: Outcome) -> None:
    assert decode_outcome(encode_outcome(outcome)) == outcome


BIG = StepPlan(step_id=1, new_sequences=(NewSequence(1, tuple(range(COMMAND_BYTES))),))


def _rank(rank: int, port: int, results: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    tp = TensorParallel(rank=rank, world_size=2, group=None, control_group=dist.new_group())
    try:
        if rank == 0:
            send_message(tp, Message(Command.STEP, BIG))
            send_message(tp, Message(Command.ADAPTER, adapter_id="a-ü"))
            got: list[object] = [BIG, Message(Command.ADAPTER, adapter_id="a-ü")]
        else:
            got = [receive_message(tp).plan, receive_message(tp)]
        got.append(exchange_outcomes(tp, Outcome(tokens=((1, 2),))))
        got.append(exchange_outcomes(tp, Outcome(error=f"E: rank {rank}") if rank else Outcome()))
        results.put((rank, got))
    finally:
        dist.destroy_process_group()


def test_two_ranks_exchange_large_plans_and_differing_outcomes() -> None:
    context = mp.get_context("fork")  # no gloo group in this process yet: safe to fork
    results = context.SimpleQueue()
    mp.start_processes(_rank, args=(free_port(), results), nprocs=2, start_method="fork")
    rank0, rank1 = (got for _, got in sorted(results.get() for _ in range(2)))
    assert rank1[:2] == [BIG, Message(Command.ADAPTER, adapter_id="a-ü")]
    same = [Outcome(tokens=((1, 2),))] * 2
    differing = [Outcome(), Outcome(error="E: rank 1")]
    assert rank0[2:] == rank1[2:] == [same, differing]
