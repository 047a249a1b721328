"""Continuous batching: which sequences run in the next step, and with which KV blocks.

Each step decodes one token for every running sequence whose prompt is complete,
continues chunked prefills, and admits waiting requests (first come, first served)
while the batch has room, the step has token budget and the KV cache has blocks to
reserve. New requests therefore join the running batch at the very next step.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass

from tgis.router.block_allocator import BlockAllocator
from tgis.router.request_state import RequestState, RequestStatus
from tgis.router.step import DetailOptions, NewSequence, ScheduledChunk, StepPlan


@dataclass(frozen=True, slots=True)
class SchedulerLimits:
    max_batch_size: int
    max_batch_tokens: int


def _new_sequence(state: RequestState) -> NewSequence:
    req = state.request
    resp = req.params.response
    return NewSequence(
        request_id=state.request_id,
        prompt_token_ids=req.input_ids,
        sampling=req.sampling,
        min_new_tokens=req.stopping.min_new_tokens,
        details=DetailOptions(
            logprobs=resp.token_logprobs,
            ranks=resp.token_ranks,
            top_n=resp.top_n_tokens,
            input_tokens=resp.input_tokens,
            generated_tokens=resp.generated_tokens,
        ),
    )


class Scheduler:
    """Owns the waiting queue, the running list and the block allocator."""

    def __init__(self, allocator: BlockAllocator, limits: SchedulerLimits) -> None:
        self.allocator = allocator
        self.limits = limits
        self.waiting: deque[RequestState] = deque()
        self.running: list[RequestState] = []
        self._finished_ids: list[int] = []
        self._step_ids = itertools.count(1)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._finished_ids)

    def add(self, state: RequestState) -> None:
        self.waiting.append(state)

    def remove_waiting(self, state: RequestState) -> None:
        self.waiting.remove(state)

    def finish(self, state: RequestState) -> None:
        """Drop a running request; the shard forgets it at the next step."""
        self.running.remove(state)
        self.allocator.release(state.block_ids, state.reserved_blocks)
        state.reserved_blocks = 0
        state.status = RequestStatus.FINISHED
        if state.known_to_shard:
            self._finished_ids.append(state.request_id)

    def schedule(self, now: float) -> StepPlan:
        """Build the next step; mutates block tables and admits waiting requests."""
        budget = self.limits.max_batch_tokens
        scheduled: list[ScheduledChunk] = []
        for state in self.running:
            if budget == 0:
                break
            num = min(state.uncomputed, budget) if state.in_prompt else 1
            scheduled.append(self._chunk(state, num))
            budget -= num
        new_sequences: list[NewSequence] = []
        while self.waiting and budget > 0 and len(self.running) < self.limits.max_batch_size:
            state = self.waiting[0]
            if not self.allocator.can_reserve(state.worst_case_length):
                break
            self.waiting.popleft()
            state.reserved_blocks = self.allocator.reserve(state.worst_case_length)
            state.status = RequestStatus.RUNNING
            state.started_at = now
            state.known_to_shard = True
            self.running.append(state)
            new_sequences.append(_new_sequence(state))
            num = min(state.uncomputed, budget)
            scheduled.append(self._chunk(state, num))
            budget -= num
        finished, self._finished_ids = tuple(self._finished_ids), []
        return StepPlan(
            step_id=next(self._step_ids),
            new_sequences=tuple(new_sequences),
            scheduled=tuple(scheduled),
            finished_ids=finished,
        )

    def _chunk(self, state: RequestState, num_tokens: int) -> ScheduledChunk:
        new_blocks = self.allocator.grow(state.block_ids, state.num_computed + num_tokens)
        return ScheduledChunk(state.request_id, num_tokens, new_blocks)
