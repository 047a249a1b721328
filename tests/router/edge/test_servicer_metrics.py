"""The servicer records the request-level metrics at TGIS's moments (spec §8.2, §2, §4.1).

A stand-in engine answers every input with two tokens; the tokenizer is the embedded
model's. The engine-side metrics (steps, queue, batch, KV cache) are tested in
tests/router/ops/test_metrics_exposition.py and end to end in tests/e2e/test_prometheus.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from tests.prometheus_tools import Exposition, parse_exposition
from tests.router.fakes import Aborted, FakeContext, FakeEngine, params
from tests.router.servicers import make_servicer
from tgis.embedded_model import MODEL_DIR
from tgis.pb import generation_pb2 as pb
from tgis.router.core.request_state import RequestState
from tgis.router.core.shard_client import ShardError, ShardFailure
from tgis.router.edge.servicer import GenerationServicer
from tgis.router.intake.concurrency import ConcurrencyLimiter
from tgis.router.intake.prefixes import PrefixInfos
from tgis.router.intake.tokenization import RouterTokenizer
from tgis.router.intake.validation import ServerLimits
from tgis.router.ops.metrics import Metrics
from tgis.router.request_types import ValidatedRequest
from tgis.shard_api.messages import PrefixInfo

MAX_SEQUENCE_LENGTH = 64
MAX_NEW_TOKENS = 40


@pytest.fixture
def tokenizer() -> Iterator[RouterTokenizer]:
    tok = RouterTokenizer(str(MODEL_DIR / "tokenizer.json"))
    yield tok
    tok.close()


@pytest.fixture
def metrics() -> Metrics:
    return Metrics(
        max_sequence_length=MAX_SEQUENCE_LENGTH, max_new_tokens=MAX_NEW_TOKENS, max_batch_size=4
    )


@pytest.fixture
def engine(tokenizer: RouterTokenizer) -> FakeEngine:
    return FakeEngine(tokenizer)


@pytest.fixture
def servicer(
    engine: FakeEngine, tokenizer: RouterTokenizer, metrics: Metrics
) -> GenerationServicer:
    return prefixed_servicer(engine, tokenizer, metrics, lookup=None)


def scrape(metrics: Metrics) -> Exposition:
    return parse_exposition(metrics.render().decode())


def generate(servicer: GenerationServicer, request: pb.BatchedGenerationRequest) -> Any:
    context = FakeContext()

    async def call() -> Any:
        try:
            return await servicer.Generate(request, context)  # type: ignore[arg-type]
        except Aborted:
            return context

    return asyncio.run(call())


def stream(servicer: GenerationServicer, request: pb.SingleGenerationRequest) -> Any:
    context = FakeContext()

    async def call() -> Any:
        try:
            return [m async for m in servicer.GenerateStream(request, context)]  # type: ignore[arg-type]
        except Aborted:
            return context

    return asyncio.run(call())


def test_single_generate_records_request_validation_and_success(
    servicer: GenerationServicer, tokenizer: RouterTokenizer, metrics: Metrics
) -> None:
    text = "The quick brown fox"
    length = len(tokenizer.encode(text))
    response = generate(
        servicer,
        pb.BatchedGenerationRequest(requests=[pb.GenerationRequest(text=text)], params=params(30)),
    )
    assert response.responses[0].generated_token_count == 2
    exp = scrape(metrics)
    assert exp.value("tgi_request_count", kind="single") == 1
    assert exp.value("tgi_request_input_count") == 1
    assert exp.value("tgi_request_raw_input_length_sum") == length
    assert exp.value("tgi_request_input_length_sum") == length
    assert exp.value("tgi_request_max_new_tokens_sum") == 30
    assert exp.value("tgi_request_validation_duration_count") == 1
    assert exp.value("tgi_request_success", stop_reason="EOS_TOKEN", kind="single") == 1
    assert exp.value("tgi_request_generated_tokens_sum") == 2
    assert exp.value("tgi_request_total_tokens_sum") == length + 2
    assert exp.value("tgi_request_duration_count") == 1
    assert exp.value("tgi_request_inference_duration_count") == 1
    assert exp.value("tgi_request_mean_time_per_token_duration_count") == 1
    # Queue time is recorded by the engine at admission (tests/router/core/test_engine.py).
    assert sum(s.value for s in exp.of("tgi_request_failure")) == 0


def test_batch_counts_each_input_and_the_requested_max_new_tokens(
    servicer: GenerationServicer, tokenizer: RouterTokenizer, metrics: Metrics
) -> None:
    long_text = " ".join(["word"] * 40)  # lowers max_new_tokens to fit: still 30 recorded
    texts = ["hello", long_text, "x"]
    generate(
        servicer,
        pb.BatchedGenerationRequest(
            requests=[pb.GenerationRequest(text=t) for t in texts], params=params(30)
        ),
    )
    exp = scrape(metrics)
    assert exp.value("tgi_request_count", kind="batch") == 1
    assert exp.value("tgi_request_input_count") == 3
    assert exp.value("tgi_request_max_new_tokens_sum") == 90
    assert exp.value("tgi_request_validation_duration_count") == 1
    assert exp.value("tgi_request_success", stop_reason="EOS_TOKEN", kind="batch") == 3
    assert exp.value("tgi_request_raw_input_length_count") == 3


def test_default_max_new_tokens_is_recorded_as_20(
    servicer: GenerationServicer, metrics: Metrics
) -> None:
    generate(servicer, pb.BatchedGenerationRequest(requests=[pb.GenerationRequest(text="hi")]))
    assert scrape(metrics).value("tgi_request_max_new_tokens_sum") == 20


def test_truncation_records_raw_and_truncated_lengths(
    servicer: GenerationServicer, tokenizer: RouterTokenizer, metrics: Metrics
) -> None:
    text = "one two three four five six seven eight"
    raw = len(tokenizer.encode(text))
    generate(
        servicer,
        pb.BatchedGenerationRequest(
            requests=[pb.GenerationRequest(text=text)], params=params(5, truncate=3)
        ),
    )
    exp = scrape(metrics)
    assert raw > 3
    assert exp.value("tgi_request_raw_input_length_sum") == raw
    assert exp.value("tgi_request_input_length_sum") == 3


def test_parameter_error_counts_validation_before_tokenizing(
    servicer: GenerationServicer, metrics: Metrics
) -> None:
    context = generate(
        servicer,
        pb.BatchedGenerationRequest(requests=[pb.GenerationRequest(text="x")], params=params(41)),
    )
    assert context.code == grpc.StatusCode.INVALID_ARGUMENT
    exp = scrape(metrics)
    assert exp.value("tgi_request_count", kind="single") == 1
    assert exp.value("tgi_request_input_count") == 1
    assert exp.value("tgi_request_failure", err="validation") == 1
    assert exp.value("tgi_request_raw_input_length_count") == 0
    assert exp.value("tgi_request_input_length_count") == 0
    assert exp.value("tgi_request_validation_duration_count") == 0


def test_too_long_input_records_its_raw_length_but_no_validated_metrics(
    servicer: GenerationServicer, metrics: Metrics
) -> None:
    context = generate(
        servicer,
        pb.BatchedGenerationRequest(
            requests=[pb.GenerationRequest(text=" ".join(["word"] * 100))], params=params(5)
        ),
    )
    assert context.code == grpc.StatusCode.INVALID_ARGUMENT
    exp = scrape(metrics)
    assert exp.value("tgi_request_failure", err="validation") == 1
    assert exp.value("tgi_request_raw_input_length_count") == 1
    assert exp.value("tgi_request_raw_input_length_sum") > MAX_SEQUENCE_LENGTH
    assert exp.value("tgi_request_input_length_count") == 0
    assert exp.value("tgi_request_max_new_tokens_count") == 0


def test_without_a_shard_every_prefix_is_a_failed_prompt_load(
    servicer: GenerationServicer, metrics: Metrics
) -> None:
    context = generate(
        servicer,
        pb.BatchedGenerationRequest(requests=[pb.GenerationRequest(text="x")], prefix_id="p"),
    )
    assert context.code == grpc.StatusCode.INVALID_ARGUMENT
    assert context.details == "can't retrieve prompt prefix with id 'p': prefix id \"p\" not found"
    exp = scrape(metrics)
    assert exp.value("tgi_prompt_load_failure") == 1
    assert exp.value("tgi_prompt_load_failure_total") == 1
    assert exp.value("tgi_request_failure", err="validation") == 1
    # The prefix is looked up before tokenizing: no input was tokenized.
    assert exp.value("tgi_request_raw_input_length_count") == 0


def prefixed_servicer(
    engine: FakeEngine, tokenizer: RouterTokenizer, metrics: Metrics, lookup: Any
) -> GenerationServicer:
    """The servicer under test; ``lookup`` answers prefix lookups (None: no prefixes)."""
    return make_servicer(
        engine=engine,
        tokenizer=tokenizer,
        limits=ServerLimits.from_args(MAX_SEQUENCE_LENGTH, MAX_NEW_TOKENS),
        limiter=ConcurrencyLimiter(4),
        metrics=metrics,
        default_include_stop_seqs=True,
        is_seq2seq=False,
        prefixes=None if lookup is None else PrefixInfos(lookup, metrics),
    )


def test_a_known_prefix_is_validated_with_and_recorded_without(
    engine: FakeEngine, tokenizer: RouterTokenizer, metrics: Metrics
) -> None:
    submitted: list[ValidatedRequest] = []
    submit = engine.submit

    def record(request: ValidatedRequest, arrival: float) -> RequestState:
        submitted.append(request)
        return submit(request, arrival)

    engine.submit = record  # type: ignore[method-assign]

    async def lookup(prefix_id: str) -> PrefixInfo:
        return PrefixInfo({"pt": 30}[prefix_id], "v1")

    servicer = prefixed_servicer(engine, tokenizer, metrics, lookup)
    texts = ["The quick brown fox", "hello"]
    request = pb.BatchedGenerationRequest(
        requests=[pb.GenerationRequest(text=t) for t in texts], prefix_id="pt", params=params(40)
    )
    response = generate(servicer, request)
    lengths = [len(tokenizer.encode(t)) for t in texts]
    assert [r.input_token_count for r in response.responses] == lengths
    assert [(v.prefix_id, v.prefix_length, v.prefix_version) for v in submitted] == [
        ("pt", 30, "v1")
    ] * 2
    # 40 new tokens after 30 + input do not fit in 64: lowered, the prefix counted.
    assert [v.stopping.max_new_tokens for v in submitted] == [
        MAX_SEQUENCE_LENGTH - 30 - n for n in lengths
    ]
    exp = scrape(metrics)
    assert exp.value("tgi_request_input_length_sum") == sum(lengths)
    assert exp.value("tgi_request_total_tokens_sum") == sum(lengths) + 2 * 2
    assert exp.value("tgi_prompt_load_duration_count") == 1
    # A longer input no longer fits with the prefix (rule 14 counts it).
    long_text = " ".join(["word"] * 40)
    n = len(tokenizer.encode(long_text))
    context = generate(
        servicer,
        pb.BatchedGenerationRequest(
            requests=[pb.GenerationRequest(text=long_text)], prefix_id="pt"
        ),
    )
    assert context.code == grpc.StatusCode.INVALID_ARGUMENT
    assert context.details == (
        f"input tokens ({n}) plus prefix length (30) must be < {MAX_SEQUENCE_LENGTH}"
    )
    assert scrape(metrics).value("tgi_prompt_load_duration_count") == 1  # cached


def test_a_shard_failure_during_the_lookup_is_a_validation_error(
    engine: FakeEngine, tokenizer: RouterTokenizer, metrics: Metrics
) -> None:
    async def lookup(prefix_id: str) -> PrefixInfo:
        raise ShardError(ShardFailure.CONNECTION, "Could not connect to Text Generation server")

    servicer = prefixed_servicer(engine, tokenizer, metrics, lookup)
    context = stream(
        servicer,
        pb.SingleGenerationRequest(request=pb.GenerationRequest(text="x"), prefix_id="pt"),
    )
    assert context.code == grpc.StatusCode.INVALID_ARGUMENT
    assert context.details == (
        "can't retrieve prompt prefix with id 'pt': Could not connect to Text Generation server"
    )
    exp = scrape(metrics)
    assert exp.value("tgi_prompt_load_failure") == 1
    assert exp.value("tgi_request_failure", err="validation") == 1


def test_concurrency_limit(servicer: GenerationServicer, metrics: Metrics) -> None:
    context = generate(
        servicer, pb.BatchedGenerationRequest(requests=[pb.GenerationRequest(text="x")] * 5)
    )
    assert context.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    exp = scrape(metrics)
    assert exp.value("tgi_request_count", kind="batch") == 1
    assert exp.value("tgi_request_input_count") == 5
    assert exp.value("tgi_request_failure", err="conc_limit") == 1


def test_empty_batch_counts_the_call_only(servicer: GenerationServicer, metrics: Metrics) -> None:
    generate(servicer, pb.BatchedGenerationRequest())
    exp = scrape(metrics)
    assert exp.value("tgi_request_count", kind="batch") == 1
    assert exp.value("tgi_request_input_count") == 0


def test_generation_error_counts_generate_once_per_rpc(
    servicer: GenerationServicer, engine: FakeEngine, metrics: Metrics
) -> None:
    engine.fail = True
    context = generate(
        servicer, pb.BatchedGenerationRequest(requests=[pb.GenerationRequest(text="x")] * 2)
    )
    assert context.code == grpc.StatusCode.UNKNOWN
    exp = scrape(metrics)
    assert exp.value("tgi_request_failure", err="generate") == 1
    assert sum(s.value for s in exp.of("tgi_request_success")) == 0
    assert exp.value("tgi_request_duration_count") == 0


def test_stream_success_and_error(
    servicer: GenerationServicer, engine: FakeEngine, metrics: Metrics
) -> None:
    request = pb.SingleGenerationRequest(request=pb.GenerationRequest(text="hi"), params=params(3))
    messages = stream(servicer, request)
    assert messages[-1].stop_reason == pb.EOS_TOKEN
    engine.fail = True
    context = stream(servicer, request)
    assert context.code == grpc.StatusCode.UNKNOWN
    exp = scrape(metrics)
    assert exp.value("tgi_request_count", kind="stream") == 2
    assert exp.value("tgi_request_input_count") == 2
    assert exp.value("tgi_request_success", stop_reason="EOS_TOKEN", kind="stream") == 1
    assert exp.value("tgi_request_failure", err="generate") == 1
    assert exp.value("tgi_request_validation_duration_count") == 2


def test_tokenize(
    servicer: GenerationServicer, tokenizer: RouterTokenizer, metrics: Metrics
) -> None:
    texts = ["hello world", "The quick brown fox"]

    async def call() -> Any:
        request = pb.BatchedTokenizeRequest(requests=[pb.TokenizeRequest(text=t) for t in texts])
        return await servicer.Tokenize(request, FakeContext())  # type: ignore[arg-type]

    asyncio.run(call())
    exp = scrape(metrics)
    assert exp.value("tgi_tokenize_request_count") == 1
    assert exp.value("tgi_tokenize_request_input_count") == 2
    assert exp.value("tgi_tokenize_request_tokens_sum") == sum(
        len(tokenizer.encode(t)) for t in texts
    )
    assert exp.value("tgi_tokenize_request_duration_count") == 1
    # Tokenize is no generate call.
    assert sum(s.value for s in exp.of("tgi_request_count")) == 0


def test_max_client_batch_size_refuses_larger_batches_only(
    engine: FakeEngine, tokenizer: RouterTokenizer, metrics: Metrics
) -> None:
    capped = make_servicer(
        engine=engine,
        tokenizer=tokenizer,
        limits=ServerLimits.from_args(MAX_SEQUENCE_LENGTH, MAX_NEW_TOKENS, max_client_batch_size=2),
        limiter=ConcurrencyLimiter(4),
        metrics=metrics,
        default_include_stop_seqs=True,
        is_seq2seq=False,
    )
    two = pb.BatchedGenerationRequest(requests=[pb.GenerationRequest(text="a")] * 2)
    assert len(generate(capped, two).responses) == 2
    three = pb.BatchedGenerationRequest(requests=[pb.GenerationRequest(text="a")] * 3)
    refused = generate(capped, three)
    assert refused.code == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.details == (
        "batch size 3 exceeds the limit of 2 inputs per request (max_client_batch_size)"
    )
    assert scrape(metrics).value("tgi_request_failure", err="validation") == 1
