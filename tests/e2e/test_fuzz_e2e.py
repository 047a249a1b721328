"""Hostile requests against a real launched server (tiny random Llama): a bounded,
reproducible sample of ``benchmarks/fuzz.py``'s cases, then the nastiest inputs one by one
with the exact status each must get. Afterwards the server must be healthy and idle.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from tests.e2e.models import save_tiny_llama
from tests.e2e.server import LauncherProcess, healthy_launcher
from tgis.pb import generation_pb2 as pb

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import fuzz  # benchmarks/fuzz.py: the strategies and the runner

pytestmark = pytest.mark.slow

SAMPLE_REQUESTS = 1500
"""The random sample's size: about a minute on a 2-core machine (no 1 MB texts there)."""

BIG_RPC_LIMIT = fuzz.ROUTER_MAX_MESSAGE_BYTES


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LauncherProcess]:
    model = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_llama(model)
    with healthy_launcher(
        tmp_path_factory.mktemp("fuzz"), ["--model-name", str(model)]
    ) as launcher:
        yield launcher


@pytest.fixture(scope="module")
def channel(server: LauncherProcess) -> Iterator[grpc.Channel]:
    options = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
    with grpc.insecure_channel(server.grpc_target, options=options) as ch:
        yield ch


def call(channel: grpc.Channel, rpc: str, data: bytes) -> tuple[str, str]:
    """Send raw bytes to ``rpc``; (status name, message), replies read to the end."""
    _, response_type, streaming = fuzz.RPCS[rpc]
    method = fuzz.SERVICE + rpc
    try:
        if streaming:
            list(channel.unary_stream(method, None, response_type.FromString)(data, timeout=120))
        else:
            channel.unary_unary(method, None, response_type.FromString)(data, timeout=120)
    except grpc.RpcError as err:
        assert isinstance(err, grpc.Call)
        return err.code().name, err.details() or ""
    return "OK", ""


def assert_healthy_and_idle(server: LauncherProcess) -> None:
    assert server.http_get("/health")[0] == 200
    gauges = fuzz.settled_gauges(server.metrics_url, 60.0)
    assert gauges == dict.fromkeys(fuzz.GAUGES, 0.0), gauges


# ---- the random sample -----------------------------------------------------------------------


def test_random_sample_gets_only_documented_statuses(server: LauncherProcess) -> None:
    report = fuzz.run_fuzz(
        server.grpc_target,
        SAMPLE_REQUESTS,
        seed=None,  # derandomized: the same cases every run
        threads=6,
        huge=False,
        http=f"127.0.0.1:{server.http_port}",
    )
    findings = "\n".join(
        f"{f.rpc} {f.status} {f.message!r}: {f.request}" for f in report.disallowed
    )
    assert not report.disallowed, findings
    assert report.requests >= SAMPLE_REQUESTS * 0.9
    # every RPC got results and refusals, not only one or the other
    for rpc in ("Generate", "GenerateStream", "Tokenize"):
        assert {"OK", "INVALID_ARGUMENT"} <= set(report.statuses[rpc]), report.statuses
    assert report.health == 200
    assert report.gauges == dict.fromkeys(fuzz.GAUGES, 0.0)


# ---- the nastiest inputs, one by one ---------------------------------------------------------


def text_request(rpc: str, text: str = "hello", **params: Any) -> Any:
    """A one-input request of ``rpc`` with ``params`` (a ``pb.Parameters``'s fields)."""
    parameters = pb.Parameters(**params)
    if rpc == "Generate":
        return pb.BatchedGenerationRequest(
            requests=[pb.GenerationRequest(text=text)], params=parameters
        )
    return pb.SingleGenerationRequest(request=pb.GenerationRequest(text=text), params=parameters)


def _set_fields(message: Any) -> Iterator[tuple[Any, Any]]:
    """(field descriptor, value) of every field set in ``message`` and its sub-messages,
    the innermost last."""
    for field, value in message.ListFields():
        yield field, value
        if field.type == field.TYPE_MESSAGE:
            for child in value if field.is_repeated else [value]:
                yield from _set_fields(child)


def one_token(**params: Any) -> dict[str, Any]:
    return {"stopping": pb.StoppingCriteria(max_new_tokens=1), **params}


P = fuzz.PLACEHOLDER
STRING_FIELDS = [
    ("Generate", pb.BatchedGenerationRequest(model_id=P)),
    ("Generate", pb.BatchedGenerationRequest(prefix_id=P)),
    ("Generate", pb.BatchedGenerationRequest(adapter_id=P)),
    ("Generate", text_request("Generate", P)),
    ("Generate", text_request("Generate", stopping=pb.StoppingCriteria(stop_sequences=["s", P]))),
    ("GenerateStream", pb.SingleGenerationRequest(model_id=P)),
    ("GenerateStream", pb.SingleGenerationRequest(prefix_id=P)),
    ("GenerateStream", pb.SingleGenerationRequest(adapter_id=P)),
    ("GenerateStream", text_request("GenerateStream", P)),
    (
        "GenerateStream",
        text_request("GenerateStream", stopping=pb.StoppingCriteria(stop_sequences=[P])),
    ),
    ("Tokenize", pb.BatchedTokenizeRequest(model_id=P)),
    ("Tokenize", pb.BatchedTokenizeRequest(prefix_id=P)),
    ("Tokenize", pb.BatchedTokenizeRequest(adapter_id=P)),
    (
        "Tokenize",
        pb.BatchedTokenizeRequest(
            requests=[pb.TokenizeRequest(text="t"), pb.TokenizeRequest(text=P)]
        ),
    ),
    ("ModelInfo", pb.ModelInfoRequest(model_id=P)),
]
"""Every string field of every request message, holding the placeholder."""
STRING_FIELD_IDS = [
    f"{rpc}-{field.name}"
    for rpc, message in STRING_FIELDS
    for field in [[f for f, v in _set_fields(message) if P in str(v)][-1]]
]


@pytest.mark.parametrize("bad", fuzz.INVALID_UTF8, ids=repr)
@pytest.mark.parametrize(("rpc", "message"), STRING_FIELDS, ids=STRING_FIELD_IDS)
def test_invalid_utf8_in_each_string_field(
    channel: grpc.Channel, rpc: str, message: Any, bad: bytes
) -> None:
    data = fuzz.patch_placeholder(message.SerializeToString(), bad, 3)
    name = type(message).DESCRIPTOR.full_name
    assert call(channel, rpc, data) == (
        "INVALID_ARGUMENT",
        f"request is not a valid {name} message: String field had bad UTF-8",
    )


@pytest.mark.parametrize("rpc", ["Generate", "GenerateStream", "Tokenize", "ModelInfo"])
def test_corrupt_and_truncated_messages(channel: grpc.Channel, rpc: str) -> None:
    request_type = fuzz.RPCS[rpc][0].DESCRIPTOR.full_name
    for data in (b"\xff\xff\xff", fuzz.tag(1, 2) + fuzz.varint(100) + b"abc"):
        assert call(channel, rpc, data) == (
            "INVALID_ARGUMENT",
            f"request is not a valid {request_type} message: Wire format was corrupt",
        )


FLOAT_FIELDS = [
    ("temperature", one_token(method=pb.SAMPLE), "sampling"),
    ("top_p", one_token(method=pb.SAMPLE), "sampling"),
    ("typical_p", one_token(method=pb.SAMPLE), "sampling"),
    ("repetition_penalty", one_token(), "decoding"),
]


@pytest.mark.parametrize("rpc", ["Generate", "GenerateStream"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf], ids=str)
@pytest.mark.parametrize(("name", "base", "owner"), FLOAT_FIELDS, ids=[f[0] for f in FLOAT_FIELDS])
def test_non_finite_floats(
    channel: grpc.Channel, rpc: str, value: float, name: str, base: dict[str, Any], owner: str
) -> None:
    sub: Any = pb.SamplingParameters if owner == "sampling" else pb.DecodingParameters
    params: dict[str, Any] = {**base, owner: sub(**{name: value})}
    request = text_request(rpc, **params)
    status = call(channel, rpc, request.SerializeToString())
    assert status == ("INVALID_ARGUMENT", f"{name} must be a finite number")


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf], ids=str)
def test_non_finite_decay_factor(channel: grpc.Channel, value: float) -> None:
    penalty = pb.DecodingParameters.LengthPenalty(decay_factor=value)
    request = text_request(
        "Generate", **one_token(decoding=pb.DecodingParameters(length_penalty=penalty))
    )
    assert call(channel, "Generate", request.SerializeToString()) == (
        "INVALID_ARGUMENT",
        "length_penalty must be >= 1.0 and <= 10.0",
    )


def test_signalling_nan_on_the_wire(channel: grpc.Channel) -> None:
    request = text_request("Generate", **one_token())
    data = request.SerializeToString() + fuzz.WIRE_SUFFIXES["signalling NaN temperature"]
    assert call(channel, "Generate", data) == (
        "INVALID_ARGUMENT",
        "temperature must be a finite number",
    )


@pytest.mark.parametrize("method", [2, 77, -5, (1 << 31) - 1])
def test_unknown_decoding_method_is_greedy(channel: grpc.Channel, method: int) -> None:
    """TGIS treats any method but SAMPLE as greedy (spec §1.3): a result, seed 0."""
    data = text_request("Generate", **one_token()).SerializeToString()
    data += fuzz.length_delimited(10, fuzz.tag(1, 0) + fuzz.varint(method))
    assert call(channel, "Generate", data) == ("OK", "")


def test_overlong_varint_for_uint32(channel: grpc.Channel) -> None:
    """max_new_tokens given as 2^64-1 is read as 2^32-1: over the server limit."""
    data = text_request("Generate").SerializeToString()
    data += fuzz.WIRE_SUFFIXES["uint32 field with a 64-bit varint"]
    status, details = call(channel, "Generate", data)
    assert status == "INVALID_ARGUMENT"
    assert details.startswith("max_new_tokens must be <= ")


@pytest.mark.parametrize("rpc", ["Generate", "Tokenize"])
def test_message_over_the_size_limit(channel: grpc.Channel, rpc: str) -> None:
    case = fuzz.Case(rpc, b"", "oversize", oversize=BIG_RPC_LIMIT + 1)
    status, details = call(channel, rpc, case.body())
    assert status == "RESOURCE_EXHAUSTED"
    assert "Received message larger than max" in details


def test_one_megabyte_text(channel: grpc.Channel) -> None:
    text = fuzz._repeat_to("ab😀 ", fuzz.ONE_MB)
    generate = text_request("Generate", text, **one_token())
    status, details = call(channel, "Generate", generate.SerializeToString())
    assert status == "INVALID_ARGUMENT"
    assert details.startswith("input tokens (") and details.endswith("must be < 256")
    tokenize = pb.BatchedTokenizeRequest(requests=[pb.TokenizeRequest(text=text)])
    assert call(channel, "Tokenize", tokenize.SerializeToString()) == ("OK", "")


def test_huge_repeated_fields(channel: grpc.Channel) -> None:
    batch = pb.BatchedGenerationRequest(
        requests=[pb.GenerationRequest(text="a")] * 10_000, params=pb.Parameters(**one_token())
    )
    assert call(channel, "Generate", batch.SerializeToString()) == (
        "RESOURCE_EXHAUSTED",
        "Model is overloaded",
    )
    stops = pb.StoppingCriteria(max_new_tokens=1, stop_sequences=["x"] * 1000)
    assert call(
        channel, "Generate", text_request("Generate", stopping=stops).SerializeToString()
    ) == (
        "INVALID_ARGUMENT",
        "can specify at most 6 non-empty stop sequences, each not more than 240 UTF8 bytes",
    )
    tokenize = pb.BatchedTokenizeRequest(requests=[pb.TokenizeRequest(text="a b")] * 10_000)
    assert call(channel, "Tokenize", tokenize.SerializeToString()) == ("OK", "")


def test_healthy_and_idle_afterwards(server: LauncherProcess) -> None:
    """Last in the module: whatever ran before, nothing is left running or held."""
    assert_healthy_and_idle(server)
