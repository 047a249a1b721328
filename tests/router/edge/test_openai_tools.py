"""Tool calling's request side (``edge/openai_tools.py`` through ``parse_chat``): tools and
tool_choice read and refused (naming the field), the tools handed to the chat template, the
conversation's tool turns as templates expect them, and the constraints that force a call:
compiled by admission's compiler, they accept exactly the calls their schemas allow."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import jsonschema
import llguidance
import pytest
from transformers import AutoTokenizer

from tgis.embedded_model import MODEL_DIR
from tgis.grammar_engine import grammar_tokenizer, parser_limits
from tgis.router.edge.openai_requests import OpenAIError, parse_chat
from tgis.router.edge.openai_tools import forced_constraint, read_tools
from tgis.router.errors import ValidationError
from tgis.router.intake.chat_template import ChatTemplate
from tgis.router.intake.guided import GrammarCompiler
from tgis.router.ops.metrics import Metrics
from tgis.router.request_types import GuidedKind, GuidedRequest

TEMPLATES = Path(__file__).parents[2] / "data" / "chat_templates"
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Rome"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
NODE = {  # a $ref to its own root: each tool's schema keeps its own root in the grammar
    "$defs": {"leaf": {"type": "string", "maxLength": 3}},
    "type": "object",
    "properties": {"name": {"$ref": "#/$defs/leaf"}},
    "required": ["name"],
}
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "tree", "description": "x", "parameters": NODE}},
    {"type": "function", "function": {"name": "ping"}},  # no parameters: an empty object
]
USER = [{"role": "user", "content": "hi"}]


def chat(parser: str = "hermes", **body: Any) -> Any:
    seen: dict[str, Any] = {}

    def render(messages: list[Any], tools: list[Any] | None) -> str:
        seen.update(messages=messages, tools=tools)
        return "prompt"

    request = parse_chat(
        {"messages": body.pop("messages", USER), **body},
        render,
        max_new_tokens=100,
        tool_call_parser=parser,
    )
    return request, seen


def test_tools_reach_the_template_and_auto_is_the_default() -> None:
    request, seen = chat(tools=TOOLS)
    assert seen["tools"] == TOOLS and request.tools.mode == "auto"
    assert request.call.params.guided is None
    # Hermes's tags may be special tokens: kept in the text for the parser, unless the
    # client says otherwise (vLLM does the same)
    assert request.call.params.response.skip_special_tokens is False
    kept, _ = chat(tools=TOOLS, skip_special_tokens=True)
    assert kept.call.params.response.skip_special_tokens is True
    granite, _ = chat("granite", tools=TOOLS)
    assert granite.call.params.response.skip_special_tokens is None
    assert granite.tool_call_parser == "granite"
    none, seen = chat(tools=TOOLS, tool_choice="none")
    assert none.tools.mode == "none" and seen["tools"] == TOOLS
    plain, seen = chat()
    assert plain.tools is None and seen["tools"] is None
    empty, _ = chat(tools=[], tool_choice="none")
    assert empty.tools is None


def test_named_and_required_are_forced_by_guided_decoding() -> None:
    named, _ = chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "tree"}})
    guided = named.call.params.guided
    assert named.tools.mode == "named" and named.tools.name == "tree"
    assert guided.kind is GuidedKind.JSON_SCHEMA and json.loads(guided.text) == NODE
    required, _ = chat(tools=TOOLS, tool_choice="required")
    assert required.call.params.guided.kind is GuidedKind.GRAMMAR
    assert required.tools.parallel
    single, _ = chat(tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    assert not single.tools.parallel


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"tools": {"type": "function"}}, "tools", "list"),
        ({"tools": [{"type": "code_interpreter"}]}, "tools", "function tool"),
        ({"tools": [{"type": "function"}]}, "tools", "function must be an object"),
        ({"tools": [{"type": "function", "function": {}}]}, "tools", "name"),
        ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools", "name"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
            "tools",
            "parameters",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "description": 1}}]},
            "tools",
            "description",
        ),
        ({"tools": [TOOLS[0], TOOLS[0]]}, "tools", "different"),
        ({"tools": [TOOLS[2]] * 129}, "tools", "at most 128"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice", "must be"),
        ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice", "must be"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "not in tools: nope",
        ),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
            "cannot be combined",
        ),
        (
            {"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"},
            "tool_choice",
            "cannot be combined",
        ),
        ({"tools": TOOLS, "parallel_tool_calls": "no"}, "parallel_tool_calls", "boolean"),
        (
            {"messages": [{"role": "assistant", "content": None, "tool_calls": {"id": "x"}}]},
            "messages",
            "tool_calls",
        ),
        (
            {"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "x"}]}]},
            "messages",
            "tool call",
        ),
        (
            {"messages": [{"role": "user", "content": "x", "tool_calls": []}]},
            "messages",
            "assistant",
        ),
    ],
)
def test_refusals_name_the_field(body: dict[str, Any], param: str, message: str) -> None:
    with pytest.raises(OpenAIError) as refused:
        chat(**body)
    assert refused.value.status == 400 and refused.value.param == param
    assert message in refused.value.message


def test_tool_turns_reach_the_template_as_transformers_takes_them() -> None:
    """An assistant's call arguments (JSON text, OpenAI's form) are objects for the
    template; the prompt equals transformers' apply_chat_template of that conversation."""
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Rome", "days": 2}'},
    }
    odd = {"id": "call_2", "type": "function", "function": {"name": "ping", "arguments": "x"}}
    messages = [
        {"role": "user", "content": "Weather in Rome?"},
        {"role": "assistant", "content": None, "tool_calls": [call, odd]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    _, seen = chat(messages=messages, tools=TOOLS)
    sent = seen["messages"][1]["tool_calls"]
    assert sent[0]["function"]["arguments"] == {"city": "Rome", "days": 2}
    assert sent[1]["function"]["arguments"] == "x"  # not JSON: left as it was
    source = (TEMPLATES / "hermes_tools.jinja").read_text()
    ours = ChatTemplate(source, "test").render(seen["messages"], tools=seen["tools"])
    tokenizer = AutoTokenizer.from_pretrained(MODEL_DIR)
    theirs = tokenizer.apply_chat_template(
        seen["messages"], tools=seen["tools"], chat_template=source, tokenize=False,
        add_generation_prompt=True,
    )  # fmt: skip
    assert ours == theirs
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"' in ours
    assert '<tool_response id="call_1">sunny</tool_response>' in ours


def compiled(guided: GuidedRequest) -> str:
    compiler = GrammarCompiler(
        lambda: (MODEL_DIR / "tokenizer.json").read_text(),
        4096,
        (2,),
        Metrics(max_sequence_length=64, max_new_tokens=40, max_batch_size=4),
    )
    try:
        return asyncio.run(compiler.compile(guided))
    finally:
        compiler.close()


def accepts(grammar: str, text: str) -> bool:
    tokenizer = grammar_tokenizer((MODEL_DIR / "tokenizer.json").read_text(), 4096, [2])
    matcher = llguidance.LLMatcher(tokenizer, grammar, limits=parser_limits(), log_level=0)
    ids = tokenizer.tokenize_str(text)
    return matcher.consume_tokens(ids) and matcher.is_accepting()


def test_the_forced_grammars_allow_exactly_the_declared_calls() -> None:
    tools = read_tools({"tools": TOOLS, "tool_choice": "required"})
    assert tools is not None
    grammar = compiled(forced_constraint(tools))  # type: ignore[arg-type]
    good = [
        '[{"name":"get_weather","arguments":{"city":"Paris","days":3}}]',
        '[{"name":"tree","arguments":{"name":"abc"}},{"name":"ping","arguments":{}}]',
    ]
    bad = [
        "[]",
        '[{"name":"get_weather","arguments":{"city":"Oslo","days":3}}]',
        '[{"name":"get_weather","arguments":{"city":"Paris","days":9}}]',
        '[{"name":"tree","arguments":{"name":"abcd"}}]',
        '[{"name":"other","arguments":{}}]',
        '[{"name": "ping","arguments":{}}]',  # compact, as every guided JSON here
    ]
    assert [accepts(grammar, t) for t in good] == [True, True]
    assert [accepts(grammar, t) for t in bad] == [False] * len(bad)
    for text in good:
        for item in json.loads(text):
            schema = {t["function"]["name"]: t["function"].get("parameters") for t in TOOLS}
            jsonschema.validate(item["arguments"], schema[item["name"]] or {})
    single = read_tools({"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False})
    one = compiled(forced_constraint(single))  # type: ignore[arg-type]
    assert accepts(one, good[0]) and not accepts(one, good[1])
    named = read_tools(
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    )
    arguments = compiled(forced_constraint(named))  # type: ignore[arg-type]
    assert accepts(arguments, '{"city":"Rome","days":7}')
    assert not accepts(arguments, '{"city":"Rome"}')


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "f"}}])
def test_a_schema_the_compiler_refuses_is_a_validation_error(choice: Any) -> None:
    broken = {"type": "object", "properties": {"a": {"type": "frobnicate"}}}
    tools = read_tools(
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": broken}}],
         "tool_choice": choice}
    )  # fmt: skip
    with pytest.raises(ValidationError):
        compiled(forced_constraint(tools))  # type: ignore[arg-type]
