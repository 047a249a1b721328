"""x-correlation-id: read from the metadata, on every log line the servicer writes about the
call (its task) and on the engine's lines about the request (the engine's own task)."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import time
from collections.abc import Iterator

import pytest

from tests.router.core.scripted_shard import ScriptedShard, make_engine, request
from tests.router.fakes import Aborted, FakeContext, FakeEngine, params
from tests.router.servicers import make_servicer
from tgis.embedded_model import MODEL_DIR
from tgis.log import (
    ContextFieldsFilter,
    JsonFormatter,
    bind_log_fields,
    current_log_fields,
    reset_log_fields,
)
from tgis.pb import generation_pb2 as pb
from tgis.router.core.shard_client import ShardFailure
from tgis.router.edge.servicer import GenerationServicer
from tgis.router.intake.concurrency import ConcurrencyLimiter
from tgis.router.intake.tokenization import RouterTokenizer
from tgis.router.intake.validation import ServerLimits
from tgis.router.ops.metrics import Metrics
from tgis.router.ops.request_context import NO_CORRELATION_ID, correlation_id


@pytest.fixture
def engine() -> Iterator[FakeEngine]:
    tokenizer = RouterTokenizer(str(MODEL_DIR / "tokenizer.json"))
    yield FakeEngine(tokenizer)
    tokenizer.close()


@pytest.fixture
def servicer(engine: FakeEngine) -> GenerationServicer:
    return make_servicer(
        engine=engine,
        tokenizer=engine.tokenizer,
        limits=ServerLimits.from_args(64, 40),
        limiter=ConcurrencyLimiter(4),
        metrics=Metrics(max_sequence_length=64, max_new_tokens=40, max_batch_size=4),
        default_include_stop_seqs=True,
        is_seq2seq=False,
    )


@pytest.fixture
def json_lines() -> Iterator[io.StringIO]:
    """What tgis.* loggers write, formatted as --json-output does."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.addFilter(ContextFieldsFilter())
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger("tgis")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield stream
    logger.removeHandler(handler)
    logger.setLevel(level)


def entries(stream: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_correlation_id_from_metadata() -> None:
    assert correlation_id((("X-Correlation-ID", "abc-1"),)) == "abc-1"
    assert correlation_id((("other", "x"), ("x-correlation-id", b"bytes-id"))) == "bytes-id"
    assert correlation_id((("x-correlation-id", "a\nb\x00c"),)) == "abc"
    assert correlation_id((("x-correlation-id", "z" * 1000),)) == "z" * 256
    assert correlation_id(()) == NO_CORRELATION_ID == "<none>"
    assert correlation_id(None) == "<none>"


def test_every_servicer_line_of_a_call_carries_its_correlation_id(
    servicer: GenerationServicer, engine: FakeEngine, json_lines: io.StringIO
) -> None:
    async def calls() -> None:
        ok = FakeContext(("x-correlation-id", "unary-1"))
        await servicer.Generate(
            pb.BatchedGenerationRequest(
                requests=[pb.GenerationRequest(text="a"), pb.GenerationRequest(text="b")],
                params=params(5),
            ),
            ok,  # type: ignore[arg-type]
        )
        streamed = FakeContext(("x-correlation-id", "stream-2"))
        request = pb.SingleGenerationRequest(request=pb.GenerationRequest(text="a"))
        async for _ in servicer.GenerateStream(request, streamed):  # type: ignore[arg-type]
            pass
        engine.fail = True
        with pytest.raises(Aborted):
            await servicer.Generate(
                pb.BatchedGenerationRequest(requests=[pb.GenerationRequest(text="a")]),
                FakeContext(),  # type: ignore[arg-type]
            )
        # Nothing leaks into the caller's context once a call is over.
        assert current_log_fields() == {}

    asyncio.run(calls())
    lines = entries(json_lines)
    by_id: dict[object, list[str]] = {}
    for entry in lines:
        by_id.setdefault(entry.get("correlation_id"), []).append(str(entry["message"]))
    assert [m.split(" generated")[0] for m in by_id["unary-1"]] == [
        "Sub-request 0 from batch of 2",
        "Sub-request 1 from batch of 2",
    ]
    assert by_id["stream-2"] == [
        "Streaming response generated 2 tokens before EOS_TOKEN, output 3 bytes: 'a b'"
    ]
    assert by_id["<none>"] == ["Request failed: Request failed during generation: boom"]
    assert None not in by_id, lines


def test_engine_lines_about_a_request_carry_its_correlation_id(json_lines: io.StringIO) -> None:
    async def scenario() -> None:
        engine = make_engine(ScriptedShard(fail_at_step=2, failure=ShardFailure.ERROR))
        token = bind_log_fields(correlation_id="engine-3")  # as the servicer's task does
        state = engine.submit(request(10), time.monotonic())
        reset_log_fields(token)
        other = engine.submit(request(10), time.monotonic())  # no id bound
        assert (state.correlation_id, other.correlation_id) == ("engine-3", None)
        for s in (state, other):
            while not isinstance(await asyncio.wait_for(s.events.get(), 10), BaseException):
                pass
        await engine.stop()
        failures = [e for e in entries(json_lines) if str(e["message"]).startswith("request ")]
        assert {
            (e["target"], e.get("correlation_id"), e["request_id"], e["message"]) for e in failures
        } == {
            (
                "tgis.router.core.engine",
                "engine-3",
                state.request_id,
                f"request {state.request_id} failed: "
                "Request failed during generation: GPU out of memory",
            ),
            (
                "tgis.router.core.engine",
                None,
                other.request_id,
                f"request {other.request_id} failed: "
                "Request failed during generation: GPU out of memory",
            ),
        }

    asyncio.run(scenario())
