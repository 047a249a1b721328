"""Guided decoding at the router's edge and intake: the proto's oneof converted, every
constraint compiled (or refused with the compiler's message), cached, timed, counted."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from tests.guided_tokenizers import embedded_tokenizer_json
from tests.prometheus_tools import parse_exposition
from tgis.pb import generation_pb2 as pb
from tgis.router.edge.fmaas import convert_params
from tgis.router.errors import ValidationError
from tgis.router.intake.guided import GrammarCompiler
from tgis.router.ops.metrics import Metrics
from tgis.router.request_types import GuidedKind, GuidedRequest

D = pb.DecodingParameters


def converted(decoding: pb.DecodingParameters) -> GuidedRequest | None:
    params = pb.Parameters(decoding=decoding)
    return convert_params(params, default_include_stop_seqs=True, now=0.0).guided


def test_the_oneof_becomes_a_guided_request() -> None:
    assert converted(D()) is None
    assert converted(D(format=D.TEXT)) is None
    assert converted(D(format=D.JSON)) == GuidedRequest(GuidedKind.JSON_OBJECT)
    assert converted(D(json_schema="{}")) == GuidedRequest(GuidedKind.JSON_SCHEMA, "{}")
    assert converted(D(regex="")) == GuidedRequest(GuidedKind.REGEX, "")
    assert converted(D(grammar="root ::= x")) == GuidedRequest(GuidedKind.GRAMMAR, "root ::= x")
    choice = D(choice=D.StringChoices(choices=["a", "b"]))
    assert converted(choice) == GuidedRequest(GuidedKind.CHOICE, choices=("a", "b"))
    assert converted(D(format=7)) == GuidedRequest(GuidedKind.JSON_OBJECT, "7")  # type: ignore[arg-type]
    # the oneof sits beside TGIS's fields, which keep their meaning
    both = convert_params(
        pb.Parameters(decoding=D(repetition_penalty=1.5, regex="a")),
        default_include_stop_seqs=True,
        now=0.0,
    )
    assert both.sampling.repetition_penalty == 1.5
    assert both.guided == GuidedRequest(GuidedKind.REGEX, "a")


TOO_DEEP = "json_schema is nested too deeply for the grammar compiler"


def nested_schema(depth: int) -> str:
    schema: dict[str, object] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return json.dumps(schema)


def compiler(metrics: Metrics, **kwargs: float) -> GrammarCompiler:
    return GrammarCompiler(embedded_tokenizer_json, 4096, (2,), metrics, **kwargs)  # type: ignore[arg-type]


def new_metrics() -> Metrics:
    return Metrics(max_sequence_length=64, max_new_tokens=32, max_batch_size=4)


def compile_now(c: GrammarCompiler, request: GuidedRequest) -> str:
    return asyncio.run(c.compile(request))


def refusal(c: GrammarCompiler, request: GuidedRequest) -> str:
    with pytest.raises(ValidationError) as info:
        compile_now(c, request)
    return info.value.message


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        (GuidedRequest(GuidedKind.CHOICE, choices=("only",)), "Must provide at least two choices"),
        (GuidedRequest(GuidedKind.CHOICE), "Must provide at least two choices"),
        (
            GuidedRequest(GuidedKind.JSON_SCHEMA, "{"),
            "json_schema is not valid JSON: Expecting property name enclosed in double quotes: "
            "line 1 column 2 (char 1)",
        ),
        (
            GuidedRequest(GuidedKind.JSON_SCHEMA, "[1]"),
            "json_schema must be a JSON object, true or false",
        ),
        (
            GuidedRequest(GuidedKind.JSON_SCHEMA, '{"type": "nonsense"}'),
            "Invalid json_schema: Invalid type: nonsense",
        ),
        (
            GuidedRequest(GuidedKind.JSON_SCHEMA, '{"type": "string", "format": "weird"}'),
            "Invalid json_schema: Unknown format: weird",
        ),
        (
            GuidedRequest(
                GuidedKind.JSON_SCHEMA, '{"type": "object", "unevaluatedProperties": false}'
            ),
            'Invalid json_schema: Unimplemented keys: ["unevaluatedProperties"]',
        ),
        (
            GuidedRequest(GuidedKind.REGEX, "a(b"),
            'Invalid regex: at 1(8): invalid regex "a(b" (in regex): regex parse error:\n'
            "    a(b\n     ^\nerror: unclosed group\n   1 | start: /a(b/\n              ^",
        ),
        (
            GuidedRequest(GuidedKind.GRAMMAR, "start: nowhere"),
            'Invalid grammar: at 1(8): unknown name: "nowhere"\n   1 | start: nowhere\n'
            "              ^",
        ),
        (GuidedRequest(GuidedKind.JSON_OBJECT, "7"), "format must be TEXT (0) or JSON (1), got 7"),
        (
            GuidedRequest(GuidedKind.JSON_SCHEMA, "false"),
            "json_schema false allows no JSON document",
        ),
        (GuidedRequest(GuidedKind.JSON_SCHEMA, nested_schema(64)), TOO_DEEP),
        (GuidedRequest(GuidedKind.JSON_SCHEMA, '{"a":' * 600 + "1" + "}" * 600), TOO_DEEP),
        (GuidedRequest(GuidedKind.JSON_SCHEMA, '{"a":' * 5000 + "1" + "}" * 5000), TOO_DEEP),
        (
            GuidedRequest(GuidedKind.JSON_SCHEMA, '{"enum": []}'),
            "Invalid json_schema: Unsatisfiable schema: anyOf is empty",
        ),
        (GuidedRequest(GuidedKind.REGEX, "[^\\x00-\\U0010FFFF]"), "The regex allows no output"),
        (GuidedRequest(GuidedKind.GRAMMAR, 'start: "a" & "b"'), None),
    ],
)
def test_refusals_carry_the_compilers_message(request_: GuidedRequest, message: str | None) -> None:
    metrics = new_metrics()
    got = refusal(compiler(metrics), request_)
    if message is None:  # the compiler's own words: only bounded and without parser state
        assert got.startswith("Invalid grammar: ") and len(got) < 700 and "<state>" not in got
    else:
        assert got == message
    exposition = parse_exposition(metrics.render().decode())
    assert exposition.value("tgi_guided_compile_failure_total", kind=request_.kind.value) == 1


def test_a_repeated_constraint_compiles_once() -> None:
    metrics = new_metrics()
    c = compiler(metrics)
    schema = GuidedRequest(GuidedKind.JSON_SCHEMA, json.dumps({"type": "integer"}))
    first = compile_now(c, schema)
    assert compile_now(c, schema) == first
    assert compile_now(c, GuidedRequest(GuidedKind.REGEX, "[0-9]+")) != first
    exposition = parse_exposition(metrics.render().decode())
    assert exposition.value("tgi_guided_compile_duration_count") == 2
    assert exposition.value("tgi_guided_request_total", kind="json_schema") == 2
    assert exposition.value("tgi_guided_request_total", kind="regex") == 1


def test_every_kind_compiles() -> None:
    c = compiler(new_metrics())
    for request in (
        GuidedRequest(GuidedKind.JSON_OBJECT),
        GuidedRequest(GuidedKind.JSON_SCHEMA, '{"type": "object"}'),
        GuidedRequest(GuidedKind.REGEX, "[a-z]+"),
        GuidedRequest(GuidedKind.CHOICE, choices=("a", "b")),
        GuidedRequest(GuidedKind.GRAMMAR, 'root ::= "a" | "b"'),
        GuidedRequest(GuidedKind.GRAMMAR, 'start: "a" | "b"'),  # Lark
    ):
        assert compile_now(c, request)


def test_a_compilation_past_the_time_limit_is_refused_and_not_cached() -> None:
    metrics = new_metrics()
    c = compiler(metrics, timeout=0.05)
    slow = c._compile

    def slower(request: GuidedRequest) -> str:
        time.sleep(0.3)
        return slow(request)

    c._compile = slower  # type: ignore[method-assign]
    request = GuidedRequest(GuidedKind.REGEX, "[a-z]+")
    assert refusal(c, request) == "compiling the regex took longer than 0.05 s"
    c._compile = slow  # type: ignore[method-assign]
    # the refusal was not cached: the same constraint compiles now, given the time a real
    # compilation needs on a busy machine (it builds the tokenizer and a first mask)
    c._timeout = 10.0
    assert compile_now(c, request)


@pytest.mark.parametrize(
    "request_",
    [
        GuidedRequest(GuidedKind.JSON_SCHEMA, "true"),
        GuidedRequest(GuidedKind.JSON_SCHEMA, nested_schema(60)),
        GuidedRequest(GuidedKind.REGEX, "x</s>y"),
        GuidedRequest(GuidedKind.REGEX, "<s>|<pad>|<unk>"),
        GuidedRequest(GuidedKind.REGEX, ""),
        GuidedRequest(GuidedKind.CHOICE, choices=("a</s>b", "c")),
        GuidedRequest(GuidedKind.CHOICE, choices=tuple(f"option {i}" for i in range(5000))),
        GuidedRequest(GuidedKind.CHOICE, choices=("", "a", "a", "é日\n")),
        GuidedRequest(GuidedKind.GRAMMAR, "root ::= " + " | ".join(f'"c{i}"' for i in range(2001))),
    ],
    ids=lambda r: f"{r.kind.value}:{(r.text or ','.join(r.choices[:2]))[:24]}",
)
def test_constraints_that_were_refused_or_failed_are_served(request_: GuidedRequest) -> None:
    """What used to fail during generation or be refused for no reason compiles: the
    engine-level checks of these grammars are in tests/test_grammar_engine.py and the
    served outputs in tests/e2e/test_guided_e2e.py."""
    assert compile_now(compiler(new_metrics()), request_)
