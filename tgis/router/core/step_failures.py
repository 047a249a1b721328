"""What the scheduler does when the shard did not run a step (``Scheduler``'s part
``StepFailures``): undo what planning it assumed, fail its requests, or, out of memory,
preempt the younger half of its sequences and retry the rest."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tgis.router.core.request_state import RequestState, RequestStatus
from tgis.router.core.steps import ScheduledStep, StepUpdate
from tgis.router.errors import generation_failure

if TYPE_CHECKING:
    from tgis.router.core.batching import SchedulerLimits
    from tgis.router.core.speculation import Speculation

__all__ = ["StepFailures"]


class StepFailures:
    """``Scheduler``'s methods for a step that failed (the attributes are the scheduler's)."""

    speculation: Speculation | None
    limits: SchedulerLimits
    running: list[RequestState]
    hold_admissions: bool
    _finished_ids: list[int]
    _preempted_ids: list[int]

    def fail(self, state: RequestState, error: Exception, update: StepUpdate) -> None:
        """``Scheduler.fail``."""
        raise NotImplementedError

    def preempt(self, state: RequestState) -> None:
        """``Scheduler.preempt``."""
        raise NotImplementedError

    def step_failed(self, step: ScheduledStep) -> None:
        """Undo what a step the shard did not run assumed: new sequences were not
        registered, block tables did not grow, no token was computed or sampled; what it was
        to forget or preempt is sent again (both are idempotent on the shard). Undo the
        later of two unanswered steps first."""
        plan = step.plan
        if step.drafted and self.speculation is not None:
            self.speculation.in_flight = False
        announced = {ns.request_id for ns in plan.new_sequences}
        for chunk in plan.scheduled:
            state = step.states[chunk.request_id]
            if state.request_id in step.samples:
                state.pending_tokens -= 1
            if state.status is RequestStatus.FINISHED:
                continue
            if state.request_id in announced:
                state.known_to_shard = False
            if state.status is RequestStatus.WAITING:
                continue  # preempted by a later step: it starts over anyway
            state.num_computed -= chunk.num_tokens - len(chunk.draft_token_ids)
            state.blocks_sent -= len(chunk.new_block_ids)
        self._finished_ids[:0] = [
            r for r in plan.finished_request_ids if r not in self._finished_ids
        ]
        self._preempted_ids[:0] = [
            rid for rid in plan.preempted_request_ids if rid not in self._preempted_ids
        ]

    def fail_step(self, step: ScheduledStep, message: str) -> StepUpdate:
        """Every request of a failed step fails (TGIS); the shard forgets them next step."""
        update = StepUpdate()
        for state in step.states.values():
            self.fail(state, generation_failure(message), update)
        return update

    def retry_without_younger_half(self, step: ScheduledStep) -> int:
        """Out of memory: preempt the younger half of the step's sequences and retry the rest
        at the next step with admissions held. Returns how many were preempted; 0 (nothing
        done) when this was already the retry, a single sequence, or preemption is off."""
        if self.hold_admissions or not self.limits.preemption:
            return 0
        states = sorted(
            (s for s in step.states.values() if s.status is RequestStatus.RUNNING),
            key=lambda s: s.request_id,
        )
        if len(states) < 2:
            return 0
        # The younger half, and whatever a later (undone) step admitted after it: the running
        # batch stays a prefix of the arrival order.
        cut = states[len(states) // 2].request_id
        younger = [s for s in self.running if s.request_id >= cut]
        for state in reversed(younger):  # youngest first: the queue stays in arrival order
            self.preempt(state)
        self.hold_admissions = True
        return len(younger)
