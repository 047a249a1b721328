"""Recurrent-state slots (a model with Mamba layers): owned by the scheduler like KV blocks,
taken at admission, given back when a request finishes, is cancelled or is preempted; the
batch never holds more sequences than slots, so the others wait."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tests.router.core.test_scheduler import complete, limits, make_state
from tgis.router.config import RouterConfig
from tgis.router.core.batching import scheduler_limits
from tgis.router.core.block_pool import BlockPool
from tgis.router.core.scheduler import Scheduler
from tgis.router.core.state_slots import StateSlots
from tgis.router.core.steps import ScheduledStep
from tgis.shard_api.messages import ModelKind, ShardInfo


def slots_of(step: ScheduledStep) -> dict[int, int | None]:
    return {s.request_id: s.state_slot for s in step.plan.scheduled}


def test_requests_wait_for_a_free_slot_and_take_the_one_given_back() -> None:
    scheduler = Scheduler(BlockPool(64, 4), limits(batch=2), state_slots=2)
    a, b, c = (make_state(i, prompt_len=5, max_new_tokens=20) for i in (1, 2, 3))
    for s in (a, b, c):
        scheduler.add(s)
    step = scheduler.schedule(0.0)
    assert slots_of(step) == {1: 0, 2: 1}  # c waits: no slot, not a failure
    assert list(scheduler.waiting) == [c] and scheduler.state_slots is not None
    complete(scheduler, step)
    step = scheduler.schedule(0.0)
    assert slots_of(step) == {1: 0, 2: 1}  # decodes keep their slots
    complete(scheduler, step)
    scheduler.finish(a)
    step = scheduler.schedule(0.0)
    assert slots_of(step) == {2: 1, 3: 0}  # c got a's slot back
    assert step.plan.finished_request_ids == (1,) and a.state_slot is None


def test_a_preempted_request_gives_its_slot_back_and_gets_one_when_resumed() -> None:
    scheduler = Scheduler(BlockPool(64, 4), limits(batch=3), state_slots=3)
    a, b = (make_state(i, prompt_len=4, max_new_tokens=20) for i in (1, 2))
    for s in (a, b):
        scheduler.add(s)
    complete(scheduler, scheduler.schedule(0.0))
    scheduler.preempt(b)
    assert b.state_slot is None and scheduler.state_slots.num_free == 2  # type: ignore[union-attr]
    scheduler.add(make_state(3, prompt_len=4, max_new_tokens=20))
    known = b.known_length
    step = scheduler.schedule(0.0)  # b leads the queue: resumed from position 0
    assert slots_of(step) == {1: 0, 2: 1, 3: 2}
    assert [(s.request_id, s.num_tokens) for s in step.plan.scheduled][1] == (2, known)


def test_models_without_recurrent_state_send_no_slot() -> None:
    scheduler = Scheduler(BlockPool(64, 4), limits())
    scheduler.add(make_state(1, prompt_len=4, max_new_tokens=5))
    assert slots_of(scheduler.schedule(0.0)) == {1: None} and scheduler.state_slots is None


def test_the_batch_is_capped_by_the_shard_s_state_slots() -> None:
    info = ShardInfo(ModelKind.CAUSAL_LM, (2,), 256, 16, 64, 1, 512, "x", "float32", "cpu", "a")
    config = RouterConfig(tokenizer_path="t", max_batch_size=16)
    assert scheduler_limits(config, info).max_batch_size == 16
    assert scheduler_limits(config, replace(info, state_slots=5)).max_batch_size == 5


def test_a_slot_given_back_twice_is_an_error() -> None:
    slots = StateSlots(2)
    first = slots.take()
    slots.give_back(first)
    with pytest.raises(RuntimeError, match="not held"):
        slots.give_back(first)
