"""Continuous batching: which sequences run in the next step, with which KV blocks, and what
each step's output does to the requests.

The engine drives it with four calls: ``schedule`` (build the next step), ``update`` (apply
a step's output: tokens, detokenization, stops), ``step_failed`` (undo a step the shard did
not run) and ``drop_aborted_and_expired``. The scheduler owns the waiting queue, the running
list, the block allocator and every counter and flag of the policy; requests' own counters
live on their ``RequestState``.

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
* **Overlap.** The engine sends step n+1 before step n's output is back. So the schedule
  counts the token each sampling chunk of an unanswered step will produce
  (`RequestState.pending_tokens`) as known: the next step computes it (the shard has it),
  and no step is planned past `max_new_tokens`. A request that stops at step n (EOS, stop
  sequence, time limit) has had one more token computed at n+1; the router drops it, and
  the shard forgets the request at n+2.
* **KV blocks** are accounted by tokens, never by request count or padding. A prompt
  prefix's virtual tokens are prompt tokens like the others (``RequestState.prompt_length``):
  computed in chunks, held in blocks, recomputed after a preemption. Admission
  allocates the blocks for every token the request knows (its prompt, plus what it had
  generated if it was preempted) and requires `headroom` more blocks to stay free while
  other sequences run (none when the batch is empty: one request of `max_sequence_length`
  always fits). Afterwards a decode takes one more block each `block_size` tokens. When a
  decode needs a block and none is free, the most recently admitted running sequences are
  **preempted**, youngest first, until it fits (possibly the needy sequence itself, when it
  is the youngest): their blocks are freed at once, they go back to the front of the queue
  and the shard keeps their tokens and sampler (`StepPlan.preempted_request_ids`). Resumed,
  they recompute every known token into new blocks (a prefill that samples nothing until it
  has caught up) and continue with the very tokens they would have produced. A step that
  preempted admits nothing. So a running batch never fails for lack of KV space. Blocks
  freed while a step that writes them is still running are safe to reuse: the shard runs
  steps in order.
* **LoRA adapters.** The shard can apply at most `max_loras` different LoRA adapters in
  one step, so the running batch never holds more than `max_loras` distinct LoRA adapter
  ids. A request whose LoRA adapter is not among those running when every slot is taken
  is not admitted, and like any other admission limit it holds the queue behind it (no
  skipping) until a running request with another adapter leaves; requests without a LoRA
  adapter (plain ones, prompt-tuning adapters) take no slot. A resumed (preempted)
  request is checked the same way.
* **Joining a running batch** (TGI's rule): a fresh request joins a non-empty batch when at
  least `floor(running × waiting_served_ratio)` fresh requests can be admitted together, or
  when `max_waiting_tokens` steps have run since fresh requests were last admitted
  (`max_waiting_tokens = 0`: always at the next step). Resumed (preempted) requests are
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
from dataclasses import dataclass, field

from tgis.router.core.block_allocator import BlockAllocator
from tgis.router.core.request_state import (
    Event,
    InputTokensEvent,
    RequestState,
    RequestStatus,
    TokenEvent,
)
from tgis.router.core.stopping import StopDecision
from tgis.router.errors import GenerationError
from tgis.router.request_types import StopReason
from tgis.shard_api.messages import (
    NewSequence,
    ScheduledSequence,
    StepOutput,
    StepPlan,
)


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
    max_loras: int | None = None
    """Most different LoRA adapters in the running batch (the shard's ``max_loras``); None:
    no limit."""


@dataclass(frozen=True, slots=True)
class ScheduledStep:
    """A plan and what the router must remember about it until its output is back."""

    plan: StepPlan
    states: dict[int, RequestState]
    """The request of every scheduled sequence, by id."""
    samples: frozenset[int]
    """Request ids whose chunk completes every known token: the shard samples for them."""
    prompt_tokens: int
    """Prompt or recompute tokens (the rest are decodes)."""
    admitted: tuple[RequestState, ...] = ()
    """Fresh requests admitted by this step (not resumed ones)."""
    joined_running_batch: bool = False
    """Fresh requests joined sequences that were already running."""
    preemptions: int = 0
    budget_hold: bool = False
    """The head of the queue waited only because the prefill budget ran out."""


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
        """Set after an out-of-memory step that is retried with fewer sequences."""
        self.preemption_count = 0
        """Preemptions so far."""
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

    # ---- request end --------------------------------------------------------------------

    def finish(self, state: RequestState, reason: StopReason = StopReason.CANCELLED) -> None:
        """Drop a request, running or queued: its blocks are free at once, and the shard
        forgets it at the next step."""
        if state.status is RequestStatus.RUNNING:
            self.running.remove(state)
        elif state.status is RequestStatus.WAITING:
            self.waiting.remove(state)
        else:
            return
        self.allocator.release(state.block_ids)
        state.blocks_sent = 0
        state.status = RequestStatus.FINISHED
        state.finish_reason = reason
        if state.request_id in self._preempted_ids:
            self._preempted_ids.remove(state.request_id)
        if state.known_to_shard:
            self._finished_ids.append(state.request_id)

    def fail(self, state: RequestState, error: Exception, update: StepUpdate) -> None:
        """End a live request with ``error`` (its client gets it as the final event)."""
        if state.status is RequestStatus.FINISHED:
            return
        self.finish(state, StopReason.ERROR)
        update.events.append((state, error))

    def drop_aborted_and_expired(self, now: float) -> StepUpdate:
        """Cancelled requests (queued or running) and queued ones past their deadline leave
        now: their blocks are free at once and the shard forgets them in the next step."""
        update = StepUpdate()
        for state in [s for s in self.waiting if s.aborted] + [
            s for s in self.running if s.aborted
        ]:
            update.cancelled += 1
            self.finish(state, StopReason.CANCELLED)
        for state in [s for s in self.waiting if s.request.stopping.deadline is not None]:
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
            self.finish(state, StopReason.TIME_LIMIT)
        return update

    def unservable_head(self) -> RequestState | None:
        """The head of the queue when nothing runs and it still cannot be admitted (start-up
        checks one max_sequence_length request fits, so this should never happen)."""
        if self.running or not self.waiting:
            return None
        head = self.waiting[0]
        if head.generation_scheduled:  # waiting for its last token, not for blocks
            return None
        return head

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

    # ---- a step's output -------------------------------------------------------------------

    def update(self, step: ScheduledStep, output: StepOutput, now: float) -> StepUpdate:
        """Apply a step's output: per-sequence errors, input-token details, then one token per
        sampling sequence (detokenized, checked against its stopping criteria; finished
        requests leave at once). Tokens of requests that already ended are dropped."""
        update = StepUpdate()
        states = step.states
        for rid in step.samples:
            states[rid].pending_tokens -= 1
        for error in output.errors:
            state = states.get(error.request_id)
            if state is not None:
                self.fail(state, GenerationError(error.message), update)
        for details in output.input_tokens:
            state = states[details.request_id]
            if state.status is not RequestStatus.FINISHED:
                update.events.append((state, InputTokensEvent(details.tokens)))
        events = update.events
        for sampled in output.tokens:
            state = states[sampled.request_id]
            if state.status is RequestStatus.FINISHED:
                continue
            if state.last_token_at is None:
                update.time_to_first_token.append(now - state.arrival)
            else:
                update.inter_token.append(now - state.last_token_at)
            update.tokens += 1
            event, done = state.accept_token(sampled.token, now)
            if event is not None:
                events.append((state, event))
            if done:
                assert event is not None
                self.finish(state, event.stop_reason)
        return update

    def step_failed(self, step: ScheduledStep) -> None:
        """Undo what a step the shard did not run assumed: new sequences were not
        registered, block tables did not grow, no token was computed or sampled; what it was
        to forget or preempt is sent again (both are idempotent on the shard). Undo the
        later of two unanswered steps first."""
        plan = step.plan
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
            state.num_computed -= chunk.num_tokens
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
            self.fail(state, GenerationError(message), update)
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

    # ---- the next step ------------------------------------------------------------------------

    def schedule(self, now: float, base_step_id: int = 0) -> ScheduledStep:
        """Build the next step; allocates blocks, preempts and admits as the policy says.

        ``base_step_id`` is the step still running that this one is planned on (0: none).
        """
        budget = self.limits.max_batch_prefill_tokens
        scheduled: list[ScheduledSequence] = []
        new_sequences: list[NewSequence] = []
        states: dict[int, RequestState] = {}
        samples: set[int] = set()
        prompt_tokens = 0
        preemptions = self.preemption_count
        i = 0
        while i < len(self.running):
            state = self.running[i]
            if state.uncomputed == 0 or state.generation_scheduled:
                i += 1  # nothing to compute, or only waiting for its last token
                continue
            if state.prefilling:
                if budget > 0:
                    num = min(state.uncomputed, budget)
                    budget -= num
                    prompt_tokens += num
                    scheduled.append(self._chunk(state, num, new_sequences, samples))
                    states[state.request_id] = state
                i += 1
                continue
            while self.allocator.missing(state.block_ids, state.num_computed + 1) > (
                self.allocator.num_free
            ):
                victim = self.running[-1]
                self.preempt(victim)
                if victim is state:
                    break
            if state.status is not RequestStatus.RUNNING:
                break  # it preempted itself: it was the youngest
            scheduled.append(self._chunk(state, 1, new_sequences, samples))
            states[state.request_id] = state
            i += 1
        preemptions = self.preemption_count - preemptions
        self._steps_since_admission += 1
        admitted: list[RequestState] = []
        budget_hold = False
        already_running = bool(self.running)
        if not preemptions and not (self.hold_admissions and self.running):
            chosen, budget_hold = self._admissions(budget)
            for state in chosen:
                self.waiting.popleft()
                state.block_ids = self.allocator.allocate(self._admission_blocks(state))
                state.status = RequestStatus.RUNNING
                if state.started_at is None:
                    state.started_at = now
                if state.preemptions == 0:
                    admitted.append(state)
                self.running.append(state)
                num = min(state.uncomputed, budget)
                budget -= num
                prompt_tokens += num
                scheduled.append(self._chunk(state, num, new_sequences, samples))
                states[state.request_id] = state
        if budget_hold:
            self.budget_holds += 1
        finished, self._finished_ids = tuple(self._finished_ids), []
        preempted_ids, self._preempted_ids = tuple(self._preempted_ids), []
        plan = StepPlan(
            step_id=next(self._step_ids),
            new_sequences=tuple(new_sequences),
            scheduled=tuple(scheduled),
            finished_request_ids=finished,
            preempted_request_ids=preempted_ids,
            base_step_id=base_step_id,
        )
        return ScheduledStep(
            plan=plan,
            states=states,
            samples=frozenset(samples),
            prompt_tokens=prompt_tokens,
            admitted=tuple(admitted),
            joined_running_batch=bool(admitted) and already_running,
            preemptions=preemptions,
            budget_hold=budget_hold,
        )

    def _admission_blocks(self, state: RequestState) -> int:
        if self.limits.preemption:
            return self.allocator.blocks_for(state.known_length)
        return self.allocator.blocks_for(state.worst_case_length)

    def _admissions(self, budget: int) -> tuple[list[RequestState], bool]:
        """The requests to admit this step, from the front of the queue, and whether the
        head was held back by the prefill budget alone."""
        slots = self.limits.max_batch_size - len(self.running)
        max_loras = self.limits.max_loras
        loras = self._running_loras() if max_loras is not None and self.waiting else set()
        chosen: list[RequestState] = []
        blocks = 0
        budget_hold = False
        for state in self.waiting:
            if len(chosen) >= slots or state.generation_scheduled:
                break
            if budget <= 0:
                budget_hold = True
                break
            lora = state.request.lora_id
            if max_loras is not None and lora and lora not in loras and len(loras) >= max_loras:
                break
            need = self._admission_blocks(state)
            headroom = self.headroom if self.running or chosen else 0
            if blocks + need + headroom > self.allocator.num_free:
                break
            if lora:
                loras.add(lora)
            chosen.append(state)
            blocks += need
            budget -= min(state.uncomputed, budget)
        # Resumed requests are older than every fresh one, so they lead the queue.
        resumed = list(itertools.takewhile(lambda s: s.preemptions > 0, chosen))
        fresh = len(chosen) - len(resumed)
        if fresh and self.running and not self._may_join(fresh):
            return resumed, budget_hold
        if fresh:
            self._steps_since_admission = 0
        return chosen, budget_hold

    def _running_loras(self) -> set[str]:
        """The distinct LoRA adapters of the running batch."""
        return {s.request.lora_id for s in self.running if s.request.lora_id}

    def _may_join(self, count: int) -> bool:
        """TGI's rule for fresh requests joining a running batch."""
        if self._steps_since_admission >= self.limits.max_waiting_tokens:
            return True
        return count >= math.floor(len(self.running) * self.limits.waiting_served_ratio)

    def _chunk(
        self,
        state: RequestState,
        num_tokens: int,
        new_sequences: list[NewSequence],
        samples: set[int],
    ) -> ScheduledSequence:
        if not state.known_to_shard:
            new_sequences.append(state.request.new_sequence(state.request_id))
            state.known_to_shard = True
        self.allocator.grow(state.block_ids, state.num_computed + num_tokens)
        new_blocks = tuple(state.block_ids[state.blocks_sent :])
        state.blocks_sent = len(state.block_ids)
        state.num_computed += num_tokens
        if state.num_computed == state.known_length:
            state.pending_tokens += 1
            samples.add(state.request_id)
        return ScheduledSequence(state.request_id, num_tokens, new_blocks)
