"""Guided-decoding constraints for the fuzzer (``benchmarks/fuzz.py``), shared by its gRPC
part (``DecodingParameters``' ``json_schema``, ``regex``, ``choice``, ``grammar``,
``format``) and its OpenAI part (``response_format``).

The families are the edges of issue 33, each drawn often enough to be hit many times per
run, beside plain constraints that compile and generate:

* special-token text of the embedded tokenizer (``<s>``, ``</s>``, ``<unk>``, ``<pad>``),
  alone and inside text (``x</s>y``, ``a<s>b``), in regexes, choices, grammars, schemas and
  stop sequences;
* large choices (2,001 and 5,000 options, some duplicated, with empty strings, unicode or
  special tokens) and wide alternations (2,001 and 5,000 ways, in regexes and in GBNF and
  Lark grammars);
* JSON schemas ``true``, ``false``, ``{}``, non-objects (``[1]``, ``"x"``, ``3``, ``null``),
  nested 10/63/64/200/600/3000 deep (``properties`` chains, ``items`` chains and raw
  nesting), unsatisfiable, unimplemented keywords, invalid JSON;
* invalid regexes and grammars, and random text in every field.

Schemas are JSON *text* (a 3,000-deep schema is past Python's ``json`` recursion limit):
the OpenAI part splices them into its bodies as they are.

:func:`expectation` says, where it is cheap to tell from the constraint alone, what a
complete output (one that ended on EOS) must be: one of the choices, one of a literal
regex's alternatives, a JSON document (one of an ``enum``'s values).
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from typing import Any, TypeVar

from hypothesis import strategies as st

T = TypeVar("T")


@functools.cache
def uniform(size: int) -> st.SearchStrategy[int]:
    """An integer in ``[0, size)``, about uniformly (:func:`_uniform`)."""
    return _uniform(size)


@st.composite
def _uniform(draw: st.DrawFn, size: int) -> int:
    """An integer in ``[0, size)``, about uniformly. Hypothesis draws 0 far more often than
    other integers (a third of the time inside composite strategies, as its simplest
    value), which made rare branches common; a 0 is drawn again, twice, so that it is
    about as rare as any other value."""
    for _ in range(3):
        point = draw(st.integers(0, size - 1))
        if point:
            return point
    return 0


@functools.cache
def weighted(*choices: tuple[int, st.SearchStrategy[T]]) -> st.SearchStrategy[T]:
    """One of ``choices``, each ``(weight, strategy)`` drawn about ``weight / total`` of the
    time (a weight of 0 leaves its strategy out)."""
    choices = tuple(c for c in choices if c[0] > 0)
    total = sum(w for w, _ in choices)

    def pick(point: int) -> st.SearchStrategy[T]:
        for w, strategy in choices:
            if point < w:
                return strategy
            point -= w
        raise AssertionError("unreachable")

    return uniform(total).flatmap(pick)


@functools.cache
def one_in(n: int) -> st.SearchStrategy[bool]:
    """True about once in ``n`` draws (for the last value: :func:`uniform` draws 0 a little
    less often than the others)."""
    return uniform(n).map(lambda v: v == n - 1)


# ---- special-token text ----------------------------------------------------------------------

SPECIAL_TOKENS = ("<s>", "</s>", "<unk>", "<pad>")
"""The embedded tokenizer's special tokens (tokenizer.json's added tokens)."""

SPECIAL_TEXTS = (
    *SPECIAL_TOKENS,
    "x</s>y",
    "a<s>b",
    "<s></s>",
    "</s></s>",
    " </s>",
    "<unk>x<pad>",
    "</s>\n",
    "<</s>>",
)
"""Texts that spell special tokens, alone or inside other text."""

UNICODE_TEXTS = ("é", "😀", "漢字", "e\u0301", "\u200b", "👩‍👩‍👧‍👦", "\u202e", "ß")

STOP_PIECES = (*SPECIAL_TEXTS, '"', ",", "}", "o1", "w1", "x", "a", "1", " ")
"""Stop sequences for guided requests: pieces their outputs often hold."""

_REGEX_META = frozenset("\\.^$*+?()[]{}#&~")
"""Characters that may make a regex more than a literal alternation."""


# ---- regexes ---------------------------------------------------------------------------------

PLAIN_REGEXES = (
    "[a-z]{1,6}",
    "[0-9]{2,4}",
    "(yes|no)",
    ".{0,5}",
    ".*",
    r"\w+",
    "[A-Z][a-z]*",
    r"\d{3}-\d{4}",
    "(ab)*c",
    "a|b|c",
    "",
    "[^a-z]{1,3}",
)
EMPTY_REGEXES = (r"[^\x00-\x{10ffff}]", r"[a&&b]", r"\b\B", "[^\\s\\S]")
"""Regexes whose language is empty (or that the engine refuses as such)."""
INVALID_REGEXES = (
    "((",
    "[",
    "*",
    "a{2,1}",
    "\\",
    "(?P<n>a)(?P<n>b)",
    r"\p{Nope}",
    "(?<=a)b",
    "a{1000000}",
    "(a|b){1000}{1000}",
)


def alternation(count: int, stem: str = "w", sep: str = "|", quote: bool = False) -> str:
    """``count`` alternatives ``stem0 | stem1 | ...`` (quoted for grammars)."""
    words = (f"{stem}{i}" for i in range(count))
    return sep.join(json.dumps(w) if quote else w for w in words)


@functools.cache
def regexes() -> st.SearchStrategy[str]:
    special = st.sampled_from(SPECIAL_TEXTS)
    return weighted(
        (20, special),
        (6, st.lists(special, min_size=2, max_size=3, unique=True).map("|".join)),
        (3, st.sampled_from(("(</s>)+", "<s>.{0,3}", "[<>/s]+", "x(</s>|<s>)y", r"\<s\>"))),
        (20, st.sampled_from(PLAIN_REGEXES)),
        (8, st.sampled_from((2001, 5000, 20)).map(alternation)),
        (5, st.sampled_from(EMPTY_REGEXES)),
        (8, st.sampled_from(INVALID_REGEXES)),
        (6, st.text(max_size=20)),
    )


# ---- choices ---------------------------------------------------------------------------------

CHOICE_POOL = (*SPECIAL_TEXTS, *UNICODE_TEXTS, "yes", "no", "", " a", "a ", "x" * 300, "\n")


def large_choices(count: int, duplicates: bool, extra: str, stem: str) -> list[str]:
    """``count`` options ``stem0 ...`` (each twice with ``duplicates``), then ``extra``
    (an empty string, unicode or special-token text) unless it is ``"-"``."""
    options = [f"{stem}{i}" for i in range(count)]
    if duplicates:
        options += options
    return [*options, extra] if extra != "-" else options


@functools.cache
def choices() -> st.SearchStrategy[list[str]]:
    return weighted(
        (4, st.lists(st.sampled_from(CHOICE_POOL), max_size=1)),  # refused: fewer than two
        (20, st.lists(st.sampled_from(CHOICE_POOL), min_size=2, max_size=5)),
        (
            14,
            st.builds(
                large_choices,
                st.sampled_from((2001, 5000)),
                st.booleans(),
                st.sampled_from(("-", "", "😀", "</s>", "a<s>b")),
                st.sampled_from(("o", "é", "</s>", "<s>x", " ")),
            ),
        ),
        (4, st.lists(st.text(max_size=6), min_size=2, max_size=6)),
    )


# ---- grammars --------------------------------------------------------------------------------

PLAIN_GRAMMARS = (
    'root ::= "yes" | "no"',
    "root ::= [a-z]+",
    'root ::= "a" root | "b"',
    'root ::= "(" root ")" | ""',
    'start: "yes" | "no"',
    "start: /[0-9]+/",
    'start: %json {"type": "object", "properties": {"a": {"type": "integer"}}}',
    "start: %json true",
)
SPECIAL_GRAMMARS = (
    'root ::= "</s>" | "a<s>b"',
    'root ::= "x</s>y"',
    'start: "<unk>" | "<pad>"',
    'start: "a" "</s>" "b"',
    "start: <s>",
    "start: <[2]>",
    'start: "x" <[2]>',
)
INVALID_GRAMMARS = (
    "root ::= (",
    "start: ",
    "garbage",
    "root ::= root",
    'root ::= "a" undefined',
    "start: /((/",
    r"start: /[^\x00-\x{10ffff}]/",
    "start: %json false",
    "start: %json [1]",
    "%ignore",
)


def wide_grammar(count: int, lark: bool) -> str:
    head = "start: " if lark else "root ::= "
    return head + alternation(count, sep=" | ", quote=True)


def nested_grammar(depth: int) -> str:
    return "root ::= " + "(" * depth + '"a"' + ")" * depth


@functools.cache
def grammars() -> st.SearchStrategy[str]:
    return weighted(
        (10, st.sampled_from(PLAIN_GRAMMARS)),
        (10, st.sampled_from(SPECIAL_GRAMMARS)),
        (10, st.builds(wide_grammar, st.sampled_from((2001, 5000, 50)), st.booleans())),
        (3, st.sampled_from((10, 200, 1000, 5000)).map(nested_grammar)),
        (3, st.sampled_from((64, 600, 3000)).map(lambda d: "start: %json " + properties_chain(d))),
        (8, st.sampled_from(INVALID_GRAMMARS)),
        (4, st.text(max_size=30)),
    )


# ---- JSON schemas (as text) ------------------------------------------------------------------

SCHEMA_DEPTHS = (10, 63, 64, 200, 600, 3000)

SCHEMA_FORMS = ("true", "false", "{}", "[1]", '"x"', "3", "null", "[]", "1.5e308", "-0")
"""Valid JSON that is not an object schema, and the boolean schemas."""

PLAIN_SCHEMAS = (
    '{"type": "object", "properties": {"name": {"type": "string", "maxLength": 5}}, '
    '"required": ["name"], "additionalProperties": false}',
    '{"type": "string", "maxLength": 3}',
    '{"type": "integer"}',
    '{"type": "boolean"}',
    '{"type": "array", "items": {"type": "integer"}, "maxItems": 2}',
    '{"enum": ["a</s>b", "<s>", "c"]}',
    '{"const": "</s>"}',
    '{"type": "string", "pattern": "x</s>y"}',
    '{"enum": [1, "1", null, true, [1], {"a": 1}]}',
    '{"type": "object"}',
)
UNSATISFIABLE_SCHEMAS = (
    '{"type": "string", "minLength": 5, "maxLength": 2}',
    '{"allOf": [{"type": "string"}, {"type": "integer"}]}',
    '{"enum": []}',
    '{"anyOf": []}',
    '{"type": "integer", "minimum": 5, "maximum": 1}',
    '{"type": "array", "minItems": 3, "maxItems": 1}',
    '{"type": "object", "required": ["a"], "additionalProperties": false}',
    '{"type": "object", "properties": {"a": false}, "required": ["a"]}',
    '{"not": {}}',
    '{"type": "nonsense"}',
    '{"$ref": "#/definitions/nope"}',
    '{"$ref": "#"}',
    '{"type": "string", "pattern": "(("}',
    '{"type": "string", "format": "not-a-format"}',
)
INVALID_JSON = ("{", '{"type":', "{'type': 'object'}", "", "   ", "{}}", "NaN", '{"a": NaN}')


def properties_chain(depth: int) -> str:
    """An object schema whose property ``a`` is such an object, ``depth`` levels deep."""
    head = '{"type": "object", "properties": {"a": '
    return head * depth + '{"type": "integer"}' + '}, "required": ["a"]}' * depth


def items_chain(depth: int) -> str:
    """An array schema whose items are such arrays, ``depth`` levels deep."""
    return '{"type": "array", "items": ' * depth + '{"type": "integer"}' + "}" * depth


def raw_objects(depth: int) -> str:
    """``{"a": {"a": ... 1}}``: an object nested ``depth`` deep (unknown keywords)."""
    return '{"a": ' * depth + "1" + "}" * depth


def raw_arrays(depth: int) -> str:
    """``[[[...]]]``: arrays nested ``depth`` deep (not a schema)."""
    return "[" * depth + "]" * depth


def enum_schema(count: int) -> str:
    return json.dumps({"enum": [f"o{i}" for i in range(count)]})


@functools.cache
def schemas() -> st.SearchStrategy[str]:
    depths = weighted((4, st.sampled_from(SCHEMA_DEPTHS)), (1, st.integers(1, 130)))
    return weighted(
        (16, st.sampled_from(SCHEMA_FORMS)),
        (12, st.sampled_from(PLAIN_SCHEMAS)),
        (6, depths.map(properties_chain)),
        (4, depths.map(items_chain)),
        (3, depths.map(raw_objects)),
        (3, depths.map(raw_arrays)),
        (10, st.sampled_from(UNSATISFIABLE_SCHEMAS)),
        (3, st.sampled_from((2001, 5000)).map(enum_schema)),
        (6, st.sampled_from(INVALID_JSON)),
        (3, st.text(max_size=20)),
    )


# ---- what a complete output must be ----------------------------------------------------------


@dataclass(frozen=True)
class Expect:
    """What an output that ended on EOS must be (None / False: not checked)."""

    texts: frozenset[str] | None = None
    """Exactly one of these."""
    json: bool = False
    """A JSON document."""
    json_values: tuple[Any, ...] | None = None
    """A JSON document equal to one of these."""

    def violation(self, text: str) -> str:
        """ "" when ``text`` is a complete output this allows, else what is wrong."""
        if self.texts is not None and text not in self.texts:
            return f"output {text[:80]!r} is not one of the {len(self.texts)} allowed"
        if self.json or self.json_values is not None:
            try:
                value = json.loads(text)
            except ValueError:
                return f"output {text[:80]!r} is not a JSON document"
            if self.json_values is not None and not any(
                _json_equal(value, v) for v in self.json_values
            ):
                return f"output {text[:80]!r} is not one of the schema's values"
        return ""


def _json_equal(a: Any, b: Any) -> bool:
    return type(a) is type(b) and a == b


_LITERAL_GRAMMAR = re.compile(r'(?:root ::=|start:) ("(?:[^"\\]|\\.)*"(?: \| "(?:[^"\\]|\\.)*")*)')


def expectation(kind: str, value: Any) -> Expect | None:
    """What a complete output of the constraint ``kind`` (a ``DecodingParameters`` guided
    field, or ``json_object``) with ``value`` must be, where the constraint alone says so
    cheaply; None where it does not."""
    if kind == "choice":
        return Expect(texts=frozenset(value))
    if kind == "regex":
        if _REGEX_META.isdisjoint(value):
            return Expect(texts=frozenset(value.split("|")))
        return None
    if kind == "grammar":
        match = _LITERAL_GRAMMAR.fullmatch(value)
        if match is None:
            return None
        return Expect(texts=frozenset(json.loads(w) for w in match.group(1).split(" | ")))
    if kind in ("format", "json_object"):
        return Expect(json=True) if value == 1 or kind == "json_object" else None
    if kind == "json_schema":
        return _schema_expectation(value)
    return None


def _schema_expectation(text: str) -> Expect | None:
    if len(text) > 100_000:
        return Expect(json=True)
    try:
        schema = json.loads(text)
    except (ValueError, RecursionError):
        return Expect(json=True)
    if isinstance(schema, dict):
        if isinstance(schema.get("enum"), list):
            return Expect(json_values=tuple(schema["enum"]))
        if "const" in schema:
            return Expect(json_values=(schema["const"],))
    return Expect(json=True)
