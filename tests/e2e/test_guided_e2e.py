"""Guided decoding through the real launcher, router and shard (the embedded model).

The embedded model is tiny and random; the mask does all the work, which is what is tested.
Oracles, independent of tgis: ``jsonschema`` for schemas, ``re.fullmatch`` for regexes, set
membership for choices, an llguidance matcher replaying the text for grammars and for any
output cut short by max_new_tokens (a prefix of the language), and the same server without
the field for the unconstrained requests beside them.
"""

from __future__ import annotations

import json
import re
import subprocess
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import jsonschema
import llguidance
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.e2e.server import BIN_DIR, LauncherProcess
from tests.guided_tokenizers import embedded_tokenizer_json
from tests.prometheus_tools import parse_exposition
from tgis.pb import generation_pb2 as pb
from tgis.pb import generation_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow

D = pb.DecodingParameters
PROMPT = "The answer, as JSON:"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 5},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
REGEX = "[a-z]{1,6}-[0-9]{2}"
CHOICES = ["positive", "negative", "neutral"]
GRAMMAR = 'root ::= "SELECT " col " FROM " tbl\ncol ::= [a-z] [a-z]?\ntbl ::= "users" | "items"'


@pytest.fixture(scope="module")
def server(embedded_server: LauncherProcess) -> LauncherProcess:
    return embedded_server


def params(
    decoding: pb.DecodingParameters | None, new_tokens: int = 48, **kw: object
) -> pb.Parameters:
    p = pb.Parameters(stopping=pb.StoppingCriteria(max_new_tokens=new_tokens), **kw)  # type: ignore[arg-type]
    if decoding is not None:
        p.decoding.CopyFrom(decoding)
    return p


def generate(
    stub: pb_grpc.GenerationServiceStub, p: pb.Parameters, *texts: str
) -> list[pb.GenerationResponse]:
    request = pb.BatchedGenerationRequest(
        requests=[pb.GenerationRequest(text=t) for t in texts or (PROMPT,)], params=p
    )
    return list(stub.Generate(request, timeout=60).responses)


def is_prefix_of_language(grammar: str, text: str) -> bool:
    """llguidance's verdict on ``text`` as a prefix of ``grammar``'s language (the matcher
    works on bytes, so any tokenization of the text will do)."""
    tokenizer = llguidance.LLTokenizer(embedded_tokenizer_json(), eos_token=2)
    matcher = llguidance.LLMatcher(tokenizer, grammar)
    ids = tokenizer.tokenize_str(text)
    return matcher.validate_tokens(ids) == len(ids)


def is_in_language(grammar: str, text: str) -> bool:
    """llguidance's verdict on ``text`` as a whole sentence of ``grammar``."""
    tokenizer = llguidance.LLTokenizer(embedded_tokenizer_json(), eos_token=2)
    matcher = llguidance.LLMatcher(tokenizer, grammar)
    return matcher.consume_tokens(tokenizer.tokenize_str(text)) and matcher.is_accepting()


def compact_json(schema: object) -> str:
    return llguidance.LLMatcher.grammar_from_json_schema(
        json.dumps(schema), overrides={"whitespace_flexible": False}
    )


def check_schema(response: pb.GenerationResponse, schema: dict[str, object]) -> None:
    if response.stop_reason == pb.EOS_TOKEN:
        jsonschema.validate(json.loads(response.text), schema)
    else:
        assert response.stop_reason == pb.MAX_TOKENS
        assert is_prefix_of_language(compact_json(schema), response.text), response.text


def test_json_schema_greedy(stub: pb_grpc.GenerationServiceStub) -> None:
    (response,) = generate(stub, params(D(json_schema=json.dumps(SCHEMA)), 64))
    assert response.stop_reason == pb.EOS_TOKEN, response.text
    jsonschema.validate(json.loads(response.text), SCHEMA)
    assert " " not in response.text.replace('" ', "").split('"')[0]  # compact between tokens


def test_format_json_is_a_json_object(stub: pb_grpc.GenerationServiceStub) -> None:
    (response,) = generate(stub, params(D(format=D.JSON), 32))
    assert response.text.startswith("{")
    check_schema(response, {"type": "object"})


def test_format_text_is_unconstrained(stub: pb_grpc.GenerationServiceStub) -> None:
    (plain,) = generate(stub, params(None, 12))
    (text,) = generate(stub, params(D(format=D.TEXT), 12))
    assert text.text == plain.text


def test_regex_choice_and_grammar_greedy(stub: pb_grpc.GenerationServiceStub) -> None:
    (regex,) = generate(stub, params(D(regex=REGEX)))
    assert regex.stop_reason == pb.EOS_TOKEN and re.fullmatch(REGEX, regex.text), regex.text
    (choice,) = generate(stub, params(D(choice=D.StringChoices(choices=CHOICES))))
    assert choice.stop_reason == pb.EOS_TOKEN and choice.text in CHOICES
    (sql,) = generate(stub, params(D(grammar=GRAMMAR)))
    assert sql.stop_reason == pb.EOS_TOKEN
    assert re.fullmatch("SELECT [a-z]{1,2} FROM (users|items)", sql.text), sql.text


def test_seeded_sampling_is_guided_and_repeatable(stub: pb_grpc.GenerationServiceStub) -> None:
    sampled = params(
        D(regex=REGEX),
        method=pb.SAMPLE,
        sampling=pb.SamplingParameters(temperature=1.3, seed=42),
    )
    first = generate(stub, sampled, PROMPT, "Another prompt")
    assert [r.text for r in first] == [
        r.text for r in generate(stub, sampled, PROMPT, "Another prompt")
    ]
    for response in first:
        assert re.fullmatch(REGEX, response.text), response.text


def test_streaming_equals_unary(stub: pb_grpc.GenerationServiceStub) -> None:
    p = params(D(json_schema=json.dumps(SCHEMA)), 64)
    (unary,) = generate(stub, p)
    request = pb.SingleGenerationRequest(request=pb.GenerationRequest(text=PROMPT), params=p)
    messages = list(stub.GenerateStream(request, timeout=60))
    assert "".join(m.text for m in messages) == unary.text
    assert messages[-1].stop_reason == pb.EOS_TOKEN


def test_stop_sequences_and_max_new_tokens_still_apply(stub: pb_grpc.GenerationServiceStub) -> None:
    (full,) = generate(stub, params(D(json_schema=json.dumps(SCHEMA)), 64))
    (short,) = generate(stub, params(D(json_schema=json.dumps(SCHEMA)), 3))
    assert short.stop_reason == pb.MAX_TOKENS and short.generated_token_count == 3
    assert full.text.startswith(short.text)
    stop = params(D(json_schema=json.dumps(SCHEMA)), 64)
    stop.stopping.stop_sequences.append('"age"')
    (stopped,) = generate(stub, stop)
    assert stopped.stop_reason == pb.STOP_SEQUENCE
    assert full.text.startswith(stopped.text) and stopped.text.endswith('"age"')


def test_min_new_tokens_gives_way_when_the_grammar_is_complete(
    stub: pb_grpc.GenerationServiceStub,
) -> None:
    p = params(D(choice=D.StringChoices(choices=["yes", "no"])), 40)
    p.stopping.min_new_tokens = 30
    (response,) = generate(stub, p)
    assert response.text in ("yes", "no") and response.stop_reason == pb.EOS_TOKEN


def test_unguided_requests_beside_guided_ones_are_unchanged(
    stub: pb_grpc.GenerationServiceStub,
) -> None:
    texts = ["Once upon a time", "def main():", "The capital of France"]
    alone = generate(stub, params(None, 24), *texts)
    guided = params(D(json_schema=json.dumps(SCHEMA)), 64)
    with ThreadPoolExecutor(4) as pool:
        busy = [pool.submit(generate, stub, guided, t) for t in texts]
        beside = generate(stub, params(None, 24), *texts)
        for future in busy:
            check_schema(future.result()[0], SCHEMA)
    assert [r.text for r in beside] == [r.text for r in alone]


@pytest.mark.parametrize(
    ("decoding", "message"),
    [
        (D(choice=D.StringChoices(choices=["one"])), "Must provide at least two choices"),
        (D(json_schema='{"type": "nonsense"}'), "Invalid json_schema: Invalid type: nonsense"),
        (
            D(json_schema="{"),
            "json_schema is not valid JSON: Expecting property name enclosed in double "
            "quotes: line 1 column 2 (char 1)",
        ),
        (
            D(grammar="root ::= missing"),
            "Invalid grammar: Failed to convert the grammar from GBNF to Lark: "
            "Rule 'missing' not found",
        ),
    ],
)
def test_bad_constraints_are_invalid_argument(
    stub: pb_grpc.GenerationServiceStub, decoding: pb.DecodingParameters, message: str
) -> None:
    with pytest.raises(grpc.RpcError) as info:
        generate(stub, params(decoding))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == message


def test_grpcurl_json_schema_through_reflection(
    server: LauncherProcess, stub: pb_grpc.GenerationServiceStub
) -> None:
    body = {
        "requests": [{"text": PROMPT}],
        "params": {"stopping": {"maxNewTokens": 48}, "decoding": {"regex": REGEX}},
    }
    result = subprocess.run(
        [str(BIN_DIR / "grpcurl"), "-plaintext", "-d", json.dumps(body), server.grpc_target,
         "fmaas.GenerationService/Generate"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    (response,) = json.loads(result.stdout)["responses"]
    (expected,) = generate(stub, params(D(regex=REGEX)))
    assert response["text"] == expected.text and response["stopReason"] == "EOS_TOKEN"


def test_guided_requests_are_counted(
    server: LauncherProcess, stub: pb_grpc.GenerationServiceStub
) -> None:
    def count(kind: str) -> float:
        _, body = server.http_get("/metrics")
        return parse_exposition(body.decode()).value("tgi_guided_request_total", kind=kind)

    before = count("choice")
    generate(stub, params(D(choice=D.StringChoices(choices=CHOICES))))
    assert count("choice") == before + 1


REGEX_PIECES = st.sampled_from(
    [
        "[a-z]",
        "[0-9]{1,3}",
        "(ab|cd)",
        "x?",
        "[A-F]+",
        "\\.",
        "-",
        "(",
        ")",
        "[",
        "]",
        "{2}",
        "*",
        "|",
    ]
)


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(pieces=st.lists(REGEX_PIECES, min_size=1, max_size=6))
def test_any_regex_gives_its_language_or_invalid_argument(
    stub: pb_grpc.GenerationServiceStub, pieces: list[str]
) -> None:
    regex = "".join(pieces)
    try:
        (response,) = generate(stub, params(D(regex=regex), 10))
    except grpc.RpcError as err:
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (regex, err.details())
        return
    grammar = llguidance.LLMatcher.grammar_from_regex(regex)
    assert is_prefix_of_language(grammar, response.text), (regex, response.text)
    if response.stop_reason == pb.EOS_TOKEN:
        try:
            assert re.fullmatch(regex, response.text), (regex, response.text)
        except re.error:  # Rust's syntax, which llguidance reads, is wider (e.g. `a{1,3}{2}`)
            assert is_in_language(grammar, response.text), (regex, response.text)


JSON_TYPES = st.sampled_from(
    [
        {"type": "integer"},
        {"type": "boolean"},
        {"type": "string", "maxLength": 3},
        {"enum": [1, "x"]},
        {"type": "nonsense"},
        {"type": "number", "minimum": 5},
        {"type": "null"},
    ]
)


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(properties=st.dictionaries(st.sampled_from(["a", "b", "c"]), JSON_TYPES, max_size=3))
def test_any_schema_gives_valid_json_or_invalid_argument(
    stub: pb_grpc.GenerationServiceStub, properties: dict[str, object]
) -> None:
    schema = {"type": "object", "properties": properties, "required": sorted(properties),
              "additionalProperties": False}  # fmt: skip
    try:
        (response,) = generate(stub, params(D(json_schema=json.dumps(schema)), 24))
    except grpc.RpcError as err:
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (schema, err.details())
        return
    check_schema(response, schema)


# ---- issue 33: the edges, on both APIs -----------------------------------------------------

SPECIAL_TEXT = ["<s>", "x</s>y", "<unk>", "<pad>", "a<s>b"]
MANY = [f"opt{i}" for i in range(5000)]


def post(server: LauncherProcess, route: str, body: object) -> tuple[int, Any]:
    """POST ``body`` (JSON, or raw bytes) to an OpenAI route: the status and the JSON reply."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{server.http_port}{route}",
        data=data,
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def completion(server: LauncherProcess, **body: object) -> tuple[int, Any]:
    return post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 24, **body})


def test_special_token_text_is_served_as_text(
    stub: pb_grpc.GenerationServiceStub, server: LauncherProcess
) -> None:
    for literal in SPECIAL_TEXT:
        (response,) = generate(stub, params(D(regex=re.escape(literal)), 24))
        assert (response.text, response.stop_reason) == (literal, pb.EOS_TOKEN)
    choices = ["a</s>b", "c<s>"]
    p = params(D(choice=D.StringChoices(choices=choices)), 24)
    p.method = pb.SAMPLE
    for seed in range(12):
        p.sampling.seed = seed
        (response,) = generate(stub, p)
        assert response.text in choices and response.stop_reason == pb.EOS_TOKEN
    # the same through the OpenAI route: a response_format schema whose only value spells
    # the tokens
    fmt = {"type": "json_schema", "json_schema": {"name": "t", "schema": {"enum": ["x</s>y"]}}}
    status, body = completion(server, response_format=fmt)
    assert status == 200, body
    assert body["choices"][0]["text"] == '"x</s>y"'
    assert body["choices"][0]["finish_reason"] == "stop"


def test_large_choices_and_wide_grammars_are_served(stub: pb_grpc.GenerationServiceStub) -> None:
    for count in (2001, 5000):
        p = params(D(choice=D.StringChoices(choices=MANY[:count])), 24)
        (response,) = generate(stub, p)
        assert response.text in MANY[:count] and response.stop_reason == pb.EOS_TOKEN
    wide = "root ::= " + " | ".join(json.dumps(c) for c in MANY[:2001])
    (response,) = generate(stub, params(D(grammar=wide), 24))
    assert response.text in MANY[:2001] and response.stop_reason == pb.EOS_TOKEN


def nested_schema(depth: int) -> dict[str, object]:
    schema: dict[str, object] = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


TOO_DEEP = "json_schema is nested too deeply for the grammar compiler"


@pytest.mark.parametrize(
    ("schema_text", "message"),
    [
        ("false", "json_schema false allows no JSON document"),
        (json.dumps(nested_schema(64)), TOO_DEEP),
        ('{"a":' * 600 + "1" + "}" * 600, TOO_DEEP),
        ('{"a":' * 5000 + "1" + "}" * 5000, TOO_DEEP),
        ("[1]", "json_schema must be a JSON object, true or false"),
    ],
    ids=["false", "64-deep", "600-deep", "5000-deep", "array"],
)
def test_schemas_the_compiler_cannot_take_are_refused_on_both_apis(
    stub: pb_grpc.GenerationServiceStub, server: LauncherProcess, schema_text: str, message: str
) -> None:
    with pytest.raises(grpc.RpcError) as info:
        generate(stub, params(D(json_schema=schema_text)))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == message
    raw = (
        b'{"prompt": "x", "max_tokens": 4, "response_format": {"type": "json_schema", '
        b'"json_schema": {"name": "s", "schema": ' + schema_text.encode() + b"}}}"
    )
    status, body = post(server, "/v1/completions", raw)
    assert status == 400 and body["error"]["type"] == "invalid_request_error"
    assert body["error"]["message"] in (
        message,
        "the request body is nested too deeply",
        "response_format.json_schema.schema must be an object, true or false",
    )


def test_schema_true_is_any_json_value(stub: pb_grpc.GenerationServiceStub) -> None:
    (response,) = generate(stub, params(D(json_schema="true"), 40))
    if response.stop_reason == pb.EOS_TOKEN:
        json.loads(response.text)
    else:
        assert is_prefix_of_language(compact_json(True), response.text)


def test_a_complete_grammar_is_not_padded_to_min_new_tokens(
    stub: pb_grpc.GenerationServiceStub, server: LauncherProcess
) -> None:
    p = params(D(regex="ab"), 20)
    p.stopping.min_new_tokens = 10
    p.response.generated_tokens = True
    (response,) = generate(stub, p)
    assert (response.text, response.stop_reason) == ("ab", pb.EOS_TOKEN)
    texts = [t.text for t in response.tokens]
    assert response.generated_token_count == len(texts) and texts[-1] == "</s>"
    assert "</s>" not in texts[:-1]
    streamed = list(stub.GenerateStream(pb.SingleGenerationRequest(
        request=pb.GenerationRequest(text=PROMPT), params=p), timeout=60))  # fmt: skip
    assert sum(len(m.tokens) for m in streamed) == response.generated_token_count
    assert streamed[-1].generated_token_count == response.generated_token_count
    fmt = {"type": "json_schema", "json_schema": {"name": "t", "schema": {"enum": ["ab"]}}}
    status, body = completion(server, min_tokens=10, response_format=fmt)
    assert status == 200 and body["choices"][0]["text"] == '"ab"'
    assert body["usage"]["completion_tokens"] < 10


def test_a_body_nested_too_deeply_is_a_bad_request(server: LauncherProcess) -> None:
    body = b'{"prompt": "x", "extra": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    status, reply = post(server, "/v1/completions", body)
    assert status == 400 and reply["error"]["message"] == "the request body is nested too deeply"
