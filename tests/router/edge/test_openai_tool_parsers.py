"""Tool calls read from model output (``edge/openai_tool_parsers.py``, ``openai_tool_output.py``):
each format's calls and content, what is held back while a call may be starting, outputs
that only look like calls, and the same message whether the text comes whole or cut into
any pieces (a stream reassembles into the unary reply)."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from tgis.router.edge.openai_tool_output import choice_output, delta_of, message_of
from tgis.router.edge.openai_tool_parsers import (
    TOOL_CALL_PARSERS,
    CallStart,
    ChoiceOutput,
    Piece,
    Text,
    guess_tool_call_parser,
)
from tgis.router.edge.openai_tools import ToolChoice
from tgis.settings.serving import TOOL_CALL_PARSERS as SETTING_CHOICES

AUTO = ToolChoice("auto", (), ())


def read(output: ChoiceOutput, parts: list[str]) -> list[Piece]:
    pieces: list[Piece] = []
    for part in parts:
        pieces += output.feed(part)
    return pieces + output.finish()


def message(parser: str, text: str, tools: ToolChoice = AUTO) -> dict[str, Any]:
    return without_ids(message_of(read(choice_output(tools, parser), [text])))


def without_ids(message: dict[str, Any]) -> dict[str, Any]:
    for call in message.get("tool_calls", []):
        assert call.pop("id").startswith("call_") and call["type"] == "function"
    return message


def calls(*pairs: tuple[str, dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {"type": "function", "function": {"name": name, "arguments": json.dumps(args)}}
        for name, args in pairs
    ]


def test_the_setting_offers_every_parser() -> None:
    assert tuple(TOOL_CALL_PARSERS) == SETTING_CHOICES


@pytest.mark.parametrize(
    ("text", "content", "called"),
    [
        ("The sky is blue.", "The sky is blue.", []),
        ('<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>', None, [("f", {"a": 1})]),
        (
            '\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n'
            '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>',
            None,
            [("f", {"a": 1}), ("g", {})],
        ),
        (
            'Let me look.<tool_call>{"name": "f", "arguments": {"q": "x"}}</tool_call>',
            "Let me look.",
            [("f", {"q": "x"})],
        ),
        # left open at the end: read when its JSON is complete
        ('<tool_call>{"name": "f", "arguments": {"a": [1, 2]}}', None, [("f", {"a": [1, 2]})]),
        # not a call object: kept as content, tags included
        ("<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", []),
        ('<tool_call>{"arguments": {}}', '<tool_call>{"arguments": {}}', []),
        ("a < b and <tool", "a < b and <tool", []),
    ],
)
def test_hermes(text: str, content: str | None, called: list[Any]) -> None:
    got = message("hermes", text)
    assert got["content"] == content
    assert got.get("tool_calls", []) == calls(*called)


@pytest.mark.parametrize(
    ("text", "content", "called"),
    [
        ("Paris is in France.", "Paris is in France.", []),
        ('{"name": "f", "parameters": {"a": 1}}', None, [("f", {"a": 1})]),
        ('<|python_tag|>{"name": "f", "parameters": {}}', None, [("f", {})]),
        (
            ' {"name": "f", "parameters": {"a": 1}}; {"name": "g", "arguments": {"b": 2}};',
            None,
            [("f", {"a": 1}), ("g", {"b": 2})],
        ),
        ('{"name": "f", "parameters": {"a": 1}', '{"name": "f", "parameters": {"a": 1}', []),
        ('{"a": 1}', '{"a": 1}', []),
        ('{"name": "f"} {"name": "g"}', '{"name": "f"} {"name": "g"}', []),
        ("<|python", "<|python", []),
    ],
)
def test_llama3_json(text: str, content: str | None, called: list[Any]) -> None:
    got = message("llama3_json", text)
    assert got["content"] == content
    assert got.get("tool_calls", []) == calls(*called)


@pytest.mark.parametrize(
    ("text", "content", "called"),
    [
        ("Hello there", "Hello there", []),
        ('<|tool_call|>[{"name": "f", "arguments": {"a": 1}}]', None, [("f", {"a": 1})]),
        (
            '[{"name": "f", "arguments": {}}, {"name": "g", "arguments": {"x": "y"}}]',
            None,
            [("f", {}), ("g", {"x": "y"})],
        ),
        ('<tool_call> [{"name": "f", "arguments": {}}]', None, [("f", {})]),
        ("[1, 2]", "[1, 2]", []),
        ("[]", "[]", []),
    ],
)
def test_granite(text: str, content: str | None, called: list[Any]) -> None:
    got = message("granite", text)
    assert got["content"] == content
    assert got.get("tool_calls", []) == calls(*called)


def test_arguments_given_as_text_are_kept_as_text() -> None:
    got = message("hermes", '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>')
    assert got["tool_calls"][0]["function"]["arguments"] == '{"a": 1}'


@pytest.mark.parametrize(
    ("parser", "text"),
    [
        (
            "hermes",
            'Sure. <tool_call>{"name": "f", "arguments": {"a": "<tool_call>"}}</tool_call>\n'
            "<tool_call>broken</tool_call> then <tool_call>"
            '{"name": "g", "arguments": {}}</tool_call>',
        ),
        ("hermes", "\n\n<tool_call>{}</tool_call> done <tool"),
        ("llama3_json", '  <|python_tag|> {"name": "f", "parameters": {"s": "é"}}'),
        ("llama3_json", "  plain text {"),
        ("granite", ' <|tool_call|>[{"name": "f", "arguments": {"a": null}}]'),
        ("granite", "<|tool_cal"),
    ],
)
def test_any_cut_of_the_text_gives_the_same_message(parser: str, text: str) -> None:
    whole = message(parser, text)
    rng = random.Random(parser + text)
    cuts = [[c for c in text]]
    for _ in range(30):
        points = sorted(rng.sample(range(1, len(text)), rng.randint(1, 6)))
        cuts.append([text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)])
    for parts in cuts:
        output = choice_output(AUTO, parser)
        deltas = [delta_of(output.feed(p)) for p in parts] + [delta_of(output.finish())]
        assert reassembled(deltas) == whole, parts


def reassembled(deltas: list[dict[str, Any]]) -> dict[str, Any]:
    """A message from stream deltas, as the openai client's stream helpers build it."""
    content = ""
    calls: dict[int, dict[str, Any]] = {}
    for delta in deltas:
        content += delta.get("content", "")
        for entry in delta.get("tool_calls", []):
            call = calls.setdefault(
                entry["index"],
                {"type": entry["type"], "function": {"name": "", "arguments": ""}},
            )
            assert ("id" in entry) == ("name" in entry["function"])
            call["function"]["name"] += entry["function"].get("name", "")
            call["function"]["arguments"] += entry["function"]["arguments"]
    message: dict[str, Any] = {"role": "assistant", "content": content or None}
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    elif not content:
        message["content"] = ""
    return message


def test_hermes_holds_back_a_possible_tag_and_leading_blanks() -> None:
    output = choice_output(AUTO, "hermes")
    assert output.feed("\n ") == []  # blanks before anything: held (a call may follow)
    assert output.feed("Hi <tool") == [Text("\n Hi ")]
    assert output.feed("_ca") == []
    assert output.feed("ll") == []
    assert output.feed('>{"name": "f", "arguments": {}}') == []
    [call] = output.feed("</tool_call>")
    assert isinstance(call, CallStart) and (call.index, call.name) == (0, "f")
    assert output.feed(" trailing ") == []
    assert output.finish() == [Text(" trailing ")]


def test_forced_outputs() -> None:
    named = ToolChoice("named", (), (("f", {}),), name="f")
    got = message("hermes", '{"a": 1}', named)
    assert got == {"role": "assistant", "content": None, "tool_calls": calls(("f", {"a": 1}))}
    output = choice_output(named, "hermes")
    first, rest = output.feed('{"a"'), output.feed(": 1}")
    assert isinstance(first[0], CallStart) and first[0].arguments == '{"a"'
    assert delta_of(rest) == {"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}
    required = ToolChoice("required", (), (("f", {}), ("g", {})))
    text = '[{"name":"f","arguments":{"a":1}},{"name":"g","arguments":{}}]'
    assert message("hermes", text, required)["tool_calls"] == calls(("f", {"a": 1}), ("g", {}))
    # cut short by max_tokens: not a list of calls, so content
    assert message("hermes", '[{"name":"f","argu', required)["content"] == '[{"name":"f","argu'
    plain = message("hermes", '<tool_call>{"name": "f"}</tool_call>', ToolChoice("none", (), ()))
    assert plain == {"role": "assistant", "content": '<tool_call>{"name": "f"}</tool_call>'}
    assert message("granite", "", None) == {"role": "assistant", "content": ""}  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("template", "parser"),
    [
        ("granite3_instruct.jinja", "granite"),
        ("hermes_tools.jinja", "hermes"),
        ("llama3_instruct.jinja", "hermes"),  # its calls are not described: the default
        ("chatml_qwen2.jinja", "hermes"),
    ],
)
def test_the_parser_guessed_from_the_template(template: str, parser: str) -> None:
    from pathlib import Path

    source = (Path(__file__).parents[2] / "data" / "chat_templates" / template).read_text()
    assert guess_tool_call_parser(source) == parser
    assert guess_tool_call_parser(None) == "hermes"
    llama31 = '<|start_header_id|>ipython ... {"name": function name, "parameters": ...}'
    assert guess_tool_call_parser(llama31) == "llama3_json"
    assert guess_tool_call_parser("{{ '<|python_tag|>' }}") == "llama3_json"
