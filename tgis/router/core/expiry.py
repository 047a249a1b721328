"""Requests that leave before their turn: cancelled ones (queued or running) and queued
ones past their deadline (``StoppingParams.deadline``, TGIS's time limit)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tgis.router.core.request_state import TokenEvent
from tgis.router.core.steps import StepUpdate
from tgis.router.core.stopping import StopDecision
from tgis.router.request_types import StopReason

if TYPE_CHECKING:
    from tgis.router.core.scheduler import Scheduler

__all__ = ["drop_aborted_and_expired"]


def drop_aborted_and_expired(scheduler: Scheduler, now: float) -> StepUpdate:
    """Cancelled requests (queued or running) and queued ones past their deadline leave
    now: their blocks are free at once and the shard forgets them in the next step."""
    update = StepUpdate()
    waiting, running = scheduler.waiting, scheduler.running
    for state in [s for s in waiting if s.aborted] + [s for s in running if s.aborted]:
        update.cancelled += 1
        scheduler.finish(state, StopReason.CANCELLED)
    for state in [s for s in scheduler.waiting if s.request.stopping.deadline is not None]:
        deadline = state.request.stopping.deadline
        if deadline is None or now <= deadline:
            continue
        if state.generated_ids:
            # Preempted after generating: it ends as a running request would.
            event = state.final_event(StopDecision(StopReason.TIME_LIMIT))
        else:
            update.timed_out_in_queue += 1
            event = TokenEvent("", 0, (), StopReason.TIME_LIMIT)
        update.events.append((state, event))
        scheduler.finish(state, StopReason.TIME_LIMIT)
    return update
