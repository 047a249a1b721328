"""The engine loop against a scripted shard: batching, stopping, errors, cancellation.

The shard is the only stand-in here (the real one is exercised in tests/e2e); the
tokenizer is the embedded model's real one.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from tgis.embedded_model import MODEL_DIR
from tgis.router.engine import Engine
from tgis.router.errors import GenerationError
from tgis.router.metrics import Metrics
from tgis.router.request_state import RequestState, TokenEvent
from tgis.router.request_types import (
    GenerationParams,
    ResponseOptions,
    SamplingParams,
    StoppingParams,
    StopReason,
    ValidatedRequest,
)
from tgis.router.scheduler import SchedulerLimits
from tgis.router.shard_client import ShardError, ShardFailure
from tgis.router.step import ShardInfo, StepOutput, StepPlan, TokenDetail
from tgis.router.tokenization import RouterTokenizer

EOS = 2
INFO = ShardInfo(
    is_seq2seq=False,
    eos_token_ids=frozenset({EOS}),
    vocab_size=4096,
    block_size=16,
    num_blocks=64,
    world_size=1,
    max_position_embeddings=1024,
    model_type="llama",
    dtype="float32",
    device="cpu",
    attention_backend="scripted",
)


class ScriptedShard:
    """Returns token `100 + step` for every sequence whose prompt completes; records plans."""

    def __init__(self, fail_at_step: int | None = None, eos_at_step: int | None = None):
        self.plans: list[StepPlan] = []
        self.known: dict[int, int] = {}
        self.fail_at_step = fail_at_step
        self.eos_at_step = eos_at_step

    async def step(self, plan: StepPlan) -> StepOutput:
        await asyncio.sleep(0.001)
        self.plans.append(plan)
        if plan.step_id == self.fail_at_step:
            raise ShardError(ShardFailure.OOM, "GPU out of memory")
        for rid in plan.finished_ids:
            self.known.pop(rid, None)
        for seq in plan.new_sequences:
            self.known[seq.request_id] = len(seq.prompt_token_ids)
        tokens = {}
        for chunk in plan.scheduled:
            self.known[chunk.request_id] -= chunk.num_tokens
            if self.known[chunk.request_id] <= 0:
                self.known[chunk.request_id] = 1  # the sampled token is computed next step
                token = EOS if plan.step_id == self.eos_at_step else 300 + plan.step_id
                tokens[chunk.request_id] = TokenDetail(token)
        return StepOutput(tokens, {}, {}, 1000)

    async def health(self) -> None:
        return None


def request(max_new_tokens: int, deadline: float | None = None) -> ValidatedRequest:
    stopping = StoppingParams(max_new_tokens=max_new_tokens, deadline=deadline)
    sampling = SamplingParams()
    return ValidatedRequest(
        text="hello",
        input_ids=(1, 50, 60),
        params=GenerationParams(sampling, stopping, ResponseOptions()),
        stopping=stopping,
        sampling=sampling,
    )


def make_engine(shard: ScriptedShard, batch_tokens: int = 4096) -> Engine:
    engine = Engine(
        shard=shard,  # type: ignore[arg-type]
        info=INFO,
        tokenizer=RouterTokenizer(str(MODEL_DIR / "tokenizer.json")),
        limits=SchedulerLimits(max_batch_size=4, max_batch_tokens=batch_tokens),
        metrics=Metrics(max_sequence_length=1024, max_new_tokens=1023, max_batch_size=4),
    )
    engine.start()
    return engine


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
        finished_later = [p for p in shard.plans if short.request_id in p.finished_ids]
        assert len(finished_later) == 1

    run(scenario())


def test_eos_stops_and_shard_failure_fails_every_request_in_the_step() -> None:
    async def scenario() -> None:
        engine = make_engine(ScriptedShard(eos_at_step=3))
        final = await final_event(engine.submit(request(10), time.monotonic()))
        await engine.stop()
        assert isinstance(final, TokenEvent)
        assert (final.stop_reason, final.generated_token_count) == (StopReason.EOS_TOKEN, 3)

        engine = make_engine(ScriptedShard(fail_at_step=2))
        states = [engine.submit(request(10), time.monotonic()) for _ in range(2)]
        results = [await final_event(s) for s in states]
        assert engine.generation_healthy is False
        await engine.stop()
        for result in results:
            assert isinstance(result, GenerationError)
            assert str(result) == "Request failed during generation: GPU out of memory"

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
        assert any(state.request_id in p.finished_ids for p in shard.plans)
        assert engine.scheduler.allocator.unreserved == INFO.num_blocks
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
