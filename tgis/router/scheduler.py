"""Continuous batching: which sequences run in the next step, and with which KV blocks.

Policy (ARCHITECTURE.md, "Scheduling", has the why):

* **Order.** Every request has a place in one global order, its arrival (its request id).
  The running batch is always a prefix of that order and the waiting queue the rest: new
  requests join at the back, admission takes from the front only (no skipping), and a
  preempted request goes back to the *front*. So nothing ever overtakes an older request.
* **A step** (`schedule`) gives, oldest first, every running sequence its work: one decode
  token, or the next chunk of its prompt (or of a recompute after a preemption). Prompt
  and recompute tokens share the per-step budget `max_batch_prefill_tokens`; decode tokens
  are not counted against it, so long prompts are chunked alongside the decodes and never
  stall them. Then, while the budget, `max_batch_size` and the KV blocks allow, it admits
  requests from the front of the queue (the last one admitted may get a partial chunk).
* **KV blocks** are accounted by tokens, never by request count or padding. Admission
  allocates the blocks for every token the request knows (its prompt, plus what it had
  generated if it was preempted) and requires `headroom` more blocks to stay free while
  other sequences run (none when the batch is empty: one request of `max_sequence_length`
  always fits). Afterwards a decode takes one more block each `block_size` tokens. When a
  decode needs a block and none is free, the most recently admitted running sequences are
  **preempted**, youngest first, until it fits (possibly the needy sequence itself, when it
  is the youngest): their blocks are freed at once, they go back to the front of the queue
  and the shard keeps their tokens and sampler (`StepPlan.preempted_ids`). Resumed, they
  recompute every known token into new blocks (a prefill that samples nothing until it has
  caught up) and continue with the very tokens they would have produced. A step that
  preempted admits nothing. So a running batch never fails for lack of KV space.
* **Joining a running batch** (TGI's rule): a fresh request joins a non-empty batch when at
  least `floor(running × waiting_served_ratio)` fresh requests can be admitted together, or
  when `max_waiting_tokens` steps have run since fresh requests were last admitted
  (`--max-waiting-tokens 0`: always at the next step). Resumed (preempted) requests are
  not held back by this rule.
* **No starvation.** The oldest running sequence is never preempted by a younger one, so
  it always advances and finishes (max_new_tokens bounds it); the head of the queue is
  admitted at the latest when the batch empties, and nothing behind it can be admitted
  first.
* **Encoder-decoder engines** cannot recompute generated tokens, so with `preemption=False`
  admission allocates a request's worst case (prompt + max_new_tokens) up front instead, and
  a running sequence never needs another block.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from dataclasses import dataclass

from tgis.router.block_allocator import BlockAllocator, blocks_for
from tgis.router.request_state import RequestState, RequestStatus
from tgis.router.step import DetailOptions, NewSequence, ScheduledChunk, ShardInfo, StepPlan


@dataclass(frozen=True, slots=True)
class SchedulerLimits:
    max_batch_size: int
    """Most sequences in the running batch."""
    max_batch_prefill_tokens: int
    """Most prompt (or recompute) tokens computed in one step; decode tokens come on top."""
    max_batch_total_tokens: int | None = None
    """KV tokens the running batch may hold; None: the shard's whole cache."""
    max_waiting_tokens: int = 0
    """Steps after which waiting requests join regardless of the ratio (0: at once)."""
    waiting_served_ratio: float = 0.0
    """Fresh requests join a running batch of n when at least floor(n × ratio) can."""
    preemption: bool = True
    """False: reserve each request's worst case at admission (no preemption needed)."""


def kv_capacity_blocks(limits: SchedulerLimits, info: ShardInfo) -> int:
    """KV blocks the router allocates: the shard's, capped by max_batch_total_tokens
    (rounded up to whole blocks, so a total of max_sequence_length holds one request)."""
    if limits.max_batch_total_tokens is None:
        return info.num_blocks
    return min(info.num_blocks, blocks_for(limits.max_batch_total_tokens, info.block_size))


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
        # Blocks kept free when admitting next to running sequences (vLLM keeps 1 %).
        self.headroom = max(1, allocator.num_blocks // 100) if limits.preemption else 0
        self.hold_admissions = False
        """Set by the engine after an out-of-memory step it retries with fewer sequences."""
        self.preemption_count = 0
        """Preemptions so far (for metrics)."""
        self.budget_holds = 0
        """Steps that left the queue's head waiting only because the prefill budget ran out."""
        self._finished_ids: list[int] = []
        self._preempted_ids: list[int] = []
        self._steps_since_admission = 0
        self._step_ids = itertools.count(1)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._finished_ids or self._preempted_ids)

    def add(self, state: RequestState) -> None:
        self.waiting.append(state)

    def finish(self, state: RequestState) -> None:
        """Drop a request, running or queued: its blocks are free at once, and the shard
        forgets it at the next step."""
        if state.status is RequestStatus.RUNNING:
            self.running.remove(state)
        elif state.status is RequestStatus.WAITING:
            self.waiting.remove(state)
        self.allocator.release(state.block_ids)
        state.blocks_sent = 0
        state.status = RequestStatus.FINISHED
        if state.request_id in self._preempted_ids:
            self._preempted_ids.remove(state.request_id)
        if state.known_to_shard:
            self._finished_ids.append(state.request_id)

    def preempt(self, state: RequestState) -> None:
        """Take a running request out of the batch, free its blocks and queue it at the
        front; it is recomputed when it is admitted again. Preempt youngest first, so the
        queue stays in arrival order."""
        self.running.remove(state)
        self.allocator.release(state.block_ids)
        state.blocks_sent = 0
        state.num_computed = 0
        state.status = RequestStatus.WAITING
        state.preemptions += 1
        self.preemption_count += 1
        if state.known_to_shard and state.request_id not in self._preempted_ids:
            self._preempted_ids.append(state.request_id)
        self.waiting.appendleft(state)

    def step_failed(self, plan: StepPlan) -> None:
        """Undo what a failed step assumed the shard did: new sequences were not registered,
        block tables did not grow; what it was to forget or preempt is sent again (both are
        idempotent on the shard)."""
        announced = {ns.request_id for ns in plan.new_sequences}
        chunks = {c.request_id: c for c in plan.scheduled}
        for state in self.running:
            if state.request_id in announced:
                state.known_to_shard = False
            chunk = chunks.get(state.request_id)
            if chunk is not None:
                state.blocks_sent -= len(chunk.new_block_ids)
        self._finished_ids[:0] = [r for r in plan.finished_ids if r not in self._finished_ids]
        self._preempted_ids[:0] = [
            rid for rid in plan.preempted_ids if rid not in self._preempted_ids
        ]

    def schedule(self, now: float) -> StepPlan:
        """Build the next step; allocates blocks, preempts and admits as the policy says."""
        budget = self.limits.max_batch_prefill_tokens
        scheduled: list[ScheduledChunk] = []
        new_sequences: list[NewSequence] = []
        preempted = False
        i = 0
        while i < len(self.running):
            state = self.running[i]
            if state.uncomputed == 0:  # waiting for a token the shard owes (never expected)
                i += 1
                continue
            if state.prefilling:
                if budget > 0:
                    num = min(state.uncomputed, budget)
                    budget -= num
                    scheduled.append(self._chunk(state, num, new_sequences))
                i += 1
                continue
            while self.allocator.missing(state.block_ids, state.num_computed + 1) > (
                self.allocator.num_free
            ):
                victim = self.running[-1]
                self.preempt(victim)
                preempted = True
                if victim is state:
                    break
            if state.status is not RequestStatus.RUNNING:
                break  # it preempted itself: it was the youngest
            scheduled.append(self._chunk(state, 1, new_sequences))
            i += 1
        self._steps_since_admission += 1
        if not preempted and not (self.hold_admissions and self.running):
            for state in self._admissions(budget):
                self.waiting.popleft()
                state.block_ids = self.allocator.allocate(self._admission_blocks(state))
                state.status = RequestStatus.RUNNING
                if state.started_at is None:
                    state.started_at = now
                self.running.append(state)
                num = min(state.uncomputed, budget)
                budget -= num
                scheduled.append(self._chunk(state, num, new_sequences))
        finished, self._finished_ids = tuple(self._finished_ids), []
        preempted_ids, self._preempted_ids = tuple(self._preempted_ids), []
        return StepPlan(
            step_id=next(self._step_ids),
            new_sequences=tuple(new_sequences),
            scheduled=tuple(scheduled),
            finished_ids=finished,
            preempted_ids=preempted_ids,
        )

    def _admission_blocks(self, state: RequestState) -> int:
        if self.limits.preemption:
            return self.allocator.blocks_for(state.known_length)
        return self.allocator.blocks_for(state.worst_case_length)

    def _admissions(self, budget: int) -> list[RequestState]:
        """The requests to admit this step, from the front of the queue."""
        slots = self.limits.max_batch_size - len(self.running)
        chosen: list[RequestState] = []
        blocks = 0
        for state in self.waiting:
            if len(chosen) >= slots:
                break
            if budget <= 0:
                self.budget_holds += 1
                break
            need = self._admission_blocks(state)
            headroom = self.headroom if self.running or chosen else 0
            if blocks + need + headroom > self.allocator.num_free:
                break
            chosen.append(state)
            blocks += need
            budget -= min(state.uncomputed, budget)
        # Resumed requests are older than every fresh one, so they lead the queue.
        resumed = list(itertools.takewhile(lambda s: s.preemptions > 0, chosen))
        fresh = len(chosen) - len(resumed)
        if fresh and self.running and not self._may_join(fresh):
            return resumed
        if fresh:
            self._steps_since_admission = 0
        return chosen

    def _may_join(self, count: int) -> bool:
        """TGI's rule for fresh requests joining a running batch."""
        if self._steps_since_admission >= self.limits.max_waiting_tokens:
            return True
        return count >= math.floor(len(self.running) * self.limits.waiting_served_ratio)

    def _chunk(
        self, state: RequestState, num_tokens: int, new_sequences: list[NewSequence]
    ) -> ScheduledChunk:
        if not state.known_to_shard:
            new_sequences.append(_new_sequence(state))
            state.known_to_shard = True
        self.allocator.grow(state.block_ids, state.num_computed + num_tokens)
        new_blocks = tuple(state.block_ids[state.blocks_sent :])
        state.blocks_sent = len(state.block_ids)
        return ScheduledChunk(state.request_id, num_tokens, new_blocks)
