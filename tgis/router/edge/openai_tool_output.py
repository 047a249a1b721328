"""A chat choice's output as content and tool calls, by the request's ``tool_choice``
(``openai_tools.py: ToolChoice``):

* no tools, or ``none``: every text is content;
* ``auto``: the model's own format, read by the ``--tool-call-parser``
  (``openai_tool_parsers.py``);
* a named function: guided decoding made the whole output that function's arguments, so the
  output *is* one call: its id and name come with the first text, then its arguments as
  they are generated;
* ``required``: guided decoding made the output a JSON list of ``{"name", "arguments"}``
  (``openai_tools.py: forced_constraint``); each item is a call, given at the end. An
  output cut short (``max_tokens``) is not a list: it is content, whole.

Replies (``openai_chat_replies.py``) assemble the pieces: the unary message's ``content``
(None when the choice made calls and said nothing else) and ``tool_calls``; the stream's
deltas, one chunk per event.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from tgis.router.edge.openai_tool_parsers import (
    TOOL_CALL_PARSERS,
    CallArguments,
    CallStart,
    ChoiceOutput,
    Piece,
    Text,
)
from tgis.router.edge.openai_tools import ToolChoice

__all__ = ["choice_output", "delta_of", "message_of"]


class NamedOutput(ChoiceOutput):
    """The output is the arguments of one call to ``name``."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def feed(self, text: str) -> list[Piece]:
        if not self.calls:
            return [self._call(self.name, text)]
        return [CallArguments(0, text)] if text else []

    def finish(self) -> list[Piece]:
        return [] if self.calls else [self._call(self.name, "")]


class RequiredOutput(ChoiceOutput):
    """The output is a JSON list of calls (held until the end)."""

    def __init__(self) -> None:
        super().__init__()
        self.texts: list[str] = []

    def feed(self, text: str) -> list[Piece]:
        self.texts.append(text)
        return []

    def finish(self) -> list[Piece]:
        text = "".join(self.texts)
        try:
            items = json.loads(text)
        except ValueError:
            return [Text(text)]
        if not isinstance(items, list) or not all(_is_call(i) for i in items):
            return [Text(text)]
        return [
            self._call(i["name"], json.dumps(i["arguments"], ensure_ascii=False)) for i in items
        ]


def _is_call(item: object) -> bool:
    return isinstance(item, dict) and isinstance(item.get("name"), str) and "arguments" in item


def choice_output(tools: ToolChoice | None, parser: str) -> ChoiceOutput:
    """The reader of one choice's output."""
    if tools is None or tools.mode == "none":
        return ChoiceOutput()
    if tools.mode == "named":
        return NamedOutput(tools.name)
    if tools.mode == "required":
        return RequiredOutput()
    return TOOL_CALL_PARSERS[parser]()


def _call_body(piece: CallStart | CallArguments) -> dict[str, Any]:
    if isinstance(piece, CallArguments):
        return {"index": piece.index, "function": {"arguments": piece.text}}
    return {
        "index": piece.index,
        "id": piece.id,
        "type": "function",
        "function": {"name": piece.name, "arguments": piece.arguments},
    }


def delta_of(pieces: Sequence[Piece]) -> dict[str, Any]:
    """A stream delta of ``pieces``: their content, their calls ({} for none)."""
    delta: dict[str, Any] = {}
    texts = [p.text for p in pieces if isinstance(p, Text)]
    if texts:
        delta["content"] = "".join(texts)
    calls = [_call_body(p) for p in pieces if not isinstance(p, Text)]
    if calls:
        delta["tool_calls"] = calls
    return delta


def message_of(pieces: Sequence[Piece]) -> dict[str, Any]:
    """The assistant message of a whole choice's pieces."""
    content = "".join(p.text for p in pieces if isinstance(p, Text))
    calls: list[dict[str, Any]] = []
    for piece in pieces:
        if isinstance(piece, CallStart):
            calls.append(_call_body(piece))
            del calls[-1]["index"]
        elif isinstance(piece, CallArguments):
            calls[piece.index]["function"]["arguments"] += piece.text
    message: dict[str, Any] = {"role": "assistant", "content": content or None}
    if calls:
        message["tool_calls"] = calls
    elif not content:
        message["content"] = content
    return message
