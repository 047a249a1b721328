"""Block accounting and step planning (pure router logic, no processes)."""

from __future__ import annotations

import pytest

from tgis.router.block_allocator import BlockAllocator, blocks_for
from tgis.router.request_state import RequestState, RequestStatus
from tgis.router.request_types import (
    GenerationParams,
    ResponseOptions,
    SamplingParams,
    StoppingParams,
    ValidatedRequest,
)
from tgis.router.scheduler import Scheduler, SchedulerLimits


def make_state(request_id: int, prompt_len: int, max_new_tokens: int) -> RequestState:
    stopping = StoppingParams(max_new_tokens=max_new_tokens)
    sampling = SamplingParams()
    request = ValidatedRequest(
        text="x",
        input_ids=tuple(range(prompt_len)),
        params=GenerationParams(sampling, stopping, ResponseOptions()),
        stopping=stopping,
        sampling=sampling,
    )
    return RequestState(request_id=request_id, request=request, arrival=0.0)


def test_blocks_for_rounds_up() -> None:
    assert [blocks_for(n, 16) for n in (0, 1, 16, 17, 32, 33)] == [0, 1, 1, 2, 2, 3]


def test_allocator_reserves_grows_and_releases() -> None:
    allocator = BlockAllocator(num_blocks=4, block_size=4)
    assert allocator.can_reserve(16) and not allocator.can_reserve(17)
    reserved = allocator.reserve(10)
    assert reserved == 3 and allocator.unreserved == 1
    owned: list[int] = []
    assert allocator.grow(owned, 5) == (0, 1)
    assert allocator.grow(owned, 8) == ()
    assert allocator.grow(owned, 9) == (2,)
    assert allocator.num_free == 1
    allocator.release(owned, reserved)
    assert owned == [] and allocator.num_free == 4 and allocator.unreserved == 4


def test_new_requests_join_the_running_batch_at_the_next_step() -> None:
    scheduler = Scheduler(BlockAllocator(64, 4), SchedulerLimits(8, 1000))
    first = make_state(1, prompt_len=5, max_new_tokens=10)
    scheduler.add(first)
    plan = scheduler.schedule(now=0.0)
    assert [s.request_id for s in plan.new_sequences] == [1]
    assert [(c.request_id, c.num_tokens, c.new_block_ids) for c in plan.scheduled] == [
        (1, 5, (0, 1))
    ]
    first.num_computed = 5
    first.generated_ids.append(42)
    second = make_state(2, prompt_len=3, max_new_tokens=4)
    scheduler.add(second)
    plan = scheduler.schedule(now=1.0)
    # One decode token for the running request, the whole prompt of the newcomer.
    assert [(c.request_id, c.num_tokens) for c in plan.scheduled] == [(1, 1), (2, 3)]
    assert [s.request_id for s in plan.new_sequences] == [2]
    assert second.status is RequestStatus.RUNNING and second.started_at == 1.0


def test_long_prompts_are_prefilled_in_chunks_within_the_token_budget() -> None:
    scheduler = Scheduler(BlockAllocator(64, 4), SchedulerLimits(8, 6))
    state = make_state(1, prompt_len=14, max_new_tokens=2)
    scheduler.add(state)
    chunks = []
    while state.in_prompt:
        plan = scheduler.schedule(now=0.0)
        (chunk,) = plan.scheduled
        chunks.append(chunk.num_tokens)
        state.num_computed += chunk.num_tokens
    assert chunks == [6, 6, 2]
    assert len(state.block_ids) == blocks_for(14, 4)


def test_admission_respects_batch_size_and_kv_reservation() -> None:
    scheduler = Scheduler(BlockAllocator(8, 4), SchedulerLimits(2, 1000))
    states = [make_state(i, prompt_len=4, max_new_tokens=8) for i in range(1, 5)]
    for s in states:
        scheduler.add(s)
    plan = scheduler.schedule(now=0.0)
    # Each needs 3 blocks worst case: 2 fit in 8 blocks, and the batch size is 2 anyway.
    assert [s.request_id for s in plan.new_sequences] == [1, 2]
    assert len(scheduler.waiting) == 2
    scheduler.finish(states[0])
    plan = scheduler.schedule(now=0.0)
    assert plan.finished_ids == (1,)
    assert [s.request_id for s in plan.new_sequences] == [3]


def test_reservation_beyond_capacity_is_refused() -> None:
    allocator = BlockAllocator(2, 4)
    with pytest.raises(RuntimeError):
        allocator.reserve(9)
