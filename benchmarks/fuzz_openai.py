"""Hostile OpenAI bodies for the fuzzer (``benchmarks/fuzz.py``): ``POST /v1/completions`` and
``POST /v1/chat/completions`` on the server's HTTP port, streaming and not.

Bodies are drawn with ``hypothesis``, weighted so that most are plausible requests with one
or two odd fields and the rest are hostile as a whole:

* every documented field with its good values and with the wrong JSON types (null, booleans,
  huge and negative integers, ``NaN``/``Infinity``, strings, lists, objects, values nested
  thousands deep), unknown fields;
* chat ``messages`` whose ``content`` is null, a number, an object, or a list of parts of the
  wrong type or with a non-string ``text``; roles odd, not strings or missing;
* ``response_format`` of every kind (``text``, ``json_object``, ``json_schema`` with the
  schemas of :mod:`fuzz_guided`: ``true``/``false``/``{}``, non-objects, 10-3,000 deep,
  unsatisfiable), malformed; ``min_tokens`` with it, sometimes past what it can produce;
* whole bodies: nested thousands deep (``{"x": [[[...]]]}``), invalid JSON, invalid UTF-8,
  UTF-16, not an object, empty; a ``Content-Encoding`` of gzip or deflate (compressed or
  not); 1-4 MB prompts and bodies over the 32 MiB limit.

What a reply may be (:func:`check_reply`): 200; 400; 413 (a body over the limit); 429 (no
concurrency permit); 404 only as OpenAI's ``model_not_found`` for a ``model`` that is not
the served one. Every other status is a finding, and so is every non-200 reply whose body is
not OpenAI's error shape (``{"error": {"message": "...", "type": "...", ...}}``). A 200 must
be well-formed: a JSON completion (one choice per prompt; with logprobs, one token per
counted completion token; a guided output that ended on EOS is what the constraint allows),
or server-sent events that are each JSON and end with ``[DONE]``, an error event (in the
error shape) only with a client error's type.
"""

from __future__ import annotations

import contextlib
import functools
import gzip
import http.client
import json
import zlib
from dataclasses import dataclass
from typing import Any

from fuzz_guided import (
    SPECIAL_TEXTS,
    UNICODE_TEXTS,
    Expect,
    choices,
    expectation,
    grammars,
    one_in,
    regexes,
    schemas,
    weighted,
)
from hypothesis import strategies as st

ROUTES = ("/v1/completions", "/v1/chat/completions")
MAX_BODY_BYTES = 32 * 1024 * 1024
"""The HTTP server's body limit (``tgis/router/edge/openai_routes.py``): 413 beyond."""

ALLOWED_HTTP = frozenset({200, 400, 413, 429})
"""Statuses any hostile body may get; 404 only as ``model_not_found`` (:func:`check_reply`)."""

CLIENT_ERROR_TYPES = frozenset({"invalid_request_error"})
"""Error types a stream may end with: the request's fault (its constraint failed)."""


# ---- raw JSON --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Raw:
    """JSON text spliced into a body as it is (nesting past Python's recursion limit,
    ``NaN``)."""

    text: str


def encode(body: Any, ascii_only: bool = False) -> bytes:
    """``body`` as JSON, each :class:`Raw` in it spliced in as its text."""
    raws: list[str] = []

    def mark(value: Any) -> Any:
        if isinstance(value, Raw):
            raws.append(value.text)
            return f"\x00raw{len(raws) - 1}\x00"
        if isinstance(value, dict):
            return {k: mark(v) for k, v in value.items()}
        if isinstance(value, list):
            return [mark(v) for v in value]
        return value

    text = json.dumps(mark(body), ensure_ascii=ascii_only)
    for i, raw in enumerate(raws):
        text = text.replace(json.dumps(f"\x00raw{i}\x00"), raw, 1)
    return text.encode("utf-8", "surrogatepass")


def describe(body: Any, limit: int = 400) -> str:
    """``body`` on one line, long strings, lists and raw text shortened."""

    def short(value: Any) -> Any:
        if isinstance(value, Raw):
            head = value.text[:30]
            return f"<raw {len(value.text)} chars: {head}…>" if len(value.text) > 30 else head
        if isinstance(value, str) and len(value) > 40:
            return f"{value[:30]}<… {len(value)} chars>"
        if isinstance(value, list):
            items = [short(v) for v in value[:3]]
            return [*items, f"<… {len(value) - 3} more>"] if len(value) > 4 else items
        if isinstance(value, dict):
            return {k: short(v) for k, v in value.items()}
        return value

    text = json.dumps(short(body), ensure_ascii=False, default=str)
    return text if len(text) <= limit else text[:limit] + "…"


# ---- values ----------------------------------------------------------------------------------

I64 = 1 << 63
BIG_INTS = (0, -1, 1, 2, (1 << 31) - 1, 1 << 31, 1 << 32, I64 - 1, I64, 1 << 64, 10**30, -(10**30))


def nested(depth: int, opening: str = "[", closing: str = "]", core: str = "") -> Raw:
    return Raw(opening * depth + core + closing * depth)


@functools.cache
def deep_values() -> st.SearchStrategy[Raw]:
    depth = st.sampled_from((10, 100, 900, 1000, 5000, 100_000))
    return weighted(
        (2, depth.map(nested)),
        (1, depth.map(lambda d: nested(d, '{"a": ', "}", "1"))),
    )


@functools.cache
def texts() -> st.SearchStrategy[str]:
    """A prompt or content: mostly a few words; unicode, special-token text, long."""
    return weighted(
        (60, st.text(alphabet="abcdefgh XYZ.,!?\n", max_size=40)),
        (10, st.text(max_size=40)),
        (8, st.sampled_from((*SPECIAL_TEXTS, *UNICODE_TEXTS, "", "{{ x }}", "{% if %}"))),
        (3, st.integers(1000, 20_000).map(lambda n: "ab " * n)),
    )


@functools.cache
def any_json() -> st.SearchStrategy[Any]:
    """A value of any JSON type, the extremes often."""
    return weighted(
        (3, st.none()),
        (3, st.booleans()),
        (4, st.sampled_from(BIG_INTS)),
        (3, st.sampled_from((Raw("NaN"), Raw("Infinity"), Raw("-Infinity"), 1e308, -0.0, 0.5))),
        (4, st.sampled_from(("", "x", "1", "true", "null", "😀", "</s>"))),
        (2, st.lists(st.integers(-5, 5), max_size=3)),
        (2, st.lists(st.text(max_size=3), max_size=3)),
        (2, st.dictionaries(st.text(max_size=3), st.integers(0, 3), max_size=2)),
        (1, deep_values()),
    )


@functools.cache
def field_values(good: st.SearchStrategy[Any], good_weight: int = 8) -> st.SearchStrategy[Any]:
    """A field's value: mostly ``good``, else any JSON value."""
    return weighted((good_weight, good), (2, any_json()))


# ---- response_format -------------------------------------------------------------------------


@functools.cache
def json_schema_formats() -> st.SearchStrategy[dict[str, Any]]:
    spec = st.builds(
        lambda name, schema, strict: {
            k: v for k, v in (("name", name), ("schema", schema), ("strict", strict)) if v != "-"
        },
        st.sampled_from(("answer", "-", "", "x" * 100)),
        schemas().map(Raw),
        st.sampled_from((True, False, "-", None)),
    )
    return weighted(
        (10, spec.map(lambda s: {"type": "json_schema", "json_schema": s})),
        (1, st.just({"type": "json_schema"})),
        (1, any_json().map(lambda v: {"type": "json_schema", "json_schema": v})),
        (1, any_json().map(lambda v: {"type": "json_schema", "json_schema": {"schema": v}})),
    )


@functools.cache
def response_formats() -> st.SearchStrategy[Any]:
    return weighted(
        (2, st.just({"type": "text"})),
        (4, st.just({"type": "json_object"})),
        (12, json_schema_formats()),
        (2, st.sampled_from(({"type": "regex"}, {"type": None}, {}, {"type": ["json_object"]}))),
        (2, any_json()),
    )


# ---- chat messages ---------------------------------------------------------------------------

ROLES = ("user", "system", "assistant", "tool", "developer", "wizard", "", "USER")


@functools.cache
def contents() -> st.SearchStrategy[Any]:
    part = weighted(
        (8, texts().map(lambda t: {"type": "text", "text": t})),
        (3, any_json().map(lambda v: {"type": "text", "text": v})),
        (1, st.just({"type": "text"})),
        (1, st.just({"type": "image_url", "image_url": {"url": "http://x/y.png"}})),
        (1, st.sampled_from(({"type": None}, {"text": "x"}, {"type": "input_audio"}))),
        (2, any_json()),
    )
    return weighted(
        (20, texts()),
        (4, st.none()),
        (3, st.sampled_from((3, 0.5, True, {"a": 1}, {"type": "text", "text": "x"}))),
        (6, st.lists(part, max_size=3)),
        (2, any_json()),
    )


@st.composite
def messages(draw: st.DrawFn) -> Any:
    role = draw(weighted((12, st.sampled_from(ROLES)), (2, any_json()), (1, st.just("-"))))
    message: dict[str, Any] = {} if role == "-" else {"role": role}
    if not draw(one_in(10)):
        message["content"] = draw(contents())
    if draw(one_in(10)):
        message[draw(st.sampled_from(("name", "tool_calls", "tool_call_id", "x")))] = draw(
            any_json()
        )
    return message


@functools.cache
def message_lists() -> st.SearchStrategy[Any]:
    user = st.builds(lambda t: {"role": "user", "content": t}, texts())
    return weighted(
        (20, st.lists(user, min_size=1, max_size=2)),
        (10, st.lists(messages(), min_size=1, max_size=3)),
        (1, st.just([])),
        (1, any_json()),
        (1, st.integers(1000, 3000).map(lambda n: [{"role": "user", "content": "x"}] * n)),
    )


# ---- bodies ----------------------------------------------------------------------------------


@functools.cache
def _floats(low: float, high: float) -> st.SearchStrategy[float]:
    return weighted((4, st.floats(low, high)), (1, st.sampled_from((low, high, -1.0, high * 2))))


TOKEN_IDS = (0, 1, 2, 3, 4095, 4096, 5000, (1 << 31) - 1, (1 << 32) - 1, 1 << 32, -1)
"""Token ids: the tiny model's special ones, its vocabulary's last (4095) and past it."""


@functools.cache
def logit_biases() -> st.SearchStrategy[Any]:
    """OpenAI's ``logit_bias``: token ids (as strings) to -100..100, past both."""
    key = weighted(
        (4, st.sampled_from(TOKEN_IDS).map(str)),
        (1, st.sampled_from(("a", " 5", "05", "", "1.5", "１"))),
    )
    value = weighted(
        (6, st.sampled_from((-100, 100, 5, 0.5, -1))),
        (1, st.sampled_from((101, -101, Raw("NaN"), "1", None))),
    )
    return weighted(
        (3, st.dictionaries(key, value, max_size=3)),
        (1, st.integers(299, 301).map(lambda n: {str(i): 1 for i in range(n)})),
    )


@functools.cache
def tools() -> st.SearchStrategy[Any]:
    """Chat's ``tools``: function tools whose ``parameters`` are the schemas of
    :mod:`fuzz_guided` (deep, ``true``/``false``, non-objects...), odd tools, many."""
    parameters = weighted((3, schemas().map(Raw)), (1, any_json()))
    function = st.builds(
        lambda name, params: {"type": "function", "function": {"name": name, "parameters": params}},
        st.sampled_from(("f", "g", "", "</s>", "x" * 100)),
        parameters,
    )
    return weighted(
        (6, st.lists(function, min_size=1, max_size=3)),
        (1, st.just([{"type": "function", "function": {"name": "f"}}] * 2)),
        (
            1,
            st.integers(128, 129).map(
                lambda n: [{"type": "function", "function": {"name": f"f{i}"}} for i in range(n)]
            ),
        ),
        (1, st.sampled_from(([], [5], [{"type": "function"}], [{"type": "code_interpreter"}]))),
    )


TOOL_CHOICES = (
    "none", "auto", "required", {"type": "function", "function": {"name": "f"}},
    {"type": "function", "function": {"name": "nope"}}, {"type": "function"}, "any",
)  # fmt: skip

COMMON_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "model": st.sampled_from(("", "tiny", "gpt-4o")),
    "max_tokens": weighted((8, st.integers(1, 6)), (1, st.sampled_from((0, -1, 255, 256)))),
    "temperature": weighted((2, st.just(0)), (3, _floats(0.0, 2.0))),
    "top_p": _floats(0.0, 1.0),
    "top_k": weighted((3, st.integers(-1, 50)), (1, st.sampled_from(BIG_INTS))),
    "n": weighted((4, st.integers(1, 4)), (1, st.sampled_from((0, 128, 129, -1)))),
    "stream": st.booleans(),
    "stream_options": st.sampled_from(({"include_usage": True}, {"include_usage": False}, {})),
    "stop": weighted(
        (3, texts()),
        (3, st.lists(st.sampled_from(("a", " ", "</s>", '"', "x" * 300, "")), max_size=8)),
    ),
    "seed": weighted((3, st.integers(0, 1000)), (1, st.sampled_from(BIG_INTS))),
    "presence_penalty": _floats(-2.0, 2.0),
    "frequency_penalty": _floats(-2.0, 2.0),
    "logit_bias": logit_biases(),
    "response_format": response_formats(),
    "min_tokens": weighted((4, st.integers(0, 4)), (1, st.sampled_from((255, 10**30, -1)))),
    "repetition_penalty": st.sampled_from((1.0, 1.2, 0.0, 1e39, 1e-300, 2)),
    "user": texts(),
    "metadata": st.sampled_from(({}, {"a": "b"})),
    # vLLM's extras
    "min_p": _floats(0.0, 1.0),
    "ignore_eos": st.booleans(),
    "stop_token_ids": st.lists(st.sampled_from(TOKEN_IDS), max_size=3),
    "skip_special_tokens": st.booleans(),
    "include_stop_str_in_output": st.booleans(),
    "spaces_between_special_tokens": st.booleans(),
    "guided_decoding_backend": st.sampled_from(("xgrammar", "outlines", "")),
    "guided_whitespace_pattern": st.sampled_from((r"\s*", "", "(")),
}
COMPLETION_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    **COMMON_FIELDS,
    "logprobs": st.integers(0, 6),
    "echo": st.booleans(),
    "suffix": st.sampled_from(("", "x", None)),
    "best_of": st.sampled_from((1, 2)),
}
CHAT_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    **COMMON_FIELDS,
    "logprobs": st.booleans(),
    "top_logprobs": st.integers(0, 21),
    "max_completion_tokens": weighted((4, st.integers(1, 6)), (1, st.sampled_from((0, 256)))),
    "tools": tools(),
    "tool_choice": st.sampled_from(TOOL_CHOICES),
    "parallel_tool_calls": st.booleans(),
    "modalities": st.sampled_from((["text"], ["audio"])),
    "reasoning_effort": st.sampled_from(("low", None)),
}


@functools.cache
def guided_extras() -> st.SearchStrategy[dict[str, Any]]:
    """vLLM's guided-decoding fields (``guided_*``, ``structured_outputs``) with the
    constraint families of :mod:`fuzz_guided`."""
    schema = weighted((3, schemas().map(Raw)), (1, schemas()), (1, any_json()))
    one = weighted(
        (4, schema.map(lambda v: ("json", v))),
        (4, weighted((5, regexes()), (1, any_json())).map(lambda v: ("regex", v))),
        (4, weighted((5, choices()), (1, any_json())).map(lambda v: ("choice", v))),
        (3, weighted((5, grammars()), (1, any_json())).map(lambda v: ("grammar", v))),
        (1, st.just(("json_object", True))),
    )

    def field(kind_value: tuple[str, Any], structured: bool) -> dict[str, Any]:
        kind, value = kind_value
        if structured or kind == "json_object":
            return {"structured_outputs": {kind: value}}
        return {f"guided_{kind}": value}

    return weighted(
        (6, st.builds(field, one, st.booleans())),
        (1, st.builds(lambda a, b: {**field(a, False), **field(b, True)}, one, one)),
        (1, any_json().map(lambda v: {"structured_outputs": v})),
    )


@functools.cache
def prompts() -> st.SearchStrategy[Any]:
    return weighted(
        (20, texts()),
        (5, st.lists(texts(), min_size=1, max_size=3)),
        (1, st.just([])),
        (1, st.sampled_from(([1, 2, 3], [[1, 2]], ["a", 1], [[]], [[1], "a"], [1.5], [True]))),
        (1, st.lists(st.lists(st.sampled_from(TOKEN_IDS), max_size=3), min_size=1, max_size=2)),
        (1, st.lists(st.sampled_from(TOKEN_IDS), min_size=1, max_size=3)),
        (1, st.sampled_from((600, 5000)).map(lambda n: ["x"] * n)),
        (2, any_json()),
    )


@st.composite
def bodies(draw: st.DrawFn, chat: bool) -> dict[str, Any]:
    """A body for the route: its required field (almost always), a few other fields."""
    body: dict[str, Any] = {}
    if not draw(one_in(30)):  # absent: 16 (completions), the server's limit (chat)
        body["max_tokens"] = draw(st.integers(1, 4))
    if not draw(one_in(30)):
        body["messages" if chat else "prompt"] = draw(message_lists() if chat else prompts())
    fields = CHAT_FIELDS if chat else COMPLETION_FIELDS
    for name in draw(st.lists(st.sampled_from(sorted(fields)), max_size=4, unique=True)):
        body[name] = draw(field_values(fields[name]))
    if draw(one_in(3)):  # guided, the constraint's edges
        if draw(st.booleans()):
            body["response_format"] = draw(response_formats())
        else:
            body.update(draw(guided_extras()))
        if chat and draw(one_in(4)):
            body["tools"] = draw(tools())
            body["tool_choice"] = draw(st.sampled_from(TOOL_CHOICES))
        if draw(st.booleans()):
            body["min_tokens"] = draw(st.integers(1, 12))
            body["max_tokens"] = body["min_tokens"] + draw(st.integers(0, 8))
    if draw(one_in(30)):
        body[draw(st.sampled_from(("x", "guided_regexp", "prompt_logprobs", "")))] = draw(
            any_json()
        )
    return body


# ---- cases -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class HttpCase:
    """One OpenAI request: its route, body and headers, what a 200 must hold.

    ``oversize`` > 0: the body is that many bytes, built when sent.
    """

    route: str
    payload: bytes
    summary: str
    headers: tuple[tuple[str, str], ...] = ()
    stream: bool | None = None
    """Whether a 200 is a stream of events (None: not checked)."""
    prompts: int | None = None
    """Completions: how many choices a 200 carries (None: not checked)."""
    expect: Expect | None = None
    """Guided, without stop or echo: what an output that ended on EOS must be."""
    echo: bool = False
    """Completions with the prompt before the output (and in the logprobs)."""
    oversize: int = 0

    def body(self) -> bytes:
        if not self.oversize:
            return self.payload
        return b'{"prompt": "' + b"a" * (self.oversize - 14) + b'"}'


_CUT_SHORT = (
    "stop", "stop_token_ids", "ignore_eos", "echo", "include_stop_str_in_output", "tools",
)  # fmt: skip
"""Fields that change what an output that ended with finish_reason "stop" is."""


def _reply_checks(route: str, body: dict[str, Any]) -> dict[str, Any]:
    """What a 200 to ``body`` must hold, where cheap to tell."""
    checks: dict[str, Any] = {"stream": body.get("stream") is True}
    n = body.get("n", 1)
    if route == ROUTES[0] and isinstance(n, int) and not isinstance(n, bool):
        prompt = body.get("prompt")
        one = not isinstance(prompt, list) or all(isinstance(t, int) for t in prompt)
        checks["prompts"] = (1 if one else len(prompt)) * n  # a list of ids is one prompt
    checks["echo"] = body.get("echo") is True
    if not any(body.get(name) for name in _CUT_SHORT) and body.get("skip_special_tokens") in (
        None,
        True,
    ):
        checks["expect"] = _constraint_expectation(body)
    return checks


def _constraint_expectation(body: dict[str, Any]) -> Expect | None:
    """What the body's one constraint allows an output that ended on EOS to be."""
    found: list[tuple[str, Any]] = []
    rf = body.get("response_format")
    if isinstance(rf, dict) and rf.get("type") == "json_object":
        found.append(("json_object", None))
    if isinstance(rf, dict) and rf.get("type") == "json_schema":
        spec = rf.get("json_schema")
        found.append(("json_schema", spec.get("schema") if isinstance(spec, dict) else None))
    for kind in ("json", "regex", "choice", "grammar"):
        if f"guided_{kind}" in body:
            found.append((kind, body[f"guided_{kind}"]))
    structured = body.get("structured_outputs")
    if isinstance(structured, dict):
        found += [(k, v) for k, v in structured.items() if v is not None]
    if len(found) != 1:
        return None
    kind, value = found[0]
    if kind in ("json", "json_schema"):
        text = value.text if isinstance(value, Raw) else value
        return expectation("json_schema", text) if isinstance(text, str) else None
    if kind == "choice" and not (
        isinstance(value, list) and all(isinstance(c, str) for c in value)
    ):
        return None
    if kind in ("regex", "grammar") and not isinstance(value, str):
        return None
    return expectation(kind, value)


@st.composite
def http_cases(draw: st.DrawFn, huge: bool = True) -> HttpCase:
    """A request as sent: mostly a body of :func:`bodies`, else hostile as a whole."""
    route = draw(st.sampled_from(ROUTES))
    body = draw(bodies(route == ROUTES[1]))
    data = encode(body, draw(st.booleans()))
    summary = describe(body)
    kind = draw(
        weighted(
            (80, st.just("body")),
            (5, st.just("deep")),
            (4, st.just("invalid json")),
            (3, st.just("invalid utf-8")),
            (3, st.just("encoding")),
            (3, st.just("not an object")),
            (1 if huge else 0, st.just("large")),
            (1 if huge else 0, st.just("oversize")),
        )
    )
    if kind == "body":
        return HttpCase(route, data, summary, **_reply_checks(route, body))
    if kind == "deep":
        depth = draw(st.sampled_from((900, 1000, 5000, 100_000)))
        where = draw(st.sampled_from(("x", "prompt", "messages", "stop", "user")))
        raw = encode({**body, where: nested(depth)})
        return HttpCase(route, raw, f"{where} nested {depth} deep in: {summary}")
    if kind == "invalid json":
        cut = draw(st.integers(0, max(0, len(data) - 1)))
        junk = draw(
            st.sampled_from((data[:cut], data + b"}", data + b"x", b"{'a': 1}", b"{,}", b"\x00"))
        )
        return HttpCase(route, junk, f"invalid JSON {junk[:60]!r} ({len(junk)} bytes)")
    if kind == "invalid utf-8":
        bad = draw(st.sampled_from((b"\xff", b"\xc0\x80", b"\xed\xa0\x80", b"\xe2\x82", b"\x80")))
        at = data.find(b'"', 1) + 1
        return HttpCase(route, data[:at] + bad + data[at:], f"invalid UTF-8 {bad!r} in: {summary}")
    if kind == "encoding":
        return _encoded(draw, route, body, data, summary)
    if kind == "not an object":
        other = draw(st.sampled_from((b"[]", b'"x"', b"3", b"null", b"", b"  ", b"true", b"[{}]")))
        return HttpCase(route, other, f"body {other!r}")
    if kind == "large":
        size = draw(st.sampled_from((1, 2, 4))) << 20
        text = draw(st.sampled_from(("ab ", "😀", "</s>")))
        big = text * (size // len(text.encode()))
        large = (
            {**body, "prompt": big}
            if route == ROUTES[0]
            else {**body, "messages": [{"role": "user", "content": big}]}
        )
        return HttpCase(route, encode(large), f"a {size >> 20} MB field in: {summary}")
    size = MAX_BODY_BYTES + draw(st.integers(1, 1024))
    return HttpCase(route, b"", f"a body of {size} bytes (over the 32 MiB limit)", oversize=size)


def _encoded(
    draw: st.DrawFn, route: str, body: dict[str, Any], data: bytes, summary: str
) -> HttpCase:
    """The body under a Content-Encoding (compressed as it says, or not), or in UTF-16."""
    how = draw(st.sampled_from(("gzip", "deflate", "gzip plain", "deflate plain", "utf-16")))
    if how == "utf-16":
        return HttpCase(route, data.decode().encode("utf-16"), f"UTF-16 body: {summary}")
    name = how.split()[0]
    headers = (("Content-Encoding", name),)
    if how.endswith("plain"):
        return HttpCase(route, data, f"{name} header, plain body: {summary}", headers)
    packed = gzip.compress(data) if name == "gzip" else zlib.compress(data)
    checks = _reply_checks(route, body)
    return HttpCase(route, packed, f"{name} body: {summary}", headers, **checks)


# ---- sending and checking --------------------------------------------------------------------


@dataclass
class HttpReply:
    status: str
    """The HTTP status ("200"), or why there was none ("connection error: ...")."""
    problem: str = ""
    """"" when the reply is allowed and well-formed, else what is wrong."""


def send(address: str, case: HttpCase, timeout: float) -> HttpReply:
    """POST ``case`` to ``address`` (``host:port``) and check the reply."""
    try:
        status, content_type, data = exchange(address, case, timeout)
    except (OSError, http.client.HTTPException) as err:
        return HttpReply(f"connection error: {type(err).__name__}", f"no reply: {err}")
    return check_reply(case, status, content_type, data)


def exchange(address: str, case: HttpCase, timeout: float) -> tuple[int, str, bytes]:
    """POST ``case`` to ``address``: the reply's status, Content-Type and body."""
    host, port = address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        headers = {"Content-Type": "application/json", **dict(case.headers)}
        # the server may answer (413) before it has read everything
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            conn.request("POST", case.route, case.body(), headers)
        response = conn.getresponse()
        return response.status, response.getheader("Content-Type") or "", response.read()
    finally:
        conn.close()


def check_reply(case: HttpCase, status: int, content_type: str, data: bytes) -> HttpReply:
    """Classify one reply (module docstring)."""
    code = str(status)
    if status != 200:
        error = _error_of(data)
        if isinstance(error, str):
            return HttpReply(code, f"{error}: {data[:200]!r}")
        if status == 404 and error.get("code") == "model_not_found":
            return HttpReply(code)
        if status not in ALLOWED_HTTP:
            return HttpReply(code, f"status {status}: {error.get('message')!r}")
        return HttpReply(code)
    events = "text/event-stream" in content_type
    if case.stream is not None and events != case.stream:
        return HttpReply(code, f"a 200 of type {content_type!r} for stream {case.stream}")
    if events:
        return _check_events(case, data)
    try:
        reply = json.loads(data)
    except ValueError:
        return HttpReply(code, f"a 200 that is not JSON: {data[:200]!r}")
    return HttpReply(code, _check_completion(case, reply))


def _error_of(data: bytes) -> dict[str, Any] | str:
    """The ``error`` object of an error body, or why the body is not OpenAI's shape."""
    try:
        body = json.loads(data)
    except ValueError:
        return "an error body that is not JSON"
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict):
        return "an error body without an error object"
    message = error.get("message")
    if not isinstance(message, str) or not message.strip():
        return "an error without a message"
    if not isinstance(error.get("type"), str):
        return "an error without a type"
    return error


def _choice_text(choice: dict[str, Any]) -> str:
    if "text" in choice:
        return str(choice["text"])
    message = choice.get("message") or choice.get("delta") or {}
    return str(message.get("content") or "")


def _logprob_tokens(choice: dict[str, Any]) -> int:
    logprobs = choice.get("logprobs") or {}
    tokens = logprobs.get("tokens", logprobs.get("content"))
    return len(tokens) if isinstance(tokens, list) else 0


def _check_completion(case: HttpCase, reply: Any) -> str:
    choices = reply.get("choices") if isinstance(reply, dict) else None
    if not isinstance(choices, list) or not choices:
        return f"a 200 without choices: {str(reply)[:200]}"
    if case.prompts is not None and len(choices) != case.prompts:
        return f"{len(choices)} choices for {case.prompts} prompts"
    usage = reply.get("usage") or {}
    if any(c.get("logprobs") for c in choices) and not case.echo:
        counted = sum(_logprob_tokens(c) for c in choices)
        if counted != usage.get("completion_tokens"):
            return (
                f"{counted} logprob tokens for completion_tokens {usage.get('completion_tokens')}"
            )
    return _check_outputs(case, {c.get("index", 0): c for c in choices}, _choice_text)


def _check_outputs(case: HttpCase, by_index: dict[Any, Any], text_of: Any) -> str:
    if case.expect is None:
        return ""
    for choice in by_index.values():
        if choice.get("finish_reason") == "stop":
            problem = case.expect.violation(text_of(choice))
            if problem:
                return problem
    return ""


def _check_events(case: HttpCase, data: bytes) -> HttpReply:
    """An SSE reply: ``data:`` events, each JSON, ending with ``[DONE]`` unless the stream
    ended with an error event."""
    events = [e for e in data.decode("utf-8", "replace").split("\n\n") if e.strip()]
    if not events:
        return HttpReply("200", "an event stream without events")
    texts: dict[Any, str] = {}
    finals: dict[Any, dict[str, Any]] = {}
    error_type = None
    for event in events:
        if not event.startswith("data: "):
            return HttpReply("200", f"an event that is not data: {event[:100]!r}")
        payload = event[len("data: ") :]
        if payload == "[DONE]":
            continue
        try:
            chunk = json.loads(payload)
        except ValueError:
            return HttpReply("200", f"an event that is not JSON: {payload[:100]!r}")
        if "error" in chunk:
            error = _error_of(payload.encode())
            if isinstance(error, str):
                return HttpReply("200", f"stream {error}: {payload[:200]!r}")
            error_type = str(error["type"])
            continue
        for choice in chunk.get("choices") or []:
            index = choice.get("index", 0)
            texts[index] = texts.get(index, "") + _choice_text(choice)
            if choice.get("finish_reason"):
                finals[index] = {**choice, "text": texts[index]}
    status = "200" if error_type is None else "200 + error event"
    if events[-1] != "data: [DONE]":
        return HttpReply(status, f"a stream that does not end with [DONE]: {events[-1][:100]!r}")
    if error_type is not None and error_type not in CLIENT_ERROR_TYPES:
        return HttpReply(status, f"a stream that failed with {error_type}")
    return HttpReply(status, _check_outputs(case, finals, _choice_text))
