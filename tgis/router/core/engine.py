"""The engine: one asyncio task that runs the step pipeline and emits token events.

The loop is schedule → send → (await the oldest step) → ``Scheduler.update`` → emit:

1. drop cancelled requests and expire queued ones past their deadline (their blocks are
   free at once and the shard forgets them in the next step);
2. ``Scheduler.schedule`` builds the next step (decodes, prefill chunks, preemptions,
   admissions; see scheduler.py for the policy) and it is sent at once;
3. **overlap**: while fewer than ``PIPELINE_DEPTH`` steps are unanswered, the next step is
   planned and sent straight away, on top of the running one (the shard holds the tokens
   it samples, so a decode needs only a count); so the shard starts step n+1 the moment
   step n ends, while the router detokenizes, checks stops and streams step n's tokens;
4. the oldest step's output goes through ``Scheduler.update`` (tokens detokenized, stop
   criteria checked, finished requests dropped) and the events are put on each request's
   queue, with the metrics.

A failed step fails the requests it computed (TGIS), with one exception: when the shard
runs out of memory on a step of several sequences, the younger half of them is preempted
(recomputed later, output unchanged) and the rest retried at the next step with admissions
held; only if that retry runs out of memory too do its requests fail. The step sent on top
of a failed one is refused by the shard (``base_step_id``) and simply undone. Either way
the failure is logged and counted and the engine carries on.

A shard that does not answer a step within ``step_timeout`` seconds of starting it (stopped,
deadlocked, stuck in a driver call) is taken as hung: every live request fails with the
reason, and the engine task ends with ``ShardHungError``, which the router turns into a
fatal exit (the launcher then stops everything and exits non-zero).

``close`` is the end of a drain: every live request fails with the router's reason (the
server is going away), and a request submitted after it is refused the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import NoReturn

from tgis.router.config import DEFAULT_STEP_TIMEOUT_S
from tgis.router.core.expiry import drop_aborted_and_expired
from tgis.router.core.request_state import OutputRules, RequestState
from tgis.router.core.scheduler import Scheduler
from tgis.router.core.shard_client import ShardClient, ShardError, ShardFailure
from tgis.router.core.steps import ScheduledStep, StepUpdate
from tgis.router.errors import GenerationError, RouterError, UnavailableError
from tgis.router.ops.metrics import Metrics, step_method
from tgis.router.ops.request_context import current_correlation_id, request_log_extra
from tgis.router.request_types import ValidatedRequest
from tgis.shard_api.messages import StepOutput

log = logging.getLogger(__name__)

PIPELINE_DEPTH = 2
"""Steps sent and not answered at most: the one running and the one planned on top of it."""


CONNECTION_RETRY_DELAY_S = 0.5
"""After a step fails for want of a connection to the shard: how long the engine waits
before it sends another. A lost channel fails each step at once, and the step that only
tells the shard what to forget is sent again each time: without a pause the loop would
spin, never yielding to the event loop (health, drain, every RPC) and logging each try."""


class ShardHungError(Exception):
    """The shard did not answer a step in time; the message says which and how long."""


@dataclass(slots=True)
class _InFlight:
    step: ScheduledStep
    result: asyncio.Future[StepOutput]
    method: str
    sent_at: float


class Engine:
    def __init__(
        self,
        *,
        shard: ShardClient,
        scheduler: Scheduler,
        output: OutputRules,
        metrics: Metrics,
        pipeline_depth: int = PIPELINE_DEPTH,
        step_timeout: float = DEFAULT_STEP_TIMEOUT_S,
        connection_retry_delay: float = CONNECTION_RETRY_DELAY_S,
    ) -> None:
        self.shard = shard
        self.output = output
        self.metrics = metrics
        self.pipeline_depth = pipeline_depth
        self.step_timeout = step_timeout
        self.connection_retry_delay = connection_retry_delay
        self.scheduler = scheduler
        self.generation_healthy = False
        self.on_token_generated: Callable[[], None] | None = None
        self._wakeup = asyncio.Event()
        self._ids = itertools.count(1)
        self._in_flight: deque[_InFlight] = deque()
        self._last_answer = 0.0
        self._task: asyncio.Task[None] | None = None
        self._closed: UnavailableError | None = None
        metrics.set_cache_config(scheduler.blocks.block_size, scheduler.blocks.num_blocks)
        self._update_gauges()

    # ---- called by the servicer -------------------------------------------------------

    def submit(self, request: ValidatedRequest, arrival: float) -> RequestState:
        """Queue a validated input; its events arrive on the returned state's queue.

        Raises:
            UnavailableError: the engine is closed (the end of a drain).
        """
        if self._closed is not None:
            raise self._closed
        # submit runs in the RPC's task: the correlation id bound there (request_context.py)
        state = self.output.new_state(next(self._ids), request, arrival, current_correlation_id())
        self.scheduler.add(state)
        self.metrics.set_queue_size(len(self.scheduler.waiting))
        self._wakeup.set()
        return state

    def abort(self, state: RequestState) -> None:
        """The client went away: the engine drops the request before the next step."""
        if state.finish_reason is None:
            state.aborted = True
            self._wakeup.set()

    def close(self, message: str) -> int:
        """End every live request with ``UnavailableError(message)`` and refuse new ones
        with it; the number of requests ended."""
        self._closed = UnavailableError(message)
        return self._fail_all(self._closed)

    # ---- the loop -----------------------------------------------------------------------

    def start(self) -> asyncio.Task[None]:
        """Start the loop; the task ends only with ``ShardHungError`` (or when stopped)."""
        self._task = asyncio.create_task(self._run(), name="engine")
        return self._task

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, ShardHungError):
                await self._task
        for flight in self._in_flight:
            flight.result.cancel()

    async def _run(self) -> None:
        in_flight = self._in_flight
        while True:
            while len(in_flight) < self.pipeline_depth and self._send_next_step():
                pass
            if in_flight:
                await self._receive(in_flight.popleft())
                continue
            if self._fail_unservable_head():
                continue
            self._wakeup.clear()
            await self._wakeup.wait()

    def _send_next_step(self) -> bool:
        """Plan the next step on top of the unanswered ones and send it; False when there
        is nothing to send."""
        now = time.monotonic()
        self._emit(drop_aborted_and_expired(self.scheduler, now))
        base = self._in_flight[-1].step.plan.step_id if self._in_flight else 0
        step = self.scheduler.schedule(now, base)
        self._record_schedule(step, now)
        self._update_gauges()
        if not step.plan.has_message:
            return False
        method = step_method(step.prompt_tokens)
        if step.plan.scheduled:
            self.metrics.step_started(method, len(step.plan.scheduled), step.prompt_tokens)
        result = self.shard.send_step(step.plan)
        self._in_flight.append(_InFlight(step, result, method, now))
        return True

    async def _receive(self, flight: _InFlight) -> None:
        """Wait for the oldest step's output and apply it (or handle its failure)."""
        step = flight.step
        # The step starts running when the one before it has been answered.
        deadline = max(flight.sent_at, self._last_answer) + self.step_timeout
        try:
            # timeout_at (the loop's clock is time.monotonic), not wait_for: no task per
            # step, and a stop() that meets the answer is never lost (3.11's wait_for can).
            async with asyncio.timeout_at(deadline):
                output = await self.shard.step_result(flight.result)
        except TimeoutError:
            self._shard_hung(flight)
        except ShardError as err:
            await self._step_failed(flight, err)
            return
        except Exception as err:  # a bug must fail the step's requests, not the engine
            log.exception("step %d failed unexpectedly", step.plan.step_id)
            await self._step_failed(
                flight, ShardError(ShardFailure.ERROR, f"{type(err).__name__}: {err}")
            )
            return
        now = time.monotonic()
        started, self._last_answer = max(flight.sent_at, self._last_answer), now
        self.scheduler.hold_admissions = False
        if step.plan.scheduled:
            self.metrics.step_succeeded(
                flight.method,
                now - started,
                output.forward_time_ns / 1e9,
                prompt_tokens=step.prompt_tokens,
                generated_tokens=len(output.tokens),
            )
        try:
            update = self.scheduler.update(step, output, now)
        except Exception as err:
            log.exception("processing the output of step %d failed", step.plan.step_id)
            self.generation_healthy = False
            self.metrics.step_failed(flight.method, ShardFailure.ERROR.value)
            self._emit(self.scheduler.fail_step(step, f"{type(err).__name__}: {err}"))
            return
        self._emit(update)
        if update.tokens:
            self.generation_healthy = True
            if self.on_token_generated is not None:
                self.on_token_generated()
        if step.plan.scheduled:
            self.metrics.step_processed(flight.method, time.monotonic() - now)

    async def _step_failed(self, flight: _InFlight, err: ShardError) -> None:
        """Nothing of the step happened on the shard. Steps sent on top of it are refused
        there: wait for them and undo them (latest first), then this one; then fail its
        requests, or retry the older half after running out of memory."""
        later = list(self._in_flight)
        self._in_flight.clear()
        for other in later:
            with contextlib.suppress(Exception):
                await other.result
        for other in reversed(later):
            self.scheduler.step_failed(other.step)
        step = flight.step
        self.scheduler.step_failed(step)
        self._last_answer = time.monotonic()
        if err.failure is ShardFailure.STALE:  # planned on a step that failed before
            return
        log.error("step %d failed: %s", step.plan.step_id, err.detail)
        self.generation_healthy = False
        self.metrics.step_failed(flight.method, err.failure.value)
        preempted = 0
        if err.failure is ShardFailure.OOM:
            preempted = self.scheduler.retry_without_younger_half(step)
        if preempted:
            log.warning(
                "step %d ran out of memory: %d of its sequences preempted, the rest retried",
                step.plan.step_id,
                preempted,
            )
            for _ in range(preempted):
                self.metrics.request_preempted()
            return
        self.scheduler.hold_admissions = False
        self._emit(self.scheduler.fail_step(step, err.detail))
        if err.failure is ShardFailure.CONNECTION:
            await asyncio.sleep(self.connection_retry_delay)

    def _shard_hung(self, flight: _InFlight) -> NoReturn:
        """No answer in time: fail every live request with the reason and stop the loop."""
        message = (
            f"the shard did not answer step {flight.step.plan.step_id} within "
            f"{self.step_timeout:g} s (TGIS_STEP_TIMEOUT): it is hung"
        )
        log.error("%s", message)
        self.generation_healthy = False
        self.metrics.step_failed(flight.method, ShardFailure.CONNECTION.value)
        self._fail_all(GenerationError(message))
        raise ShardHungError(message)

    def _fail_all(self, error: RouterError) -> int:
        """End every live request, running or queued, with ``error``; how many."""
        scheduler = self.scheduler
        update = StepUpdate()
        live = [*scheduler.running, *scheduler.waiting]
        for state in live:
            scheduler.fail(state, error, update)
        self._emit(update)
        self._update_gauges()
        return len(live)

    # ---- events and metrics ---------------------------------------------------------------

    def _emit(self, update: StepUpdate) -> None:
        for state, event in update.events:
            if isinstance(event, BaseException):
                # A request ended by the drain is the server's choice, not a failure.
                level = logging.WARNING if isinstance(event, UnavailableError) else logging.ERROR
                log.log(
                    level,
                    "request %d failed: %s",
                    state.request_id,
                    event,
                    extra=request_log_extra(state.correlation_id, state.request_id),
                )
            state.emit(event)
        metrics = self.metrics
        for seconds in update.time_to_first_token:
            metrics.first_token(seconds)
        for seconds in update.inter_token:
            metrics.next_token(seconds)
        for _ in range(update.cancelled):
            metrics.request_cancelled()
        for _ in range(update.timed_out_in_queue):
            metrics.request_timed_out()
        if update.speculative_steps:
            metrics.speculated(
                update.speculative_steps, update.drafted_tokens, update.accepted_tokens
            )

    def _record_schedule(self, step: ScheduledStep, now: float) -> None:
        """Queue time of every fresh admission, a concatenation when they join a batch,
        preemptions and prefill-budget holds."""
        for state in step.admitted:
            self.metrics.request_admitted(now - state.arrival)
        if step.joined_running_batch:
            self.metrics.batch_concatenated()
        for _ in range(step.preemptions):
            self.metrics.request_preempted()
        if step.budget_hold:
            self.metrics.prefill_budget_exceeded()
        self.metrics.prefix_cache_looked_up(step.cache_queried, step.cache_hits)

    def _update_gauges(self) -> None:
        scheduler = self.scheduler
        self.metrics.set_queue_size(len(scheduler.waiting))
        running = scheduler.running
        input_tokens = 0
        remaining = 0
        for s in running:
            generated = len(s.generated_ids)
            # TGIS's tgi_batch_input_tokens leaves prompt prefixes out.
            input_tokens += s.request.input_length + generated
            remaining += s.request.stopping.max_new_tokens - generated
        self.metrics.set_batch(len(running), input_tokens, remaining)
        blocks = scheduler.blocks
        self.metrics.set_kv_cache(blocks.num_used, blocks.num_blocks)
        self.metrics.set_prefix_cache(blocks.num_cached, blocks.num_idle)
        max_loras = scheduler.limits.max_loras
        if max_loras is None:  # the shard takes no LoRA adapter
            self.metrics.set_lora_requests(0, (), ())
        else:
            self.metrics.set_lora_requests(
                max_loras,
                (s.request.lora_id for s in running if s.request.lora_id),
                (s.request.lora_id for s in scheduler.waiting if s.request.lora_id),
            )

    def _fail_unservable_head(self) -> bool:
        """With nothing running, the head of the queue always fits (start-up checks one
        max_sequence_length request against the capacity); fail it if it ever does not,
        rather than wait forever."""
        scheduler = self.scheduler
        state = scheduler.unservable_head()
        if state is None:
            return False
        capacity = scheduler.blocks.num_blocks
        log.error(
            "request %d cannot fit in %d KV blocks",
            state.request_id,
            capacity,
            extra=request_log_extra(state.correlation_id, state.request_id),
        )
        update = StepUpdate()
        scheduler.fail(
            state, GenerationError(f"the request needs more than the {capacity} KV blocks"), update
        )
        self._emit(update)
        return True
