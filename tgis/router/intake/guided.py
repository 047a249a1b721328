"""Guided decoding at intake: the client's constraint, compiled and checked before queueing.

A request's ``GuidedRequest`` (vllm-tgis-adapter's ``oneof guided``, converted at the edge)
becomes an llguidance grammar here: ``json_schema`` a JSON-schema grammar (``true`` is any
JSON value, ``false`` is refused: no document is valid), ``format: JSON`` the schema
``{"type": "object"}``, ``regex`` a full-match regex, ``choice`` one lexeme whose only
spellings are the choices (a lexeme, not a rule of alternatives: any number of choices fits
the parser's rows), ``grammar`` a GBNF/EBNF (``root ::= ...``) or Lark (``start: ...``)
grammar. JSON is compact (no whitespace between tokens: a weak model cannot wander in blanks)
and strict (a schema keyword llguidance does not implement is refused, naming it, rather
than ignored).

Admission checks what generation will do, with the shard's tokenizer view and parser limits
(``tgis/grammar_engine.py``): the grammar is validated against the model's tokenizer
(``LLMatcher.validate_grammar``), then a matcher is built and its first token mask computed,
so a grammar that allows no output, or breaks a parser limit at its start, is refused here
instead of failing after tokens were generated. This runs in a thread pool, never on the
event loop, within ``COMPILE_TIMEOUT_S``. Every refusal is a ``ValidationError``
(INVALID_ARGUMENT) with one short line from the compiler (``short_error``: never the
grammar or the parser's state). Compiled grammars are cached by (kind, text), at most
``CACHE_CAPACITY`` of them, so a repeated schema compiles once; refusals are not cached. The
shard builds its matchers from the grammar text that travels in ``SamplingParams.grammar``
(``shard/step/guided.py``).
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from tgis.grammar_engine import grammar_tokenizer, parser_limits, short_error
from tgis.router.errors import ValidationError
from tgis.router.intake.lookup_cache import LookupCache
from tgis.router.ops.metrics import Metrics
from tgis.router.request_types import GuidedKind, GuidedRequest

if TYPE_CHECKING:
    import llguidance

__all__ = [
    "CACHE_CAPACITY",
    "COMPILE_TIMEOUT_S",
    "GrammarCompiler",
    "grammar_source",
    "json_grammar",
]

CACHE_CAPACITY = 256
"""Compiled grammars kept (least recently used dropped first)."""
COMPILE_TIMEOUT_S = 10.0
"""Seconds a compilation may take before the request is refused."""

CHOICES_MESSAGE = "Must provide at least two choices"
"""vllm-tgis-adapter's message for a ``choice`` with fewer than two strings."""

# Compact JSON: no whitespace between tokens (llguidance's default allows any).
_JSON_OPTIONS = {"whitespace_flexible": False}


def json_grammar(schema: str) -> str:
    """The llguidance grammar of documents valid for ``schema`` (JSON text), compact."""
    import llguidance

    return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=_JSON_OPTIONS)  # type: ignore[arg-type]


def grammar_source(request: GuidedRequest) -> str:
    """The llguidance grammar of ``request``, unchecked (``ValidationError`` for what can be
    refused without compiling)."""
    import llguidance

    kind = request.kind
    if kind is GuidedKind.JSON_OBJECT:
        if request.text:
            raise ValidationError(f"format must be TEXT (0) or JSON (1), got {request.text}")
        return json_grammar('{"type": "object"}')
    if kind is GuidedKind.JSON_SCHEMA:
        return _schema_grammar(request.text)
    try:
        if kind is GuidedKind.REGEX:
            return llguidance.LLMatcher.grammar_from_regex(request.text)
        if kind is GuidedKind.CHOICE:
            return _choice_grammar(request.choices)
        return llguidance.grammar_from("grammar", request.text)
    except ValueError as err:
        raise ValidationError(f"Invalid {kind.field}: {short_error(str(err))}") from None


def _schema_grammar(text: str) -> str:
    """``json_schema``'s grammar: any JSON object schema, ``true`` (any value); ``false``
    and schemas too deep for the compiler are refused."""
    try:
        schema = json.loads(text)
        if isinstance(schema, dict):
            text = json.dumps(schema)
    except RecursionError:
        raise ValidationError(_TOO_DEEP) from None
    except ValueError as err:
        raise ValidationError(f"json_schema is not valid JSON: {err}") from None
    if schema is True:
        text = "{}"
    elif schema is False:
        raise ValidationError("json_schema false allows no JSON document")
    elif not isinstance(schema, dict):
        raise ValidationError("json_schema must be a JSON object, true or false")
    try:
        return json_grammar(text)
    except ValueError as err:
        reason = short_error(str(err))
        if "recursion limit" in reason:
            raise ValidationError(_TOO_DEEP) from None
        raise ValidationError(f"Invalid json_schema: {reason}") from None


_TOO_DEEP = "json_schema is nested too deeply for the grammar compiler"


def _choice_grammar(choices: tuple[str, ...]) -> str:
    """One lexeme spelled as any of ``choices``: the lexer matches them all at once, where
    a rule of N alternatives put N items in the parser's row."""
    import llguidance

    if len(choices) < 2:
        raise ValidationError(CHOICES_MESSAGE)
    spellings = " | ".join(json.dumps(choice) for choice in choices)
    return llguidance.LLMatcher.grammar_from_lark(f"start: CHOICE\nCHOICE: {spellings}")


def _cache_key(request: GuidedRequest) -> str:
    body = json.dumps(request.choices) if request.kind is GuidedKind.CHOICE else request.text
    return f"{request.kind.value}\x00{body}"


def _request_of(key: str) -> GuidedRequest:
    kind_value, body = key.split("\x00", 1)
    kind = GuidedKind(kind_value)
    if kind is GuidedKind.CHOICE:
        return GuidedRequest(kind, choices=tuple(json.loads(body)))
    return GuidedRequest(kind, text=body)


class GrammarCompiler:
    """Compiles requests' constraints for one model (its tokenizer.json, vocabulary size
    and EOS ids), off the event loop, with a cache.

    The llguidance tokenizer is built on first use, in the pool (a 128k vocabulary takes
    a moment), from ``tokenizer_json()``, so a server that never sees a guided request
    neither serializes its tokenizer nor builds it.
    """

    def __init__(
        self,
        tokenizer_json: Callable[[], str],
        vocab_size: int,
        eos_token_ids: tuple[int, ...],
        metrics: Metrics,
        *,
        timeout: float = COMPILE_TIMEOUT_S,
        capacity: int = CACHE_CAPACITY,
        workers: int = 2,
    ) -> None:
        self._tokenizer_json = tokenizer_json
        self._vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._metrics = metrics
        self._timeout = timeout
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="grammar")
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._cache: LookupCache[str] = LookupCache(
            self._compile_key, capacity=capacity, ttl=math.inf, on_loaded=metrics.guided_compiled
        )

    async def compile(self, request: GuidedRequest) -> str:
        """The checked llguidance grammar of ``request`` (cached).

        Raises:
            ValidationError: the compiler's refusal, or a compilation past the timeout.
        """
        self._metrics.guided_request(request.kind.value)
        try:
            return await self._cache.get(_cache_key(request))
        except ValidationError:
            self._metrics.guided_compile_failed(request.kind.value)
            raise

    async def _compile_key(self, key: str) -> str:
        """A cache miss: compile in the pool, within the timeout."""
        request = _request_of(key)
        loop = asyncio.get_running_loop()
        work = loop.run_in_executor(self._executor, self._compile, request)
        try:
            return await asyncio.wait_for(work, self._timeout)
        except TimeoutError:
            raise ValidationError(
                f"compiling the {request.kind.field} took longer than {self._timeout:g} s"
            ) from None

    def _compile(self, request: GuidedRequest) -> str:
        """In the pool: build the grammar, check it with the model's tokenizer, then start
        a matcher on it as the shard will and compute its first mask."""
        import llguidance

        grammar = grammar_source(request)
        field = request.kind.field
        tokenizer = self._llg_tokenizer()
        limits = parser_limits()
        error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer, limits=limits)
        if error:
            if request.kind is GuidedKind.JSON_SCHEMA and "recursion limit" in error:
                raise ValidationError(_TOO_DEEP)
            raise ValidationError(f"Invalid {field}: {short_error(error)}")
        matcher = llguidance.LLMatcher(tokenizer, grammar, limits=limits, log_level=0)
        first = matcher.compute_bitmask()
        error = matcher.get_error() if matcher.is_error() else ""
        if not any(first) or error.startswith("NoExtensionBias"):
            raise ValidationError(f"The {field} allows no output")
        if error:
            raise ValidationError(f"Invalid {field}: {short_error(error)}")
        return grammar

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            self._tokenizer = grammar_tokenizer(self._tokenizer_json(), self._vocab_size, self._eos)
        return self._tokenizer

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
