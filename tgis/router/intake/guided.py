"""Guided decoding at intake: the client's constraint, compiled and checked before queueing.

A request's ``GuidedRequest`` (vllm-tgis-adapter's ``oneof guided``, converted at the edge)
becomes an llguidance grammar here: ``json_schema`` a JSON-schema grammar, ``format: JSON``
the schema ``{"type": "object"}``, ``regex`` a full-match regex, ``choice`` a grammar whose
only sentences are the choices, ``grammar`` a GBNF/EBNF (``root ::= ...``) or Lark
(``start: ...``) grammar. JSON is compact (no whitespace between tokens: a weak model cannot
wander in blanks) and strict (a schema keyword llguidance does not implement is refused,
naming it, rather than ignored).

The compiler checks the grammar against the model's tokenizer (``LLMatcher.validate_grammar``,
which builds what a matcher builds) in a thread pool, never on the event loop, within
``COMPILE_TIMEOUT_S``; llguidance's own parser limits bound the work behind it. Every refusal
is a ``ValidationError`` (INVALID_ARGUMENT) carrying the compiler's message. Compiled grammars
are cached by (kind, text), at most ``CACHE_CAPACITY`` of them, so a repeated schema compiles
once; refusals are not cached. The shard builds its matchers from the grammar text that
travels in ``SamplingParams.grammar`` (``shard/step/guided.py``).
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

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
        try:
            schema = json.loads(request.text)
        except ValueError as err:
            raise ValidationError(f"json_schema is not valid JSON: {err}") from None
        if not isinstance(schema, dict | bool):
            raise ValidationError("json_schema must be a JSON object")
        return json_grammar(json.dumps(schema))
    if kind is GuidedKind.REGEX:
        return llguidance.LLMatcher.grammar_from_regex(request.text)
    if kind is GuidedKind.CHOICE:
        if len(request.choices) < 2:
            raise ValidationError(CHOICES_MESSAGE)
        lark = "start: " + " | ".join(json.dumps(choice) for choice in request.choices)
        return llguidance.LLMatcher.grammar_from_lark(lark)
    try:
        return llguidance.grammar_from("grammar", request.text)
    except ValueError as err:
        raise ValidationError(f"Invalid grammar: {err}") from None


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
        """In the pool: build the grammar and check it with the model's tokenizer."""
        import llguidance

        grammar = grammar_source(request)
        error = llguidance.LLMatcher.validate_grammar(grammar, self._llg_tokenizer())
        if error:
            raise ValidationError(f"Invalid {request.kind.field}: {error.strip()}")
        return grammar

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            import llguidance

            self._tokenizer = llguidance.LLTokenizer(
                self._tokenizer_json(), n_vocab=self._vocab_size, eos_token=self._eos or None
            )
        return self._tokenizer

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
