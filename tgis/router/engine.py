"""The engine: one asyncio task that schedules steps, calls the shard and emits token events.

The engine task is the only writer of every RequestState. For each step:
1. drop cancelled requests and expire queued ones past their deadline (their blocks are
   free at once and the shard forgets them in the next step);
2. `Scheduler.schedule` builds a StepPlan (decodes, prefill chunks, preemptions,
   admissions; see scheduler.py for the policy);
3. `ShardClient.step` runs it;
4. each sampled token is detokenized, checked against the stopping criteria and
   emitted to its request's event queue; finished requests release their blocks.

A failed step fails the requests it computed (TGIS), with one exception: when the shard
runs out of memory on a step of several sequences, the younger half of them is preempted
(recomputed later, output unchanged) and the rest retried at the next step with admissions
held; only if that retry runs out of memory too do its requests fail. Either way the
failure is logged and counted and the engine carries on.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import replace

from tgis.router.block_allocator import BlockAllocator
from tgis.router.detokenizer import IncrementalDetokenizer
from tgis.router.errors import GenerationError
from tgis.router.metrics import Metrics, step_method
from tgis.router.request_state import InputTokensEvent, RequestState, TokenEvent
from tgis.router.request_types import StopReason, ValidatedRequest
from tgis.router.scheduler import Scheduler, SchedulerLimits, kv_capacity_blocks
from tgis.router.shard_client import ShardClient, ShardError, ShardFailure
from tgis.router.step import ShardInfo, StepOutput, StepPlan, TokenDetail
from tgis.router.stopping import StopChecker, stream_hold_back_bytes
from tgis.router.tokenization import RouterTokenizer

log = logging.getLogger(__name__)


class Engine:
    def __init__(
        self,
        *,
        shard: ShardClient,
        info: ShardInfo,
        tokenizer: RouterTokenizer,
        limits: SchedulerLimits,
        metrics: Metrics,
        output_special_tokens: bool = False,
    ) -> None:
        self.shard = shard
        self.info = info
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.output_special_tokens = output_special_tokens
        if info.is_seq2seq:  # the encoder-decoder engine cannot recompute generated tokens
            limits = replace(limits, preemption=False)
        num_blocks = kv_capacity_blocks(limits, info)
        self.scheduler = Scheduler(BlockAllocator(num_blocks, info.block_size), limits)
        self.generation_healthy = False
        self.on_token_generated: Callable[[], None] | None = None
        self._wakeup = asyncio.Event()
        self._ids = itertools.count(1)
        self._detokenizers: dict[int, IncrementalDetokenizer] = {}
        self._stop_checkers: dict[int, StopChecker] = {}
        self._task: asyncio.Task[None] | None = None

    # ---- called by the servicer -------------------------------------------------------

    def submit(self, request: ValidatedRequest, arrival: float) -> RequestState:
        """Queue a validated input; its events arrive on the returned state's queue."""
        state = RequestState(request_id=next(self._ids), request=request, arrival=arrival)
        self.scheduler.add(state)
        self.metrics.set_queue_size(len(self.scheduler.waiting))
        self._wakeup.set()
        return state

    def abort(self, state: RequestState) -> None:
        """The client went away: the engine drops the request before the next step."""
        if state.finish_reason is None:
            state.aborted = True
            self._wakeup.set()

    # ---- the loop -----------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="engine")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        while True:
            if not self.scheduler.has_work:
                self._wakeup.clear()
                await self._wakeup.wait()
            now = time.monotonic()
            self._drop_aborted_and_expired(now)
            preemptions = self.scheduler.preemption_count
            budget_holds = self.scheduler.budget_holds
            plan = self.scheduler.schedule(now)
            for _ in range(self.scheduler.preemption_count - preemptions):
                self.metrics.request_preempted()
            for _ in range(self.scheduler.budget_holds - budget_holds):
                self.metrics.prefill_budget_exceeded()
            self._record_admissions(plan, now)
            self._update_gauges()
            if not plan.has_message:
                if self._fail_unservable_head():
                    continue
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            await self._run_step(plan)
            self._update_gauges()

    def _record_admissions(self, plan: StepPlan, now: float) -> None:
        """Queue time of every fresh admission; a concatenation when they join a batch."""
        if not plan.new_sequences:
            return
        running = {s.request_id: s for s in self.scheduler.running}
        for seq in plan.new_sequences:
            state = running.get(seq.request_id)
            if state is not None:
                self.metrics.request_admitted(now - state.arrival)
        if len(running) > len(plan.new_sequences):
            self.metrics.batch_concatenated()

    def _update_gauges(self) -> None:
        scheduler = self.scheduler
        self.metrics.set_queue_size(len(scheduler.waiting))
        running = scheduler.running
        self.metrics.set_batch(
            len(running),
            sum(s.prompt_length + len(s.generated_ids) for s in running),
            sum(s.request.stopping.max_new_tokens - len(s.generated_ids) for s in running),
        )
        self.metrics.set_kv_cache(scheduler.allocator.num_used, scheduler.allocator.num_blocks)

    def _fail_unservable_head(self) -> bool:
        """With nothing running, the head of the queue always fits (start-up checks one
        max_sequence_length request against the capacity); fail it if it ever does not,
        rather than wait forever."""
        scheduler = self.scheduler
        if scheduler.running or not scheduler.waiting:
            return False
        state = scheduler.waiting[0]
        capacity = scheduler.allocator.num_blocks
        log.error("request %d cannot fit in %d KV blocks", state.request_id, capacity)
        self._finish_with_error(
            state, GenerationError(f"the request needs more than the {capacity} KV blocks")
        )
        return True

    async def _run_step(self, plan: StepPlan) -> None:
        running = {s.request_id: s for s in self.scheduler.running}
        prompt_tokens = sum(
            c.num_tokens for c in plan.scheduled if running[c.request_id].prefilling
        )
        method = step_method(prompt_tokens)
        if plan.scheduled:
            self.metrics.step_started(method, len(plan.scheduled), prompt_tokens)
        started = time.monotonic()
        try:
            output = await self.shard.step(plan)
        except ShardError as err:
            log.error("step %d failed: %s", plan.step_id, err.detail)
            self._step_failed(plan, running, method, err.failure.value, err.detail)
            return
        except Exception as err:  # a bug must fail the step's requests, not the engine
            log.exception("step %d failed unexpectedly", plan.step_id)
            self._step_failed(plan, running, method, "error", f"{type(err).__name__}: {err}")
            return
        self.scheduler.hold_admissions = False
        if plan.scheduled:
            self.metrics.step_succeeded(
                method,
                time.monotonic() - started,
                output.forward_time_ns / 1e9,
                prompt_tokens=prompt_tokens,
                generated_tokens=len(output.tokens),
            )
        for chunk in plan.scheduled:
            running[chunk.request_id].num_computed += chunk.num_tokens
        processing = time.monotonic()
        try:
            self._apply_output(running, output)
        except Exception as err:
            log.exception("processing the output of step %d failed", plan.step_id)
            self._fail_step(plan, running, method, "error", f"{type(err).__name__}: {err}")
            return
        if plan.scheduled:
            self.metrics.step_processed(method, time.monotonic() - processing)

    def _step_failed(
        self,
        plan: StepPlan,
        running: dict[int, RequestState],
        method: str,
        reason: str,
        detail: str,
    ) -> None:
        """The shard call failed: nothing of the step happened on the shard."""
        self.scheduler.step_failed(plan)
        if reason == ShardFailure.OOM.value and self._retry_without_younger_half(plan, running):
            self.generation_healthy = False
            self.metrics.step_failed(method, reason)
            return
        self.scheduler.hold_admissions = False
        self._fail_step(plan, running, method, reason, detail)

    def _retry_without_younger_half(self, plan: StepPlan, running: dict[int, RequestState]) -> bool:
        """Out of memory: preempt the younger half of the step's sequences and let the next
        step retry the rest with admissions held; False when this was already the retry,
        a single sequence, or preemption is off."""
        scheduler = self.scheduler
        if scheduler.hold_admissions or not scheduler.limits.preemption:
            return False
        states = sorted((running[c.request_id] for c in plan.scheduled), key=lambda s: s.request_id)
        if len(states) < 2:
            return False
        younger = states[len(states) // 2 :]
        for state in reversed(younger):  # youngest first: the queue stays in arrival order
            scheduler.preempt(state)
            self.metrics.request_preempted()
        scheduler.hold_admissions = True
        log.warning(
            "step %d ran out of memory: retrying %d of its %d sequences, %d preempted",
            plan.step_id,
            len(states) - len(younger),
            len(states),
            len(younger),
        )
        return True

    def _fail_step(
        self,
        plan: StepPlan,
        running: dict[int, RequestState],
        method: str,
        reason: str,
        detail: str,
    ) -> None:
        """Every request of a failed step fails; the shard forgets them at the next step."""
        self.generation_healthy = False
        self.metrics.step_failed(method, reason)
        for chunk in plan.scheduled:
            state = running.get(chunk.request_id)
            if state is not None:
                self._finish_with_error(state, GenerationError(detail))

    def _apply_output(self, running: dict[int, RequestState], output: StepOutput) -> None:
        now = time.monotonic()
        for request_id, message in output.errors.items():
            self._finish_with_error(running[request_id], GenerationError(message))
        for request_id, details in output.input_tokens.items():
            state = running[request_id]
            if state.finish_reason is None:
                state.emit(InputTokensEvent(details))
        produced = False
        for request_id, token in output.tokens.items():
            state = running[request_id]
            if state.finish_reason is not None:
                continue
            produced = True
            self._append_token(state, token, now)
        if produced:
            self.generation_healthy = True
            if self.on_token_generated is not None:
                self.on_token_generated()

    def _append_token(self, state: RequestState, token: TokenDetail, now: float) -> None:
        if state.last_token_at is None:
            self.metrics.first_token(now - state.arrival)
        else:
            self.metrics.next_token(now - state.last_token_at)
        state.last_token_at = now
        state.generated_ids.append(token.token_id)
        detok = self._detokenizer(state)
        text = detok.push(token.token_id)
        stop = self._stop_checker(state).check(
            token_id=token.token_id,
            generated_count=len(state.generated_ids),
            output_bytes=detok.output_bytes,
            bytes_added=detok.bytes_added,
            now=now,
        )
        detail = token if state.request.params.response.generated_tokens else None
        if stop is None:
            if text or detail is not None:
                state.emit(TokenEvent(text, len(state.generated_ids), detail))
            return
        text += detok.flush(stop.truncate_at_bytes)
        state.emit(
            TokenEvent(
                text, len(state.generated_ids), detail, stop.reason, stop.stop_sequence or ""
            )
        )
        self._finish(state, stop.reason)

    # ---- request end ----------------------------------------------------------------------

    def _drop_aborted_and_expired(self, now: float) -> None:
        """Cancelled requests (queued or running) and queued ones past their deadline leave
        now: their blocks are free at once and the shard forgets them in the next step."""
        for state in [s for s in self.scheduler.waiting if s.aborted]:
            self.metrics.request_cancelled()
            self._finish(state, StopReason.CANCELLED)
        for state in [s for s in self.scheduler.running if s.aborted]:
            self.metrics.request_cancelled()
            self._finish(state, StopReason.CANCELLED)
        for state in list(self.scheduler.waiting):
            deadline = state.request.stopping.deadline
            if deadline is None or now <= deadline:
                continue
            if state.generated_ids:
                # Preempted after generating: it ends as a running request would.
                detok = self._detokenizers.get(state.request_id)
                text = detok.flush() if detok is not None else ""
                count = len(state.generated_ids)
                state.emit(TokenEvent(text, count, None, StopReason.TIME_LIMIT))
            else:
                self.metrics.request_timed_out()
                state.emit(TokenEvent("", 0, None, StopReason.TIME_LIMIT))
            self._finish(state, StopReason.TIME_LIMIT)

    def _finish(self, state: RequestState, reason: StopReason) -> None:
        state.finish_reason = reason
        self.scheduler.finish(state)
        self._detokenizers.pop(state.request_id, None)
        self._stop_checkers.pop(state.request_id, None)

    def _finish_with_error(self, state: RequestState, error: Exception) -> None:
        if state.finish_reason is not None:
            return
        self._finish(state, StopReason.ERROR)
        state.emit(error)

    def _detokenizer(self, state: RequestState) -> IncrementalDetokenizer:
        detok = self._detokenizers.get(state.request_id)
        if detok is None:
            detok = IncrementalDetokenizer(
                self.tokenizer,
                skip_special_tokens=not self.output_special_tokens,
                hold_back_bytes=stream_hold_back_bytes(state.request.stopping),
                eos_token_ids=self.info.eos_token_ids,
                # Encoder-decoder output starts fresh: its first word has no leading space.
                continuation=not self.info.is_seq2seq,
            )
            self._detokenizers[state.request_id] = detok
        return detok

    def _stop_checker(self, state: RequestState) -> StopChecker:
        checker = self._stop_checkers.get(state.request_id)
        if checker is None:
            checker = StopChecker(state.request.stopping, self.info.eos_token_ids)
            self._stop_checkers[state.request_id] = checker
        return checker
