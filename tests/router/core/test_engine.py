"""The engine loop against a scripted shard: batching, stopping, errors, cancellation.

The shard is the only stand-in here (the real one is exercised in tests/e2e); the
tokenizer is the embedded model's real one.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import pytest

from tests.router.core.scripted_shard import INFO, ScriptedShard, make_engine, request
from tgis.router.core.engine import Engine, ShardHungError
from tgis.router.core.expiry import drop_aborted_and_expired
from tgis.router.core.request_state import RequestState, TokenEvent
from tgis.router.core.shard_client import ShardFailure
from tgis.router.errors import GenerationError, UnavailableError
from tgis.router.request_types import StopReason
from tgis.shard_api.messages import StepPlan


async def final_event(state: RequestState) -> TokenEvent | BaseException:
    while True:
        event = await asyncio.wait_for(state.events.get(), 10)
        if isinstance(event, BaseException) or (isinstance(event, TokenEvent) and event.is_final):
            return event


def run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(coro)


def test_late_request_joins_running_batch_and_all_finish() -> None:
    async def scenario() -> None:
        shard = ScriptedShard()
        engine = make_engine(shard)
        long = engine.submit(request(30), time.monotonic())
        await asyncio.sleep(0.02)
        short = engine.submit(request(3), time.monotonic())
        short_final = await final_event(short)
        long_final = await final_event(long)
        await engine.stop()
        assert isinstance(short_final, TokenEvent) and isinstance(long_final, TokenEvent)
        assert short_final.generated_token_count == 3
        assert short_final.stop_reason == StopReason.MAX_TOKENS
        assert long_final.generated_token_count == 30
        joined = next(p for p in shard.plans if p.new_sequences and p.step_id > 1)
        # The newcomer's prefill shares the step with the running request's decode.
        assert {c.request_id for c in joined.scheduled} == {long.request_id, short.request_id}
        finished_later = [p for p in shard.plans if short.request_id in p.finished_request_ids]
        assert len(finished_later) == 1
        metrics = metric_samples(engine)
        assert metrics["tgi_request_queue_duration_count"] == 2  # both admitted
        assert metrics["tgi_request_time_to_first_token_duration_count"] == 2
        assert metrics["tgi_request_inter_token_duration_count"] == (3 - 1) + (30 - 1)
        assert metrics["tgi_batch_concatenation_count_total"] == 1
        assert metrics["tgi_batch_current_size"] == 0
        assert metrics["tgi_kv_cache_used_blocks"] == 0
        steps = len(shard.plans)
        prefill = metrics['tgi_batch_inference_success_total{method="prefill"}']
        decode = metrics['tgi_batch_inference_success_total{method="next_token"}']
        assert (prefill, prefill + decode) == (2, steps)

    run(scenario())


def metric_samples(engine: Engine) -> dict[str, float]:
    """Unlabelled samples by name, labelled ones by `name{labels}` as rendered."""
    samples = {}
    for line in engine.metrics.render().decode().splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def test_eos_stops_and_shard_failure_fails_every_request_in_the_step() -> None:
    async def scenario() -> None:
        engine = make_engine(ScriptedShard(eos_at_step=3))
        final = await final_event(engine.submit(request(10), time.monotonic()))
        await engine.stop()
        assert isinstance(final, TokenEvent)
        assert (final.stop_reason, final.generated_token_count) == (StopReason.EOS_TOKEN, 3)

        # Not out of memory (that is retried, below): every request of the step fails.
        engine = make_engine(ScriptedShard(fail_at_step=2, failure=ShardFailure.ERROR))
        states = [engine.submit(request(10), time.monotonic()) for _ in range(2)]
        results = [await final_event(s) for s in states]
        assert engine.generation_healthy is False
        await engine.stop()
        for result in results:
            assert isinstance(result, GenerationError)
            assert str(result) == "Request failed during generation: GPU out of memory"
        # A single sequence out of memory: nothing to split, it fails.
        engine = make_engine(ScriptedShard(fail_at_step=2, failure=ShardFailure.OOM))
        result = await final_event(engine.submit(request(10), time.monotonic()))
        await engine.stop()
        assert isinstance(result, GenerationError)

    run(scenario())


def test_a_step_unanswered_past_the_timeout_fails_every_request_and_ends_the_loop() -> None:
    async def scenario() -> None:
        engine = make_engine(
            ScriptedShard(hang_at_step=4), batch_size=2, start=False, step_timeout=0.2
        )
        task = engine.start()
        states = [engine.submit(request(50), time.monotonic()) for _ in range(3)]  # 1 queued
        started = time.monotonic()
        results = [await final_event(s) for s in states]
        waited = time.monotonic() - started
        with pytest.raises(ShardHungError) as hung:
            await task
        await engine.stop()
        assert 0.2 <= waited < 5.0
        message = "the shard did not answer step 4 within 0.2 s (TGIS_STEP_TIMEOUT): it is hung"
        assert str(hung.value) == message
        for result in results:  # running and queued alike
            assert isinstance(result, GenerationError)
            assert result.detail == message
        assert engine.generation_healthy is False
        metrics = metric_samples(engine)
        assert metrics["tgi_batch_current_size"] == 0
        assert metrics["tgi_queue_size"] == 0
        assert metrics["tgi_kv_cache_used_blocks"] == 0
        assert (
            metrics['tgi_batch_inference_failure_total{method="next_token",reason="connection"}']
            == 1
        )

    run(scenario())


def test_close_ends_running_and_queued_requests_and_refuses_new_ones() -> None:
    """The end of a drain: every live request gets the reason, the engine runs on (its
    steps in flight are answered and forgotten), a late submission is refused the same way."""

    async def scenario() -> None:
        shard = ScriptedShard()
        engine = make_engine(shard, batch_size=2)
        states = [engine.submit(request(1000), time.monotonic()) for _ in range(3)]  # 1 queued
        while len(states[1].generated_ids) < 3:
            await asyncio.sleep(0.005)
        assert engine.close("Server is shutting down: the request was ended") == 3
        results = [await final_event(s) for s in states]
        for result in results:
            assert isinstance(result, UnavailableError)
            assert str(result) == "Server is shutting down: the request was ended"
        with pytest.raises(UnavailableError, match="the request was ended"):
            engine.submit(request(5), time.monotonic())
        await asyncio.sleep(0.1)  # the steps in flight come back to finished requests
        forgotten = {i for p in shard.plans for i in p.finished_request_ids}
        await engine.stop()
        assert {s.request_id for s in states[:2]} <= forgotten
        metrics = metric_samples(engine)
        assert metrics["tgi_batch_current_size"] == 0
        assert metrics["tgi_queue_size"] == 0
        assert metrics["tgi_kv_cache_used_blocks"] == 0

    run(scenario())


def test_a_lost_shard_connection_is_retried_after_a_pause_not_in_a_spin() -> None:
    async def scenario() -> None:
        shard = ScriptedShard(lost_at_step=4)
        engine = make_engine(shard, start=False)
        engine.connection_retry_delay = 0.2
        engine.start()
        done = engine.submit(request(2), time.monotonic())
        assert isinstance(await final_event(done), TokenEvent)  # finished: to be forgotten
        failed = engine.submit(request(50), time.monotonic())
        result = await final_event(failed)
        assert isinstance(result, GenerationError)
        assert "step channel closed" in str(result)
        # The loop still yields: other tasks run while the shard is gone...
        ticks = 0
        for _ in range(10):
            await asyncio.sleep(0.05)
            ticks += 1
        # ...and the steps that tell the shard what to forget are re-sent about every
        # 0.2 s, not thousands of times.
        sent = shard.sent
        await asyncio.sleep(0.5)
        await engine.stop()
        assert ticks == 10
        assert 1 <= shard.sent - sent <= 4, shard.sent - sent

    run(scenario())


def test_abort_and_queue_deadline() -> None:
    async def scenario() -> None:
        shard = ScriptedShard()
        engine = make_engine(shard)
        state = engine.submit(request(1000), time.monotonic())
        await asyncio.sleep(0.02)
        engine.abort(state)
        await asyncio.sleep(0.02)
        assert state.finish_reason == StopReason.CANCELLED
        assert any(state.request_id in p.finished_request_ids for p in shard.plans)
        assert engine.scheduler.blocks.num_free == INFO.num_blocks
        expired = engine.submit(request(5, deadline=time.monotonic() - 1), time.monotonic())
        final = await final_event(expired)
        await engine.stop()
        assert isinstance(final, TokenEvent)
        assert (final.stop_reason, final.generated_token_count) == (StopReason.TIME_LIMIT, 0)

    run(scenario())


@pytest.mark.parametrize("budget", [1, 2])
def test_chunked_prefill_under_a_small_token_budget(budget: int) -> None:
    async def scenario() -> None:
        shard = ScriptedShard()
        engine = make_engine(shard, batch_tokens=budget)
        final = await final_event(engine.submit(request(2), time.monotonic()))
        await engine.stop()
        assert isinstance(final, TokenEvent) and final.generated_token_count == 2
        chunks = [c.num_tokens for p in shard.plans for c in p.scheduled]
        assert sum(chunks[:-1]) == 3 and max(chunks) <= budget

    run(scenario())


# ---- KV pressure, preemption, out of memory --------------------------------------------------


def gauge(engine: Engine, name: str) -> float:
    for line in engine.metrics.render().decode().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{name} not exported")


SMALL_KV = replace(INFO, num_blocks=8, block_size=4)


async def drained(engine: Engine, shard: ScriptedShard) -> None:
    """Wait until the engine has told the shard to forget everything."""
    for _ in range(200):
        if not engine.scheduler.has_work and not shard.seqs:
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"not drained: shard holds {sorted(shard.seqs)}")


def test_requests_beyond_kv_capacity_are_preempted_and_all_finish() -> None:
    async def scenario() -> None:
        shard = ScriptedShard()
        engine = make_engine(shard, info=SMALL_KV, batch_size=6)
        # Each needs 6 blocks at the end (3 + 20 tokens), 8 blocks in all.
        states = [engine.submit(request(20), time.monotonic()) for _ in range(6)]
        finals = [await final_event(s) for s in states]
        await drained(engine, shard)
        await engine.stop()
        for final in finals:
            assert isinstance(final, TokenEvent)
            assert (final.generated_token_count, final.stop_reason) == (20, StopReason.MAX_TOKENS)
        assert engine.scheduler.preemption_count > 0
        assert any(p.preempted_request_ids for p in shard.plans)
        assert engine.scheduler.blocks.num_free == SMALL_KV.num_blocks
        assert gauge(engine, "tgi_batch_current_size") == 0
        assert gauge(engine, "tgi_queue_size") == 0
        assert gauge(engine, "tgi_kv_cache_used_blocks") == 0

    run(scenario())


def test_out_of_memory_retries_without_the_younger_half() -> None:
    async def scenario() -> None:
        oomed: list[int] = []

        def oom_once(plan: StepPlan) -> bool:
            if not oomed and len(plan.scheduled) >= 4:
                oomed.append(plan.step_id)
                return True
            return False

        shard = ScriptedShard(oom_when=oom_once)
        engine = make_engine(shard)
        first = engine.submit(request(30), time.monotonic())
        await asyncio.sleep(0.02)
        others = [engine.submit(request(6), time.monotonic()) for _ in range(3)]
        finals = [await final_event(s) for s in (first, *others)]
        await drained(engine, shard)
        await engine.stop()
        assert oomed, "the scenario never ran out of memory"
        for final, count in zip(finals, (30, 6, 6, 6), strict=True):
            assert isinstance(final, TokenEvent) and final.generated_token_count == count
        # The step sent on top of the failed one was refused, then the retry ran.
        assert shard.stale == [oomed[0] + 1]
        retry = next(p for p in shard.plans if p.step_id > oomed[0])
        # The older half; the one the failed step announced is announced again.
        assert [c.request_id for c in retry.scheduled] == [first.request_id, others[0].request_id]
        assert [n.request_id for n in retry.new_sequences] == [others[0].request_id]
        failed = engine.metrics.counter("inference_failed")
        assert failed.value("next_token", "oom") + failed.value("prefill", "oom") == 1

    run(scenario())


def test_out_of_memory_again_on_the_retry_fails_its_requests() -> None:
    async def scenario() -> None:
        shard = ScriptedShard(oom_when=lambda plan: len(plan.scheduled) >= 2)
        engine = make_engine(shard)
        states = [engine.submit(request(8), time.monotonic()) for _ in range(4)]
        finals = [await final_event(s) for s in states]
        await drained(engine, shard)
        await engine.stop()
        # 4 → retry 2 → fails; the 2 preempted → retry 1 → succeeds... and so on: each
        # OOM costs at most the retried half, and nothing hangs.
        failed = [f for f in finals if isinstance(f, GenerationError)]
        done = [f for f in finals if isinstance(f, TokenEvent)]
        assert failed and done
        assert all(f.generated_token_count == 8 for f in done)  # type: ignore[union-attr]
        assert engine.scheduler.blocks.num_free == INFO.num_blocks

    run(scenario())


def test_a_preempted_request_cancelled_or_expired_in_the_queue() -> None:
    async def scenario() -> None:
        engine = make_engine(ScriptedShard(), start=False)
        now = time.monotonic()
        cancelled = engine.submit(request(9), now)
        expired = engine.submit(request(9, deadline=now + 100), now)
        for state in (cancelled, expired):  # as if they had run and been preempted
            state.known_to_shard = True
            state.preemptions = 1
            state.generated_ids = [300, 301]
        expired.detokenizer.push(300)
        engine.abort(cancelled)
        update = drop_aborted_and_expired(engine.scheduler, now + 101)
        assert update.cancelled == 1 and update.timed_out_in_queue == 0
        assert cancelled.finish_reason == StopReason.CANCELLED
        ((state, final),) = update.events
        assert state is expired and isinstance(final, TokenEvent)
        assert (final.stop_reason, final.generated_token_count) == (StopReason.TIME_LIMIT, 2)
        plan = engine.scheduler.schedule(now).plan
        assert sorted(plan.finished_request_ids) == [cancelled.request_id, expired.request_id]
        assert not engine.scheduler.has_work

    run(scenario())


def test_a_prefix_request_runs_and_the_batch_gauge_leaves_the_prefix_out() -> None:
    async def scenario() -> None:
        shard = ScriptedShard()
        engine = make_engine(shard, start=False)
        state = engine.submit(request(4, prefix=20), time.monotonic())
        engine.scheduler.schedule(time.monotonic())
        engine._update_gauges()
        metrics = metric_samples(engine)
        # TGIS's tgi_batch_input_tokens: input and generated tokens, no prefix ...
        assert metrics["tgi_batch_input_tokens"] == 3
        # ... while the KV blocks hold the prefix too: 23 tokens in blocks of 16.
        assert metrics["tgi_kv_cache_used_blocks"] == 2
        await engine.stop()

        engine = make_engine(shard)
        state = engine.submit(request(4, prefix=20), time.monotonic())
        final = await final_event(state)
        await engine.stop()
        assert isinstance(final, TokenEvent) and final.generated_token_count == 4
        (new,) = [n for p in shard.plans for n in p.new_sequences]
        assert (new.prefix_id, new.prefix_length, new.prompt_token_ids) == ("p", 20, (1, 50, 60))
        assert shard.plans[0].scheduled[0].num_tokens == 23

    run(scenario())
