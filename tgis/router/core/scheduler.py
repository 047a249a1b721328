"""Continuous batching: which sequences run in the next step, with which KV blocks, and what
each step's output does to the requests.

The engine drives it with four calls: ``schedule`` (build the next step), ``update`` (apply
a step's output: tokens, detokenization, stops), ``step_failed`` (undo a step the shard did
not run) and ``expiry.py: drop_aborted_and_expired``. The scheduler owns the waiting
queue, the running list, the block allocator and every counter and flag of the policy;
requests' own counters live on their ``RequestState``.

Policy in brief (ARCHITECTURE.md, "Scheduling", has all of it and the why):

* **Order.** The running batch is always a prefix of the arrival order and the queue the
  rest: admission takes from the front only (``joining.py``), a preempted request goes back
  to the front, so nothing ever overtakes an older request.
* **A step** gives every running sequence, oldest first, one decode token or its next
  prompt (or recompute) chunk; prompt tokens share ``max_batch_prefill_tokens``, decodes
  come on top. Then queued requests join while slots, budget, blocks and LoRA slots allow.
* **Overlap.** A sampling chunk's token counts as known at once
  (``RequestState.pending_tokens``), so the next step, planned before this one's output is
  back, computes it; no step is planned past ``max_new_tokens``.
* **KV blocks** are counted in tokens: every known token at admission (the worst case
  without preemption, for encoder-decoder engines), one more each ``block_size`` decoded
  tokens. A decode without a free block preempts the youngest running sequences; a step
  that preempted admits nothing.
* **Sliding window** (``window_blocks.py``): when every layer slides one, the blocks behind
  it go back as each step's output comes, so a generation holds about its window's blocks.
* **Prefix cache** (``prefix_cache.py``): an admitted request starts with the cached
  blocks of its longest cached prefix, already computed (only the rest counts against the
  prefill budget); the blocks each step filled are registered when its output is back.
* **Speculative decoding** (``speculation.py``): while few sequences run, decodes carry
  drafted tokens, and steps run one at a time.
"""

from __future__ import annotations

import itertools
from collections import deque

from tgis.router.core.batching import SchedulerLimits, kv_capacity_blocks
from tgis.router.core.block_pool import BlockPool
from tgis.router.core.joining import admission_blocks, choose_joiners
from tgis.router.core.prefix_cache import PrefixCache
from tgis.router.core.request_state import (
    InputTokensEvent,
    RequestState,
    RequestStatus,
)
from tgis.router.core.speculation import Speculation, SpeculationConfig
from tgis.router.core.state_slots import StateSlots
from tgis.router.core.step_draft import StepDraft
from tgis.router.core.step_failures import StepFailures
from tgis.router.core.steps import ScheduledStep, StepUpdate
from tgis.router.core.window_blocks import release_behind_window
from tgis.router.errors import generation_failure
from tgis.router.request_types import StopReason
from tgis.shard_api.messages import (
    ShardInfo,
    StepOutput,
    StepPlan,
)


class Scheduler(StepFailures):
    """Owns the waiting queue, the running list, the block pool and the prefix cache."""

    def __init__(
        self,
        blocks: BlockPool,
        limits: SchedulerLimits,
        prefix_caching: bool = False,
        speculation: SpeculationConfig | None = None,
        shard_drafts: bool = False,
        state_slots: int = 0,
        kv_window: int = 0,
    ) -> None:
        self.blocks = blocks
        self.kv_window = kv_window
        """``ShardInfo.kv_window`` (0: some layer reads every position, nothing goes early)."""
        self.cache = PrefixCache(blocks, prefix_caching)
        self.speculation = None if speculation is None else Speculation(speculation, shard_drafts)
        self.limits = limits
        self.state_slots = StateSlots(state_slots) if state_slots else None
        """The recurrent-state slots of a model with Mamba layers (None: no such state);
        ``limits.max_batch_size`` is at most their number."""
        self.waiting: deque[RequestState] = deque()
        self.running: list[RequestState] = []
        # Blocks kept free when admitting next to running sequences (vLLM keeps 1 %).
        self.headroom = max(1, blocks.num_blocks // 100) if limits.preemption else 0
        self.hold_admissions = False
        """Set after an out-of-memory step that is retried with fewer sequences."""
        self.preemption_count = 0
        """Preemptions so far."""
        self.budget_holds = 0
        """Steps that left the queue's head waiting only because the prefill budget ran out."""
        self.window_released = 0
        """Blocks given back behind the sliding window so far (``kv_window``)."""
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
        self._release(state)
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
        self._release(state)
        state.num_computed = 0
        state.status = RequestStatus.WAITING
        state.preemptions += 1
        self.preemption_count += 1
        if state.known_to_shard and state.request_id not in self._preempted_ids:
            self._preempted_ids.append(state.request_id)
        self.waiting.appendleft(state)

    def _release(self, state: RequestState) -> None:
        self.blocks.release(state.held_blocks)
        state.block_ids.clear()
        state.released_blocks = 0
        state.blocks_sent = 0
        state.registered_blocks = 0
        if state.state_slot is not None:
            assert self.state_slots is not None
            self.state_slots.give_back(state.state_slot)
            state.state_slot = None

    # ---- a step's output -------------------------------------------------------------------

    def update(self, step: ScheduledStep, output: StepOutput, now: float) -> StepUpdate:
        """Apply a step's output: per-sequence errors, the blocks it filled into the prefix
        cache (those behind the window given back), input-token details, then one token
        per sampling sequence (detokenized, checked against its stopping criteria; finished
        requests leave at once). Tokens of requests that already ended are dropped."""
        update = StepUpdate()
        states = step.states
        for rid in step.samples:
            states[rid].pending_tokens -= 1
        for error in output.errors:
            state = states.get(error.request_id)
            if state is not None:
                self.fail(
                    state, generation_failure(error.message, constraint=error.constraint), update
                )
        if self.speculation is not None:
            self.speculation.reconcile(step, output, update)
        for rid, computed in step.computed_after.items():
            state = states[rid]
            # A request that ended or was preempted since let go of these blocks.
            if state.status is RequestStatus.RUNNING:
                self.cache.register(state, computed)
                if self.kv_window:
                    self.window_released += release_behind_window(
                        self.cache, state, computed, self.kv_window
                    )
        for details in output.input_tokens:
            state = states[details.request_id]
            if state.status is not RequestStatus.FINISHED:
                update.events.append((state, InputTokensEvent(details.tokens)))
        self._accept_tokens(states, output, now, update)
        return update

    def _accept_tokens(
        self, states: dict[int, RequestState], output: StepOutput, now: float, update: StepUpdate
    ) -> None:
        """One sampled token per sequence: detokenized and checked (``accept_token``),
        latencies recorded, finished requests gone at once."""
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

    # ---- the next step ------------------------------------------------------------------------

    def schedule(self, now: float, base_step_id: int = 0) -> ScheduledStep:
        """Build the next step; allocates blocks, preempts and admits as the policy says.

        ``base_step_id`` is the step still running that this one is planned on (0: none).
        While speculative decoding applies, nothing is planned on top of a running step.
        """
        speculation = self.speculation
        demand = len(self.running) + len(self.waiting)
        speculating = speculation is not None and speculation.applies(demand, self.running)
        if base_step_id and (speculating or (speculation is not None and speculation.in_flight)):
            return ScheduledStep(StepPlan(base_step_id=base_step_id), {}, frozenset(), {}, 0)
        budget = self.limits.max_batch_prefill_tokens
        draft = StepDraft(budget, caching=self.cache.enabled, windowed=self.kv_window > 0)
        preemptions = self._schedule_running(draft, speculating)
        self._steps_since_admission += 1
        already_running = bool(self.running)
        admitted: list[RequestState] = []
        budget_hold = False
        if not preemptions and not (self.hold_admissions and self.running):
            admitted, budget_hold = self._admit(draft, now)
        if budget_hold:
            self.budget_holds += 1
        finished, self._finished_ids = tuple(self._finished_ids), []
        preempted_ids, self._preempted_ids = tuple(self._preempted_ids), []
        plan = StepPlan(
            step_id=next(self._step_ids),
            new_sequences=tuple(draft.new_sequences),
            scheduled=tuple(draft.scheduled),
            finished_request_ids=finished,
            preempted_request_ids=preempted_ids,
            base_step_id=base_step_id,
        )
        return ScheduledStep(
            plan=plan,
            states=draft.states,
            samples=frozenset(draft.samples),
            computed_after=draft.computed_after,
            prompt_tokens=draft.prompt_tokens,
            cache_queried=draft.cache_queried,
            cache_hits=draft.cache_hits,
            admitted=tuple(admitted),
            joined_running_batch=bool(admitted) and already_running,
            preemptions=preemptions,
            budget_hold=budget_hold,
            drafted=draft.drafted,
        )

    def _schedule_running(self, draft: StepDraft, speculating: bool = False) -> int:
        """Every running sequence's work, oldest first: the next prompt (or recompute) chunk
        within the budget, or one decode token (preempting the youngest when its block is
        missing), with drafted tokens after it when ``speculating``. Returns the
        preemptions."""
        before = self.preemption_count
        i = 0
        while i < len(self.running):
            state = self.running[i]
            i += 1
            if state.uncomputed == 0 or state.generation_scheduled:
                continue  # nothing to compute, or only waiting for its last token
            if state.prefilling:
                if draft.budget > 0:
                    draft.add(self.blocks, state, min(state.uncomputed, draft.budget), prompt=True)
                continue
            if not self._make_room_for_decode(state):
                break  # it preempted itself: it was the youngest
            drafts: tuple[int, ...] = ()
            count = 0
            if speculating:
                drafts, count = self._drafts(state)
            elif self.speculation is not None:
                self.speculation.idle(state)
            draft.add(
                self.blocks, state, 1 + len(drafts), prompt=False, drafts=drafts, spec_tokens=count
            )
        if self.speculation is not None and draft.drafted:
            self.speculation.in_flight = True
        return self.preemption_count - before

    def _drafts(self, state: RequestState) -> tuple[tuple[int, ...], int]:
        assert self.speculation is not None
        return self.speculation.drafts(state, self.blocks)

    def _make_room_for_decode(self, state: RequestState) -> bool:
        """Preempt the youngest running sequences until ``state``'s next token has its
        block; False when ``state`` itself had to go."""
        while self.blocks.missing(state.block_ids, state.num_computed + 1) > self.blocks.num_free:
            victim = self.running[-1]
            self.preempt(victim)
            if victim is state:
                break
        return state.status is RequestStatus.RUNNING

    def _admit(self, draft: StepDraft, now: float) -> tuple[list[RequestState], bool]:
        """Admit from the front of the queue (``joining.py``); returns the fresh requests
        admitted and whether the head waited for the prefill budget alone."""
        joiners = choose_joiners(
            self.waiting,
            self.running,
            self.cache,
            self.limits,
            self.headroom,
            draft.budget,
            self._steps_since_admission,
        )
        if joiners.fresh:
            self._steps_since_admission = 0
        admitted: list[RequestState] = []
        for hit in joiners.hits:  # first, so that no allocation below evicts them
            self.blocks.share(hit.blocks)
        for state, hit in zip(joiners.chosen, joiners.hits, strict=True):
            self.waiting.popleft()
            state.block_ids = list(hit.blocks)
            state.registered_blocks = len(hit.blocks)
            state.num_computed = hit.tokens
            fresh = admission_blocks(state, self.blocks, self.limits.preemption) - len(hit.blocks)
            state.block_ids += self.blocks.allocate(fresh)
            draft.cache_queried += hit.queried
            draft.cache_hits += hit.tokens
            state.status = RequestStatus.RUNNING
            if self.state_slots is not None:
                state.state_slot = self.state_slots.take()
            if state.started_at is None:
                state.started_at = now
            if state.preemptions == 0:
                admitted.append(state)
            self.running.append(state)
            draft.add(self.blocks, state, min(state.uncomputed, draft.budget), prompt=True)
        return admitted, joiners.budget_hold


def new_scheduler(
    limits: SchedulerLimits,
    info: ShardInfo,
    prefix_caching: bool,
    speculation: SpeculationConfig | None = None,
) -> Scheduler:
    """An empty scheduler over the KV blocks the router may allocate
    (:func:`kv_capacity_blocks`), caching prefixes when ``prefix_caching`` is asked for
    and the shard's engine can (``ShardInfo.prefix_caching``), drafting tokens with
    ``speculation`` when the engine verifies them (``ShardInfo.speculation``)."""
    pool = BlockPool(kv_capacity_blocks(limits, info), info.block_size)
    drafts = speculation if info.speculation else None
    caching = prefix_caching and info.prefix_caching
    return Scheduler(
        pool,
        limits,
        caching,
        drafts,
        shard_drafts=info.draft_model,
        kv_window=info.kv_window,
        state_slots=info.state_slots,
    )
