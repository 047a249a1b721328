"""OpenTelemetry tracing (router/edge/tracing.py) in-process: the spans of Generate and
GenerateStream calls reach a stand-in OTLP collector with the right names, parents and
status; tracing is off, with one warning, when the packages are missing. With the whole
server: tests/e2e/test_operations_e2e.py."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from tests.guided_tokenizers import embedded_tokenizer_json
from tests.otlp_collector import ExportedSpan, OtlpCollector
from tests.router.fakes import Aborted, FakeContext, FakeEngine
from tests.router.servicers import make_servicer
from tgis.embedded_model import MODEL_DIR
from tgis.pb import generation_pb2 as pb
from tgis.router.config import TracingConfig
from tgis.router.edge.servicer import GenerationServicer
from tgis.router.edge.tracing import (
    MISSING_PACKAGES_WARNING,
    Tracing,
    otlp_target,
    setup_tracing,
)
from tgis.router.intake.adapters import AdapterKinds
from tgis.router.intake.concurrency import ConcurrencyLimiter
from tgis.router.intake.guided import GrammarCompiler
from tgis.router.intake.prefixes import PrefixInfos
from tgis.router.intake.tokenization import RouterTokenizer
from tgis.router.intake.validation import ServerLimits
from tgis.router.ops.metrics import Metrics
from tgis.shard_api.messages import AdapterInfo, AdapterKind, PrefixInfo

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT_ID = "b7ad6b7169203331"


async def _prefix_info(prefix_id: str) -> PrefixInfo:
    return PrefixInfo(2)


async def _lora(adapter_id: str) -> AdapterInfo:
    return AdapterInfo(AdapterKind.LORA)


@pytest.fixture
def engine() -> Iterator[FakeEngine]:
    tokenizer = RouterTokenizer(str(MODEL_DIR / "tokenizer.json"))
    yield FakeEngine(tokenizer)
    tokenizer.close()


def traced_servicer(
    engine: FakeEngine, tracing: Tracing, metrics: Metrics, **parts: Any
) -> GenerationServicer:
    """A servicer of ``engine`` with tracing on (``parts``: prefixes, adapters, grammars)."""
    return make_servicer(
        engine=engine,
        tokenizer=engine.tokenizer,
        limits=ServerLimits.from_args(64, 40),
        limiter=ConcurrencyLimiter(4),
        metrics=metrics,
        default_include_stop_seqs=True,
        is_seq2seq=False,
        tracing=tracing,
        **parts,
    )


def test_otlp_target() -> None:
    assert otlp_target("otel-collector:4317") == ("http://otel-collector:4317", True)
    assert otlp_target("http://c:4317") == ("http://c:4317", True)
    assert otlp_target("https://c:4317") == ("https://c:4317", False)


def test_off_without_an_endpoint_or_without_the_packages(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    assert setup_tracing(None) is None
    monkeypatch.setitem(sys.modules, "opentelemetry.exporter.otlp.proto.grpc.trace_exporter", None)
    with caplog.at_level(logging.WARNING, logger="tgis.router.edge.tracing"):
        assert setup_tracing(TracingConfig(endpoint="http://127.0.0.1:1")) is None
    assert [r.getMessage() for r in caplog.records] == [MISSING_PACKAGES_WARNING]


def test_the_router_imports_no_opentelemetry_until_tracing_is_on() -> None:
    code = (
        "import sys, tgis.router.cli, tgis.router.server, tgis.router.edge.servicer\n"
        "assert not [m for m in sys.modules if m.startswith('opentelemetry')]\n"
        "assert 'torch' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_spans_of_generate_and_stream_calls(
    engine: FakeEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    with OtlpCollector() as collector:
        tracing = setup_tracing(TracingConfig(endpoint=collector.endpoint, service_name="svc"))
        assert tracing is not None
        metrics = Metrics(max_sequence_length=64, max_new_tokens=40, max_batch_size=4)
        servicer = traced_servicer(
            engine,
            tracing,
            metrics,
            prefixes=PrefixInfos(_prefix_info, metrics),
            adapters=AdapterKinds(_lora),
        )

        async def calls() -> None:
            await servicer.Generate(
                pb.BatchedGenerationRequest(
                    requests=[pb.GenerationRequest(text="a"), pb.GenerationRequest(text="b c")],
                    prefix_id="tuned",
                    adapter_id="lora/x",
                ),
                FakeContext(  # type: ignore[arg-type]
                    ("traceparent", f"00-{TRACE_ID}-{PARENT_ID}-01"),
                    ("x-correlation-id", "traced-1"),
                ),
            )
            engine.fail = True
            request = pb.SingleGenerationRequest(request=pb.GenerationRequest(text="a"))
            with pytest.raises(Aborted):
                async for _ in servicer.GenerateStream(request, FakeContext()):  # type: ignore[arg-type]
                    pass

        asyncio.run(calls())
        tracing.shutdown(10)  # flushes
        spans = collector.spans

    roots = {s.name: s for s in spans if s.name.startswith("fmaas.")}
    unary, stream = (
        roots["fmaas.GenerationService/Generate"],
        roots["fmaas.GenerationService/GenerateStream"],
    )
    assert (unary.trace_id, unary.parent_span_id) == (TRACE_ID, PARENT_ID)  # W3C context
    assert unary.attributes["correlation_id"] == "traced-1"
    assert unary.attributes["rpc.method"] == "Generate"
    assert (unary.attributes["prefix_id"], unary.attributes["adapter_id"]) == ("tuned", "lora/x")
    assert stream.attributes["correlation_id"] == "<none>"
    assert "prefix_id" not in stream.attributes and "adapter_id" not in stream.attributes
    assert stream.parent_span_id == ""
    assert {s.service_name for s in spans} == {"svc"}

    def children(root: ExportedSpan) -> list[ExportedSpan]:
        return sorted(
            (s for s in spans if s.parent_span_id == root.span_id),
            key=lambda s: (s.name, s.attributes.get("input_index", 0)),
        )

    kids = children(unary)
    assert [s.name for s in kids] == ["inference", "inference", "queue", "queue", "validation"]
    assert all(s.trace_id == TRACE_ID for s in kids)
    validation = kids[-1]
    for span in kids:
        assert unary.start_ns <= span.start_ns <= span.end_ns <= unary.end_ns
    for queue, inference in zip(kids[2:4], kids[0:2], strict=True):
        assert queue.start_ns >= validation.end_ns
        assert queue.end_ns <= inference.start_ns  # admitted 10 ms after arrival
        assert inference.attributes["stop_reason"] == "EOS_TOKEN"
        assert queue.attributes["request_id"] == inference.attributes["request_id"]
    assert unary.status_code == 0  # unset: fine
    assert stream.status_code == 2  # error
    assert [s.name for s in children(stream)] == ["inference", "queue", "validation"]


def test_guided_compilation_is_a_span_under_validation(
    engine: FakeEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A call with a guided field gets a ``guided_compile`` span (its kind) inside its
    validation span; a refused constraint marks both with the compiler's message."""
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    metrics = Metrics(max_sequence_length=64, max_new_tokens=40, max_batch_size=4)
    grammars = GrammarCompiler(embedded_tokenizer_json, 4096, (2,), metrics)
    D = pb.DecodingParameters
    with OtlpCollector() as collector:
        tracing = setup_tracing(TracingConfig(endpoint=collector.endpoint))
        assert tracing is not None
        servicer = traced_servicer(engine, tracing, metrics, grammars=grammars)

        async def calls() -> None:
            for decoding, correlation in (
                (D(regex="a b"), "ok"),
                (D(regex="(unclosed"), "bad"),
                (D(), "plain"),
            ):
                params = pb.Parameters(decoding=decoding)
                request = pb.BatchedGenerationRequest(
                    requests=[pb.GenerationRequest(text="a")], params=params
                )
                context = FakeContext(("x-correlation-id", correlation))
                try:
                    await servicer.Generate(request, context)  # type: ignore[arg-type]
                except Aborted:
                    assert correlation == "bad"

        asyncio.run(calls())
        tracing.shutdown(10)
        spans = collector.spans
    grammars.close()

    roots = {s.attributes["correlation_id"]: s for s in spans if s.name.startswith("fmaas.")}
    by_parent: dict[str, list[ExportedSpan]] = {}
    for span in spans:
        by_parent.setdefault(span.parent_span_id, []).append(span)

    def validation_and_compile(root: ExportedSpan) -> tuple[ExportedSpan, list[ExportedSpan]]:
        (validation,) = [s for s in by_parent[root.span_id] if s.name == "validation"]
        return validation, by_parent.get(validation.span_id, [])

    validation, (compiled,) = validation_and_compile(roots["ok"])
    assert compiled.name == "guided_compile" and compiled.attributes["kind"] == "regex"
    assert validation.start_ns <= compiled.start_ns <= compiled.end_ns <= validation.end_ns
    assert (validation.status_code, compiled.status_code) == (0, 0)

    validation, (refused,) = validation_and_compile(roots["bad"])
    assert refused.status_code == 2 and refused.status_message.startswith("Invalid regex: ")
    assert validation.status_code == 2
    assert validation.status_message.endswith(refused.status_message)
    assert roots["bad"].status_code == 2

    validation, children = validation_and_compile(roots["plain"])
    assert children == [] and validation.status_code == 0
