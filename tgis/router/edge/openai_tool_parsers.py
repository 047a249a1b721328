"""Tool calls in a model's own output (``tool_choice: auto``): the common formats, read as
the text comes, so a stream and a whole reply say the same thing.

A parser is fed a choice's text as the engine produces it and answers *pieces*: content
text (:class:`Text`), a tool call (:class:`CallStart`, its arguments whole) or more of a call's
arguments (:class:`CallArguments`, forced calls only, ``openai_tool_output.py``). Text that
may be the start of a call is held back until it is known not to be; a call is given once
complete. What a parser decides depends only on the text so far, never on how it was cut
into events, so the concatenated stream is the unary reply.

The formats (``--tool-call-parser``, vLLM's names):

* ``hermes`` (Hermes 2 Pro, Qwen 2.5 and 3, and the many templates that copied them): each
  call is ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``; text outside the
  calls is content unless blank (blanks before any content are held back, and dropped
  if a call follows), and a block that is not such an object is kept as content, tags
  included (a last block left open is read if its JSON is complete);
* ``llama3_json`` (Llama 3.1 to 3.3): the whole output is one or more JSON objects
  ``{"name": ..., "parameters": {...}}`` (``arguments`` also read), separated by ``;``,
  after an optional ``<|python_tag|>``; any other output is content;
* ``granite`` (Granite 3): the output is a JSON list of ``{"name": ..., "arguments": ...}``
  after an optional ``<|tool_call|>`` (or ``<tool_call>``); any other output is content.

An output that starts as calls but does not parse as the format's JSON is content, whole.
Names are not checked against the request's ``tools``: the client gets what the model
said.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

__all__ = [
    "TOOL_CALL_PARSERS",
    "CallArguments",
    "CallStart",
    "ChoiceOutput",
    "Piece",
    "Text",
    "guess_tool_call_parser",
    "tool_call_id",
]


@dataclass(frozen=True, slots=True)
class Text:
    """Content text."""

    text: str


@dataclass(frozen=True, slots=True)
class CallStart:
    """A tool call: its place among the choice's calls, id, function and arguments (JSON
    text; for a forced call being streamed, the start of it)."""

    index: int
    id: str
    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class CallArguments:
    """More of the arguments of call ``index``."""

    index: int
    text: str


Piece = Text | CallStart | CallArguments


def tool_call_id() -> str:
    """A call's id, in OpenAI's form."""
    return "call_" + uuid.uuid4().hex[:24]


class ChoiceOutput:
    """One choice's text in, pieces out; the base reads every text as content."""

    def __init__(self) -> None:
        self.calls = 0  # calls given so far

    def feed(self, text: str) -> list[Piece]:
        return [Text(text)]

    def finish(self) -> list[Piece]:
        """What was held back, at the end of the output."""
        return []

    def _call(self, name: str, arguments: str) -> CallStart:
        self.calls += 1
        return CallStart(self.calls - 1, tool_call_id(), name, arguments)


def _arguments_text(value: object) -> str:
    """A call's arguments as JSON text (a string the model wrote as such is kept)."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _call_of(value: object, *keys: str) -> tuple[str, str] | None:
    """(name, arguments) of a call object with a string ``name`` and its arguments under
    the first of ``keys`` present (absent: ``{}``); None for anything else."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments: Any = next((value[k] for k in keys if k in value), {})
    return value["name"], _arguments_text(arguments)


def _held_length(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that begins ``marker``."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


class HermesOutput(ChoiceOutput):
    """``<tool_call>{...}</tool_call>`` blocks (see the module docstring)."""

    START = "<tool_call>"
    END = "</tool_call>"

    def __init__(self) -> None:
        super().__init__()
        self.buffer = ""
        self.in_calls = False
        self.spoke = False  # content given: blanks are content from then on

    def feed(self, text: str) -> list[Piece]:
        self.buffer += text
        pieces: list[Piece] = []
        if not self.in_calls:
            at = self.buffer.find(self.START)
            if at < 0:
                return self._content(len(self.buffer) - _held_length(self.buffer, self.START))
            before, self.buffer = self.buffer[:at], self.buffer[at:]
            if before and (self.spoke or before.strip()):
                pieces.append(Text(before))
            self.in_calls = True
        while (end := self.buffer.find(self.END)) >= 0:
            block, self.buffer = self.buffer[:end], self.buffer[end + len(self.END) :]
            pieces += self._block(block, closed=True)
        return pieces

    def finish(self) -> list[Piece]:
        block, self.buffer = self.buffer, ""
        if not self.in_calls:
            return [Text(block)] if block else []
        return self._block(block, closed=False)

    def _content(self, size: int) -> list[Piece]:
        """The first ``size`` characters as content; blanks before any content are held
        (dropped if a call follows)."""
        text = self.buffer[:size]
        if not text or not (self.spoke or text.strip()):
            return []
        self.buffer = self.buffer[size:]
        self.spoke = True
        return [Text(text)]

    def _block(self, block: str, *, closed: bool) -> list[Piece]:
        """Text up to and including a call's JSON (its end tag taken off when ``closed``)."""
        at = block.find(self.START)
        before = block if at < 0 else block[:at]
        pieces: list[Piece] = [Text(before)] if before.strip() else []
        if at < 0:
            return pieces
        body = block[at + len(self.START) :]
        try:
            call = _call_of(json.loads(body), "arguments", "parameters")
        except ValueError:
            call = None
        if call is None:
            raw = block[at:] + (self.END if closed else "")
            return [*pieces, Text(raw)]
        return [*pieces, self._call(*call)]


class _LeadingJsonOutput(ChoiceOutput):
    """An output that is calls when, past blanks and an optional marker, it opens with
    ``OPENER``: then held whole and parsed at the end; else content as it comes."""

    MARKERS: tuple[str, ...] = ()
    OPENER = "{"

    def __init__(self) -> None:
        super().__init__()
        self.buffer = ""
        self.mode = ""  # "": not known yet; "text"; "calls"

    def feed(self, text: str) -> list[Piece]:
        if self.mode == "text":
            return [Text(text)] if text else []
        self.buffer += text
        if self.mode == "calls":
            return []
        head = self._after_marker(self.buffer.lstrip())
        if head is None:  # blank, or a marker begun
            return []
        if head.startswith(self.OPENER):
            self.mode = "calls"
            return []
        self.mode = "text"
        text, self.buffer = self.buffer, ""
        return [Text(text)]

    def finish(self) -> list[Piece]:
        text, self.buffer = self.buffer, ""
        if self.mode != "calls":
            return [Text(text)] if text else []
        head = self._after_marker(text.lstrip()) or ""
        calls = self._parse(head.strip())
        if calls is None:
            return [Text(text)]
        return [self._call(*call) for call in calls]

    def _after_marker(self, text: str) -> str | None:
        """``text`` past a marker it starts with (blanks after it dropped); None while
        ``text`` is empty or could still become a marker."""
        for marker in self.MARKERS:
            if text.startswith(marker):
                text = text[len(marker) :].lstrip()
                break
            if marker.startswith(text):
                return None
        return text or None

    def _parse(self, text: str) -> list[tuple[str, str]] | None:
        raise NotImplementedError


class Llama3JsonOutput(_LeadingJsonOutput):
    """Llama 3's JSON calls, ``;``-separated, after an optional ``<|python_tag|>``."""

    MARKERS = ("<|python_tag|>",)
    OPENER = "{"

    def _parse(self, text: str) -> list[tuple[str, str]] | None:
        decoder = json.JSONDecoder()
        calls: list[tuple[str, str]] = []
        at = 0
        while True:
            try:
                value, at = decoder.raw_decode(text, at)
            except ValueError:
                return None
            call = _call_of(value, "parameters", "arguments")
            if call is None:
                return None
            calls.append(call)
            rest = text[at:].lstrip()
            if rest.startswith(";"):
                rest = rest[1:].lstrip()
            elif rest:
                return None
            if not rest:
                return calls
            at = len(text) - len(rest)


class GraniteOutput(_LeadingJsonOutput):
    """Granite's JSON list of calls, after an optional ``<|tool_call|>``."""

    MARKERS = ("<|tool_call|>", "<tool_call>")
    OPENER = "["

    def _parse(self, text: str) -> list[tuple[str, str]] | None:
        try:
            value = json.loads(text)
        except ValueError:
            return None
        if not isinstance(value, list) or not value:
            return None
        calls = [_call_of(item, "arguments", "parameters") for item in value]
        return None if any(c is None for c in calls) else [c for c in calls if c is not None]


TOOL_CALL_PARSERS: dict[str, type[ChoiceOutput]] = {
    "hermes": HermesOutput,
    "llama3_json": Llama3JsonOutput,
    "granite": GraniteOutput,
}
"""``--tool-call-parser``'s values and the parser of each."""


def guess_tool_call_parser(template_source: str | None) -> str:
    """The format a chat template asks its model for: Granite's ``<|tool_call|>``, Llama
    3's ``<|python_tag|>`` or its ``"parameters"`` objects, else Hermes's (the most
    common)."""
    source = template_source or ""
    if "<|tool_call|>" in source:
        return "granite"
    if "<|python_tag|>" in source or ("<|start_header_id|>" in source and "parameters" in source):
        return "llama3_json"
    return "hermes"
