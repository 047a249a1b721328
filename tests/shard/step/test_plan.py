"""How the runner treats plans that break the protocol, and per-sequence failures."""

from __future__ import annotations

import pytest

from tests.shard.driving import Router
from tests.shard.models import VOCAB
from tgis.shard.errors import InvalidStepError
from tgis.shard.native.runtime.model_runner import ModelRunner
from tgis.shard.serving.step_executor import StepExecutor
from tgis.shard_api.channel import StepFailed
from tgis.shard_api.messages import (
    NewSequence,
    SamplingParams,
    ScheduledSequence,
    StepErrorCode,
    StepPlan,
)

PROMPT = (5, 6, 7, 8, 9)


def start(runner: ModelRunner) -> None:
    """Register request 1 and prefill it into block 0."""
    runner.step(StepPlan(1, (NewSequence(1, PROMPT),), (ScheduledSequence(1, len(PROMPT), (0,)),)))


@pytest.mark.parametrize(
    ("scheduled", "message"),
    [
        (ScheduledSequence(9, 1), "unknown request id 9"),
        (ScheduledSequence(1, 2), "num_tokens 2"),
        (ScheduledSequence(1, 0), "num_tokens 0"),
        (ScheduledSequence(1, 1, (10_000,)), "out of range"),
    ],
)
def test_invalid_scheduled_sequence_raises_and_changes_nothing(
    runner: ModelRunner, scheduled: ScheduledSequence, message: str
) -> None:
    start(runner)
    before = (list(runner.sequences[1].token_ids), runner.sequences[1].num_computed)
    new = NewSequence(2, PROMPT)
    with pytest.raises(InvalidStepError, match=message):
        runner.step(StepPlan(2, (new,), (scheduled, ScheduledSequence(2, 5, (1,)))))
    assert set(runner.sequences) == {1}  # request 2 was not registered
    assert (runner.sequences[1].token_ids, runner.sequences[1].num_computed) == before
    # The same sequence can still run afterwards.
    assert runner.step(StepPlan(3, (), (ScheduledSequence(1, 1),))).tokens


def test_missing_blocks_and_duplicates_are_rejected(runner: ModelRunner) -> None:
    with pytest.raises(InvalidStepError, match="cannot hold 17 tokens"):
        runner.step(
            StepPlan(1, (NewSequence(1, tuple(range(3, 20))),), (ScheduledSequence(1, 17, (0,)),))
        )
    start(runner)
    with pytest.raises(InvalidStepError, match="already known"):
        runner.step(StepPlan(2, (NewSequence(1, PROMPT),), ()))
    with pytest.raises(InvalidStepError, match="scheduled twice"):
        runner.step(StepPlan(2, (), (ScheduledSequence(1, 1), ScheduledSequence(1, 1))))


def test_bad_new_sequences_fail_alone(router: Router) -> None:
    router.add(1, PROMPT)
    router.add(2, (5, VOCAB + 3))
    router.add(3, PROMPT, sampling=SamplingParams(temperature=-1.0))
    router.add(4, ())
    out = router.step({1: 5, 2: 2, 3: 5})
    assert [t.request_id for t in out.tokens] == [1]
    errors = {e.request_id: e.message for e in out.errors}
    assert set(errors) == {2, 3, 4}
    assert "out of range" in errors[2] and "temperature" in errors[3] and "empty" in errors[4]
    assert set(router.runner.sequences) == {1}


def test_finished_sequences_are_forgotten_and_reset_forgets_all(router: Router) -> None:
    router.add(1, PROMPT)
    router.add(2, PROMPT)
    router.step({1: 5, 2: 5})
    router.finish(2)
    router.decode([1])
    assert set(router.runner.sequences) == {1}
    # Unknown finished ids are ignored; a step may schedule nothing.
    out = router.runner.step(StepPlan(99, finished_request_ids=(1234,)))
    assert out.step_id == 99 and not out.tokens
    router.runner.reset()
    assert not router.runner.sequences
    with pytest.raises(InvalidStepError):
        router.decode([1])


def test_announced_sequence_can_be_scheduled_later(runner: ModelRunner) -> None:
    runner.step(StepPlan(1, (NewSequence(7, PROMPT),), ()))
    out = runner.step(StepPlan(2, (), (ScheduledSequence(7, 5, (3,)),)))
    assert [t.request_id for t in out.tokens] == [7]
    assert runner.sequences[7].block_table == [3]


def test_a_sequence_that_failed_alone_is_skipped_until_it_is_finished(runner: ModelRunner) -> None:
    """The router may schedule it once more before it sees the error (overlap)."""
    start(runner)
    bad = NewSequence(2, (5, VOCAB + 3))
    out = runner.step(StepPlan(2, (bad,), (ScheduledSequence(1, 1), ScheduledSequence(2, 2, (1,)))))
    assert [e.request_id for e in out.errors] == [2]
    # Planned before the error was seen: skipped, the rest of the step runs.
    out = runner.step(StepPlan(3, (), (ScheduledSequence(1, 1), ScheduledSequence(2, 1))))
    assert [t.request_id for t in out.tokens] == [1] and not out.errors
    # Once the router has finished it, the id is unknown again.
    runner.step(StepPlan(4, (), (ScheduledSequence(1, 1),), finished_request_ids=(2,)))
    assert not runner.dropped
    with pytest.raises(InvalidStepError, match="unknown request id 2"):
        runner.step(StepPlan(5, (), (ScheduledSequence(2, 1),)))


def test_executor_refuses_a_step_planned_on_one_that_failed(runner: ModelRunner) -> None:
    executor = StepExecutor(runner)
    executor.step(StepPlan(1, (NewSequence(1, PROMPT),), (ScheduledSequence(1, 5, (0,)),)))
    executor.step(StepPlan(2, (), (ScheduledSequence(1, 1),), base_step_id=1))
    with pytest.raises(StepFailed) as invalid:
        executor.step(StepPlan(3, (), (ScheduledSequence(7, 1),), base_step_id=2))
    assert invalid.value.code is StepErrorCode.INVALID_PLAN
    before = list(runner.sequences[1].token_ids)
    # Sent on top of step 3 before it failed: refused, and nothing changes (not even this).
    stale = StepPlan(4, (), (ScheduledSequence(1, 1),), finished_request_ids=(1,), base_step_id=3)
    with pytest.raises(StepFailed) as refused:
        executor.step(stale)
    assert refused.value.code is StepErrorCode.STALE_BASE
    assert runner.sequences[1].token_ids == before
    # Planned on nothing in flight (base 0), or on the last step that completed: runs.
    assert executor.step(StepPlan(5, (), (ScheduledSequence(1, 1),))).tokens
    assert executor.step(StepPlan(6, (), (ScheduledSequence(1, 1),), base_step_id=5)).tokens
    executor.reset()
    with pytest.raises(StepFailed):
        executor.step(StepPlan(7, base_step_id=6))
