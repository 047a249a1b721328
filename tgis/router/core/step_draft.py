"""The step the scheduler is building: its remaining prefill budget and what it holds so
far (``scheduler.py: Scheduler.schedule`` turns it into a ``ScheduledStep``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from tgis.router.core.block_pool import BlockPool
from tgis.router.core.request_state import RequestState
from tgis.shard_api.messages import NewSequence, ScheduledSequence

__all__ = ["StepDraft"]


@dataclass(slots=True)
class StepDraft:
    """Chunks of requests added in step order; each request's counters advance as if the
    step had run (``Scheduler.step_failed`` undoes them when it does not)."""

    budget: int
    caching: bool = False
    """The prefix cache is on: new sequences carry their prefix and adapter versions, and
    the blocks a step fills are registered once it succeeded (``computed_after``)."""
    windowed: bool = False
    """The model slides a window over every layer: every request's ``computed_after`` is
    kept (the blocks behind the window go once the step succeeded)."""
    prompt_tokens: int = 0
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    new_sequences: list[NewSequence] = field(default_factory=list)
    states: dict[int, RequestState] = field(default_factory=dict)
    samples: set[int] = field(default_factory=set)
    computed_after: dict[int, int] = field(default_factory=dict)
    """Positions computed after the step, of the requests whose chunk fills a block (of
    every request when ``windowed``)."""
    cache_queried: int = 0
    cache_hits: int = 0
    drafted: dict[int, int] = field(default_factory=dict)

    def add(
        self,
        blocks: BlockPool,
        state: RequestState,
        num_tokens: int,
        *,
        prompt: bool,
        drafts: tuple[int, ...] = (),
        spec_tokens: int = 0,
    ) -> None:
        """Schedule ``num_tokens`` of ``state`` (prompt ones from the budget), growing its
        blocks from ``blocks``; ``drafts`` (a decode with speculative tokens after it) are
        the last of them, counted as computed only once confirmed; ``spec_tokens``: drafts
        the shard's draft model adds after them (blocks reserved, not counted)."""
        if prompt:
            self.budget -= num_tokens
            self.prompt_tokens += num_tokens
        if not state.known_to_shard:
            new = state.request.new_sequence(state.request_id, versioned=self.caching)
            self.new_sequences.append(new)
            state.known_to_shard = True
        # Its first chunk since admission after a prefix-cache hit: the shard is told.
        cached = state.num_computed if state.blocks_sent == 0 else 0
        blocks.grow(state.block_ids, state.num_computed + num_tokens + spec_tokens)
        new_blocks = tuple(state.block_ids[state.blocks_sent :])
        state.blocks_sent = len(state.block_ids)
        before = state.num_computed
        state.num_computed += num_tokens - len(drafts)
        size = blocks.block_size
        if self.windowed or (self.caching and before // size < state.num_computed // size):
            self.computed_after[state.request_id] = state.num_computed
        if state.num_computed == state.known_length:
            state.pending_tokens += 1
            self.samples.add(state.request_id)
        self.scheduled.append(
            ScheduledSequence(
                state.request_id,
                num_tokens,
                new_blocks,
                cached,
                drafts,
                spec_tokens,
                state.state_slot,
            )
        )
        if drafts or spec_tokens:
            self.drafted[state.request_id] = len(drafts) or spec_tokens
        self.states[state.request_id] = state
