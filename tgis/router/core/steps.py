"""What the engine keeps about a step while it runs, and what applying its outcome
produced (the scheduler builds both; the engine emits the second)."""

from __future__ import annotations

from dataclasses import dataclass, field

from tgis.router.core.request_state import Event, RequestState
from tgis.shard_api.messages import StepPlan

__all__ = ["ScheduledStep", "StepUpdate"]


@dataclass(frozen=True, slots=True)
class ScheduledStep:
    """A plan and what the router must remember about it until its output is back."""

    plan: StepPlan
    states: dict[int, RequestState]
    """The request of every scheduled sequence, by id."""
    samples: frozenset[int]
    """Request ids whose chunk completes every known token: the shard samples for them."""
    computed_after: dict[int, int]
    """Each scheduled request's computed positions once the step has run."""
    prompt_tokens: int
    """Prompt or recompute tokens (the rest are decodes)."""
    cache_queried: int = 0
    """Known tokens of the requests admitted that looked up the prefix cache."""
    cache_hits: int = 0
    """Of those, the tokens found cached (not computed)."""
    admitted: tuple[RequestState, ...] = ()
    """Fresh requests admitted by this step (not resumed ones)."""
    joined_running_batch: bool = False
    """Fresh requests joined sequences that were already running."""
    preemptions: int = 0
    budget_hold: bool = False
    """The head of the queue waited only because the prefill budget ran out."""
    drafted: dict[int, int] = field(default_factory=dict)
    """Speculative decoding: the drafted tokens of each sequence that has some."""


@dataclass(slots=True)
class StepUpdate:
    """What applying outputs or dropping requests produced, for the engine to emit."""

    events: list[tuple[RequestState, Event]] = field(default_factory=list)
    time_to_first_token: list[float] = field(default_factory=list)
    inter_token: list[float] = field(default_factory=list)
    tokens: int = 0
    """Generated tokens accepted (tokens for requests that had already ended excluded)."""
    cancelled: int = 0
    timed_out_in_queue: int = 0
    speculative_steps: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    """Speculative decoding: steps with drafts, tokens drafted, drafts confirmed."""
