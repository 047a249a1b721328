"""Draining after SIGTERM, in-process: calls in flight are counted and run to their end,
new generation calls get UNAVAILABLE, GET /health answers 503 at once. (The whole sequence
with real processes: tests/e2e/test_operations_e2e.py.)"""

from __future__ import annotations

import asyncio

import grpc
import pytest
from aiohttp.test_utils import TestClient, TestServer

from tests.router.fakes import Aborted, FakeContext, FakeEngine
from tests.router.servicers import make_servicer
from tgis.embedded_model import MODEL_DIR
from tgis.pb import generation_pb2 as pb
from tgis.router.edge.http_server import build_app
from tgis.router.intake.concurrency import ConcurrencyLimiter
from tgis.router.intake.tokenization import RouterTokenizer
from tgis.router.intake.validation import ServerLimits
from tgis.router.ops.drain import Drain
from tgis.router.ops.metrics import Metrics


def test_drain_counts_calls_and_waits_for_the_last() -> None:
    async def scenario() -> None:
        drain = Drain()
        assert await drain.wait_idle(0.01)
        assert drain.enter() and drain.enter()
        drain.start()
        assert not drain.enter()  # refused, not counted
        assert drain.active == 2
        assert not await drain.wait_idle(0.01)
        asyncio.get_running_loop().call_later(0.02, drain.exit)
        asyncio.get_running_loop().call_later(0.04, drain.exit)
        assert await drain.wait_idle(5)
        assert drain.active == 0

    asyncio.run(scenario())


def test_new_generation_calls_are_refused_while_draining() -> None:
    tokenizer = RouterTokenizer(str(MODEL_DIR / "tokenizer.json"))
    drain = Drain()
    servicer = make_servicer(
        engine=FakeEngine(tokenizer),
        tokenizer=tokenizer,
        limits=ServerLimits.from_args(64, 40),
        limiter=ConcurrencyLimiter(4),
        metrics=Metrics(max_sequence_length=64, max_new_tokens=40, max_batch_size=4),
        default_include_stop_seqs=True,
        is_seq2seq=False,
        drain=drain,
    )

    async def scenario() -> None:
        unary = pb.BatchedGenerationRequest(requests=[pb.GenerationRequest(text="a")])
        stream = pb.SingleGenerationRequest(request=pb.GenerationRequest(text="a"))
        # A stream that started before the signal goes on to its end after it.
        running = servicer.GenerateStream(stream, FakeContext())  # type: ignore[arg-type]
        first = await anext(running)
        assert drain.active == 1
        drain.start()
        refused_unary, refused_stream = FakeContext(), FakeContext()
        with pytest.raises(Aborted, match=r"^Server is shutting down$"):
            await servicer.Generate(unary, refused_unary)  # type: ignore[arg-type]
        with pytest.raises(Aborted, match=r"^Server is shutting down$"):
            await anext(servicer.GenerateStream(stream, refused_stream))  # type: ignore[arg-type]
        # UNAVAILABLE: a retrying client (or the mesh) goes to another replica.
        assert refused_unary.code == refused_stream.code == grpc.StatusCode.UNAVAILABLE
        rest = [message async for message in running]
        assert first.input_token_count > 0
        assert rest[-1].stop_reason == pb.EOS_TOKEN
        assert drain.active == 0
        assert servicer.admission.limiter.in_use == 0
        info = await servicer.ModelInfo(pb.ModelInfoRequest(), FakeContext())  # type: ignore[arg-type]
        assert info.max_new_tokens == 40  # the cheap RPCs are still answered

    asyncio.run(scenario())
    tokenizer.close()


def test_health_is_503_at_once_while_draining() -> None:
    class NeverAsked:
        async def check(self) -> bool:
            raise AssertionError("no generation check while draining")

    async def scenario() -> None:
        drain = Drain()
        metrics = Metrics(max_sequence_length=64, max_new_tokens=40, max_batch_size=4)
        app = build_app(NeverAsked(), metrics, drain)  # type: ignore[arg-type]
        async with TestClient(TestServer(app)) as client:
            drain.start()
            response = await client.get("/health")
            assert response.status == 503
            assert await response.json() == {"error": "shutting down"}
            assert (await client.get("/metrics")).status == 200

    asyncio.run(scenario())
