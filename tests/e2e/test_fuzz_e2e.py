"""Hostile requests against a real launched server (tiny random Llama, the embedded
tokenizer, a chat template): a bounded, reproducible sample of ``benchmarks/fuzz.py``'s
cases on both APIs (gRPC and the OpenAI routes), then the nastiest inputs one by one with
the exact status each must get, guided decoding's edges and OpenAI bodies included.
Afterwards the server must be healthy and idle.
"""

from __future__ import annotations

import json
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
import fuzz_guided
import fuzz_openai

pytestmark = pytest.mark.slow

SAMPLE_REQUESTS = 1500
"""The random sample's size: about a minute on a 2-core machine (no 1 MB texts there)."""

BIG_RPC_LIMIT = fuzz.ROUTER_MAX_MESSAGE_BYTES


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LauncherProcess]:
    model = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_llama(model)
    with healthy_launcher(tmp_path_factory.mktemp("fuzz"), fuzz.server_args(model)) as launcher:
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
    # every RPC and route got results and refusals, not only one or the other
    for rpc in ("Generate", "GenerateStream", "Tokenize"):
        assert {"OK", "INVALID_ARGUMENT"} <= set(report.statuses[rpc]), report.statuses
    for route in fuzz_openai.ROUTES:
        assert {"200", "400"} <= set(report.statuses[f"POST {route}"]), report.statuses
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


# ---- guided decoding's edges (gRPC) ----------------------------------------------------------

D = pb.DecodingParameters
CHOICES_5000 = fuzz_guided.large_choices(5000, False, "-", "o")
TOO_DEEP = "json_schema is nested too deeply for the grammar compiler"


def guided_call(
    channel: grpc.Channel, rpc: str, decoding: pb.DecodingParameters, **stopping: Any
) -> tuple[str, str, Any]:
    """A greedy guided call with token details: (status, message, the result: text, stop
    reason, generated_token_count and how many tokens the details hold)."""
    request = text_request(
        rpc,
        "Pick one:",
        stopping=pb.StoppingCriteria(**{"max_new_tokens": 12, **stopping}),
        response=pb.ResponseOptions(generated_tokens=True),
        decoding=decoding,
    ).SerializeToString()
    _, response_type, streaming = fuzz.RPCS[rpc]
    method = fuzz.SERVICE + rpc
    try:
        if streaming:
            replies = list(
                channel.unary_stream(method, None, response_type.FromString)(request, timeout=60)
            )
            final = replies[-1]
            text, tokens = "".join(r.text for r in replies), sum(len(r.tokens) for r in replies)
        else:
            call = channel.unary_unary(method, None, response_type.FromString)
            final = call(request, timeout=60).responses[0]
            text, tokens = final.text, len(final.tokens)
    except grpc.RpcError as err:
        assert isinstance(err, grpc.Call)
        return err.code().name, err.details() or "", None
    result = (text, pb.StopReason.Name(final.stop_reason), final.generated_token_count, tokens)
    return "OK", "", result


@pytest.mark.parametrize("rpc", ["Generate", "GenerateStream"])
@pytest.mark.parametrize("regex", ["x</s>y", "<s>", "a<s>b", "<unk>x<pad>"])
def test_regex_spelling_special_tokens_is_served_as_text(
    channel: grpc.Channel, rpc: str, regex: str
) -> None:
    status, _, result = guided_call(channel, rpc, D(regex=regex))
    assert status == "OK"
    text, reason, count, tokens = result
    assert (text, reason) == (regex, "EOS_TOKEN")
    assert count == tokens


@pytest.mark.parametrize("rpc", ["Generate", "GenerateStream"])
@pytest.mark.parametrize(
    "choices",
    [["a</s>b", "</s>"], CHOICES_5000, [*CHOICES_5000, *CHOICES_5000, ""]],
    ids=["special", "5000", "5000-twice-and-empty"],
)
def test_choices_are_served(channel: grpc.Channel, rpc: str, choices: list[str]) -> None:
    decoding = D(choice=D.StringChoices(choices=choices))
    status, _, result = guided_call(channel, rpc, decoding)
    assert status == "OK"
    text, reason, count, tokens = result
    assert reason == "EOS_TOKEN" and text in choices
    assert count == tokens


@pytest.mark.parametrize("lark", [False, True], ids=["gbnf", "lark"])
def test_wide_alternation_is_served(channel: grpc.Channel, lark: bool) -> None:
    grammar = fuzz_guided.wide_grammar(2001, lark)
    status, _, result = guided_call(channel, "Generate", D(grammar=grammar))
    assert status == "OK"
    assert result[1] == "EOS_TOKEN"
    assert result[0] in {f"w{i}" for i in range(2001)}


@pytest.mark.parametrize("rpc", ["Generate", "GenerateStream"])
@pytest.mark.parametrize(
    ("schema", "message"),
    [
        ("false", "json_schema false allows no JSON document"),
        ("[1]", "json_schema must be a JSON object, true or false"),
        ('"x"', "json_schema must be a JSON object, true or false"),
        (fuzz_guided.properties_chain(600), TOO_DEEP),
        (fuzz_guided.raw_arrays(3000), TOO_DEEP),
        (fuzz_guided.items_chain(200), TOO_DEEP),
        ("{", "json_schema is not valid JSON: Expecting property name enclosed in double "
         "quotes: line 1 column 2 (char 1)"),
    ],
    ids=["false", "array", "string", "properties-600", "raw-3000", "items-200", "invalid"],
)  # fmt: skip
def test_schema_refusals(channel: grpc.Channel, rpc: str, schema: str, message: str) -> None:
    assert guided_call(channel, rpc, D(json_schema=schema))[:2] == ("INVALID_ARGUMENT", message)


@pytest.mark.parametrize("schema", ["true", "{}", fuzz_guided.items_chain(10)])
def test_schemas_served(channel: grpc.Channel, schema: str) -> None:
    status, _, result = guided_call(channel, "GenerateStream", D(json_schema=schema))
    assert status == "OK"
    if result[1] == "EOS_TOKEN":
        json.loads(result[0])


def test_grammar_complete_before_min_new_tokens(channel: grpc.Channel) -> None:
    """The output ends at EOS, with real counts: no end tokens pad it to min_new_tokens."""
    for rpc in ("Generate", "GenerateStream"):
        status, _, result = guided_call(channel, rpc, D(regex="ab"), min_new_tokens=10)
        assert status == "OK"
        text, reason, count, tokens = result
        assert (text, reason) == ("ab", "EOS_TOKEN")
        assert count == tokens < 10


# ---- OpenAI bodies ---------------------------------------------------------------------------


def post(
    server: LauncherProcess, route: str, body: Any, headers: tuple[tuple[str, str], ...] = ()
) -> tuple[int, Any]:
    """POST ``body`` (JSON with :class:`fuzz_openai.Raw` spliced in, or bytes) to ``route``;
    the reply must pass the fuzzer's checks. Its status and JSON body (a stream: its
    events' JSON)."""
    data = body if isinstance(body, bytes) else fuzz_openai.encode(body)
    case = fuzz_openai.HttpCase(route, data, "", headers)
    status, content_type, content = fuzz_openai.exchange(f"127.0.0.1:{server.http_port}", case, 60)
    reply = fuzz_openai.check_reply(case, status, content_type, content)
    assert reply.problem == "", reply
    if "text/event-stream" in content_type:
        events = [e[len("data: ") :] for e in content.decode().split("\n\n") if e]
        return status, [json.loads(e) for e in events if e != "[DONE]"]
    return status, json.loads(content)


COMPLETIONS, CHAT = fuzz_openai.ROUTES
USER_X = {"role": "user", "content": "x"}


def schema_format(schema: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}


@pytest.mark.parametrize(
    ("route", "body", "message"),
    [
        (CHAT, {"messages": [{"role": "user", "content": None}]},
         "message content must be a string or a list of text parts "
         "(null only in an assistant message)"),
        (CHAT, {"messages": [{"role": "user", "content": 3}]},
         "message content must be a string or a list of text parts"),
        (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
         "a text content part's text must be a string"),
        (CHAT, {"messages": [{"content": "x"}]}, "each message must be an object with a role"),
        (COMPLETIONS, {"x": fuzz_openai.nested(5000)}, "the request body is nested too deeply"),
        (CHAT, {"messages": [USER_X], "stop": fuzz_openai.nested(100_000)},
         "the request body is nested too deeply"),
        (CHAT, {"messages": [USER_X], "response_format": schema_format(False)},
         "json_schema false allows no JSON document"),
        (COMPLETIONS, {"prompt": "x", "response_format": schema_format(
            fuzz_openai.Raw(fuzz_guided.properties_chain(200)))},
         TOO_DEEP),
        (COMPLETIONS, {"prompt": "x", "response_format": schema_format(
            fuzz_openai.Raw(fuzz_guided.properties_chain(600)))},
         "the request body is nested too deeply"),
        (COMPLETIONS, {"prompt": "x", "response_format": schema_format(
            fuzz_openai.Raw(fuzz_guided.properties_chain(3000)))},
         "the request body is nested too deeply"),
        (COMPLETIONS, {"prompt": "x", "response_format": schema_format({"enum": []})},
         "Invalid json_schema: Unsatisfiable schema: anyOf is empty"),
        (COMPLETIONS, {"prompt": "x", "top_k": 1 << 32},
         "top_k must be between -1 and 2147483647"),
        (COMPLETIONS, {"prompt": "x", "temperature": fuzz_openai.Raw("NaN")},
         "temperature must be a number"),
        (COMPLETIONS, {"prompt": "x", "logit_bias": {"4096": 1}},
         "logit_bias token id 4096 is not in the model's vocabulary (size 4096)"),
        (CHAT, {"messages": [USER_X], "logit_bias": {"1": 5, "4294967295": -1}},
         "logit_bias token id 4294967295 is not in the model's vocabulary (size 4096)"),
    ],
    ids=[
        "content-null", "content-number", "part-text-number", "no-role", "body-5000-deep",
        "stop-100000-deep", "schema-false", "schema-200-deep", "schema-600-deep",
        "schema-3000-deep", "schema-unsatisfiable", "top_k-2^32", "temperature-NaN",
        "logit_bias-4096", "logit_bias-2^32-1",
    ],
)  # fmt: skip
def test_openai_refusals(server: LauncherProcess, route: str, body: Any, message: str) -> None:
    status, reply = post(server, route, body)
    assert (status, reply["error"]["message"]) == (400, message)
    assert reply["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("compressed", [False, True])
def test_content_encoding(server: LauncherProcess, compressed: bool) -> None:
    import gzip

    data = json.dumps({"prompt": "x", "max_tokens": 1}).encode()
    status, reply = post(
        server, COMPLETIONS, gzip.compress(data) if compressed else data,
        (("Content-Encoding", "gzip"),),
    )  # fmt: skip
    if compressed:
        assert status == 200 and reply["usage"]["completion_tokens"] == 1
    else:
        assert status == 400
        assert reply["error"]["message"] == (
            "the request body could not be read: Can not decode content-encoding: gzip"
        )


def test_openai_guided_edges_are_served(server: LauncherProcess) -> None:
    """Special-token text in an enum, min_tokens past what the schema can produce: served,
    the output what the schema allows, the usage real; streamed too. Schema {}: served."""
    enum = schema_format({"enum": ["a</s>b", "<s>"]})
    body = {
        "messages": [USER_X], "response_format": enum, "min_tokens": 10, "max_tokens": 16,
        "temperature": 0,
    }  # fmt: skip
    status, reply = post(server, CHAT, {**body, "logprobs": True})
    assert status == 200
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert json.loads(choice["message"]["content"]) in ("a</s>b", "<s>")
    assert reply["usage"]["completion_tokens"] == len(choice["logprobs"]["content"]) < 10
    status, chunks = post(server, CHAT, {**body, "stream": True})
    assert status == 200
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert streamed == choice["message"]["content"]
    prompt = {"prompt": "x", "max_tokens": 4, "response_format": schema_format({})}
    assert post(server, COMPLETIONS, prompt)[0] == 200


def test_healthy_and_idle_afterwards(server: LauncherProcess) -> None:
    """Last in the module: whatever ran before, nothing is left running or held."""
    assert_healthy_and_idle(server)
