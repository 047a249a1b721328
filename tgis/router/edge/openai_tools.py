"""Tool calling's request side on ``/v1/chat/completions``: ``tools``, ``tool_choice`` and
``parallel_tool_calls`` read and checked, the constraint that forces a call, and the
conversation's tool turns as chat templates expect them.

* ``tools``: function tools ``{"type": "function", "function": {"name", "description",
  "parameters", "strict"}}``, names unique; ``parameters`` (a JSON schema object) defaults
  to an object without properties. They go to the chat template as ``tools``, as given.
* ``tool_choice``: ``none`` (the default without tools), ``auto`` (the default with them:
  the model answers or calls in its own format, read by the ``--tool-call-parser``),
  ``required`` or a named function ``{"type": "function", "function": {"name"}}``. The last
  two are forced by guided decoding, so the arguments always fit their schemas: a named
  call's output is its arguments, by the function's schema; ``required`` outputs a JSON
  list of one or more ``{"name", "arguments"}`` objects (one when ``parallel_tool_calls``
  is false), each by its function's schema: an llguidance Lark grammar with one ``%json``
  rule per function, so every schema keeps its own ``$ref`` root. Neither goes with
  another constraint (``response_format``, vLLM's ``guided_*``).
* Messages: an assistant message's ``tool_calls`` arguments (JSON text in OpenAI's form)
  reach the template parsed into objects, as transformers' templates expect them (vLLM
  does the same); text that is not a JSON object stays text. ``tool`` messages keep their
  ``tool_call_id``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tgis.router.edge.openai_extras import schema_text
from tgis.router.edge.openai_fields import bad_request, optional_bool
from tgis.router.request_types import GuidedKind, GuidedRequest

__all__ = ["ToolChoice", "forced_constraint", "read_tools", "template_message"]

MAX_TOOLS = 128  # OpenAI's limit
_EMPTY_PARAMETERS = {"type": "object", "properties": {}}
_COMPACT = {"whitespace_flexible": False}  # the guided JSON of the other fields is compact


@dataclass(frozen=True)
class ToolChoice:
    """The request's tools and what it lets the model do with them."""

    mode: str  # "none", "auto", "required" or "named"
    tools: tuple[dict[str, Any], ...]  # as given, for the chat template
    schemas: tuple[tuple[str, dict[str, Any]], ...]  # (name, parameters) of each
    name: str = ""  # the named function
    parallel: bool = True

    @property
    def forced(self) -> bool:
        return self.mode in ("required", "named")


def read_tools(fields: Mapping[str, Any]) -> ToolChoice | None:
    """The body's tools and tool choice, checked (400 naming the field); None without
    tools."""
    tools = fields.get("tools")
    choice = fields.get("tool_choice")
    parallel = optional_bool(fields, "parallel_tool_calls")
    if tools is None or tools == []:
        if choice not in (None, "none"):
            raise bad_request("tool_choice needs tools", "tool_choice")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise bad_request(f"tools must be a list of at most {MAX_TOOLS} tools", "tools")
    schemas = tuple(_function(i, tool) for i, tool in enumerate(tools))
    names = [name for name, _ in schemas]
    if len(set(names)) < len(names):
        raise bad_request("tools must have different function names", "tools")
    mode, name = _choice(choice, names)
    return ToolChoice(mode, tuple(tools), schemas, name, parallel is not False)


def _function(index: int, tool: object) -> tuple[str, dict[str, Any]]:
    where = f"tools[{index}]"
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise bad_request(f"{where} must be a function tool: {{type: function, ...}}", "tools")
    function = tool.get("function")
    if not isinstance(function, dict):
        raise bad_request(f"{where}.function must be an object", "tools")
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise bad_request(f"{where}.function.name must be a non-empty string", "tools")
    for key in ("description",):
        if function.get(key) is not None and not isinstance(function[key], str):
            raise bad_request(f"{where}.function.{key} must be a string", "tools")
    parameters = function.get("parameters")
    if parameters is None:
        parameters = _EMPTY_PARAMETERS
    if not isinstance(parameters, dict):
        raise bad_request(f"{where}.function.parameters must be a JSON schema object", "tools")
    schema_text(parameters, "tools")  # refuses one nested too deeply to serialize
    return name, parameters


def _choice(choice: object, names: list[str]) -> tuple[str, str]:
    """(mode, the named function or "")."""
    if choice is None:
        return "auto", ""
    if choice in ("none", "auto", "required"):
        return str(choice), ""
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind != "function" or not isinstance(name, str):
        raise bad_request(
            'tool_choice must be "none", "auto", "required" or '
            '{"type": "function", "function": {"name": ...}}',
            "tool_choice",
        )
    if name not in names:
        raise bad_request(f"tool_choice names a function not in tools: {name}", "tool_choice")
    return "named", name


def forced_constraint(tools: ToolChoice) -> GuidedRequest | None:
    """The guided-decoding constraint that forces the choice's call(s), if it forces any."""
    if tools.mode == "named":
        parameters = dict(tools.schemas)[tools.name]
        return GuidedRequest(GuidedKind.JSON_SCHEMA, text=schema_text(parameters, "tools"))
    if tools.mode != "required":
        return None
    rules = []
    for i, (name, parameters) in enumerate(tools.schemas):
        head = json.dumps('{"name":' + json.dumps(name, ensure_ascii=False) + ',"arguments":')
        schema = json.dumps({**parameters, "x-guidance": _COMPACT}, ensure_ascii=False)
        rules.append(f'call_{i}: {head} args_{i} "}}"\nargs_{i}: %json {schema}')
    calls = " | ".join(f"call_{i}" for i in range(len(tools.schemas)))
    more = ' ("," call)*' if tools.parallel else ""
    grammar = "\n".join([f'start: "[" call{more} "]"', f"call: {calls}", *rules])
    return GuidedRequest(GuidedKind.GRAMMAR, text=grammar)


def template_message(message: Mapping[str, Any]) -> Mapping[str, Any]:
    """An assistant message's tool calls with their arguments as objects (see the module
    docstring); 400 for calls that are not OpenAI's shape."""
    calls = message.get("tool_calls")
    if calls is None:
        return message
    if message.get("role") != "assistant" or not isinstance(calls, list):
        raise bad_request("tool_calls must be a list, in an assistant message", "messages")
    parsed = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise bad_request(
                "each tool call must be {id, type: function, function: {name, arguments}}",
                "messages",
            )
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                value = json.loads(arguments)
            except ValueError:
                value = None
            if isinstance(value, dict):
                arguments = value
        parsed.append({**call, "function": {**function, "arguments": arguments}})
    return {**message, "tool_calls": parsed}
