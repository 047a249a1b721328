"""HF TGI's request bodies in (``POST /generate``, ``/generate_stream``, ``/``, ``/tokenize``),
:class:`GenerationCall` s out, and TGI's error shape.

A body is ``{"inputs": str, "parameters": {...}, "stream": bool}`` (``stream`` chooses only
on ``POST /``). Every parameter TGI documents is known here; ``null`` is the same as absent
(TGI's own client sends every field). A parameter that would change the output and that
tgis cannot honour is refused with 422 naming it, never ignored: ``best_of`` > 1,
``watermark`` true, a non-zero ``frequency_penalty`` (TGI's is normalized by the sequence
length, prompt included; the engine has none of that kind), a grammar other than ``json`` /
``regex``. An unknown field is refused too (TGI would ignore it).

The mapping onto the engine, as TGI's: sampling when ``do_sample`` or any warper is set
(``temperature`` other than 1, ``top_k``, ``top_p`` or ``typical_p`` below 1), else greedy
(with ``repetition_penalty`` still applied); ``max_new_tokens`` 100 when absent (capped at
the server's limit), the server's limit when ``null``; ``stop`` sequences are kept in the
text (TGI does); ``truncate`` keeps the last tokens; ``grammar`` goes through guided
decoding (``json``: a JSON schema, an object or its text; ``regex``); ``adapter_id`` is the
gRPC API's LoRA / prompt-tuning adapter. TGIS's validation then applies, with its messages.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tgis.router.intake.admission import GenerationCall
from tgis.router.request_types import (
    GenerationParams,
    GuidedKind,
    GuidedRequest,
    ResponseOptions,
    SamplingParams,
    StoppingParams,
)

__all__ = [
    "DEFAULT_MAX_NEW_TOKENS",
    "TGIError",
    "TGIRequest",
    "TokenizeRequest",
    "parse_generate",
    "parse_tokenize",
    "validation_error",
]

DEFAULT_MAX_NEW_TOKENS = 100  # TGI's default when the body has no max_new_tokens
_MAX_TOP_K = (1 << 31) - 1  # the gRPC API's largest top_k (its uint32 is read as an int32)
_MAX_SEED = (1 << 64) - 1

_TOP_FIELDS = frozenset({"inputs", "parameters", "stream", "add_special_tokens"})
_PARAMETERS = frozenset(
    {
        "adapter_id",
        "best_of",
        "decoder_input_details",
        "details",
        "do_sample",
        "frequency_penalty",
        "grammar",
        "max_new_tokens",
        "repetition_penalty",
        "return_full_text",
        "seed",
        "stop",
        "temperature",
        "top_k",
        "top_n_tokens",
        "top_p",
        "truncate",
        "typical_p",
        "watermark",
    }
)


class TGIError(Exception):
    """A refusal in TGI's shape: ``{"error": message, "error_type": kind}`` with TGI's
    statuses (422 validation, 424 generation, 429 overloaded, 503 unavailable)."""

    def __init__(self, status: int, message: str, error_type: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_type = error_type

    def body(self) -> dict[str, str]:
        return {"error": self.message, "error_type": self.error_type}


def validation_error(message: str) -> TGIError:
    """422, as TGI words its input validation errors."""
    return TGIError(422, f"Input validation error: {message}", "validation")


@dataclass(frozen=True)
class TGIRequest:
    """A generation request in plain terms, and what its answer holds."""

    call: GenerationCall
    stream: bool = False
    details: bool = False  # details in the answer (the stream's last event)
    decoder_input_details: bool = False  # the prompt's tokens in details.prefill
    return_full_text: bool = False  # the prompt before generated_text
    top_n_tokens: int = 0


@dataclass(frozen=True)
class TokenizeRequest:
    inputs: str
    add_special_tokens: bool = True
    truncate: int = 0


def parse_generate(
    body: object, *, stream: bool | None, max_new_tokens: int, max_input_tokens: int
) -> TGIRequest:
    """A generation body; ``stream``: the route's choice (None: the body's ``stream``, as
    ``POST /`` takes it). ``max_new_tokens`` is the server's limit and ``max_input_tokens``
    the longest input (``truncate`` must be below it)."""
    fields = _fields(body, _TOP_FIELDS)
    parameters = fields.get("parameters")
    if parameters is None:
        parameters = {}
    params = _fields(parameters, _PARAMETERS, "parameters")
    streaming = _flag(fields, "stream") if stream is None else stream
    details = _flag(params, "details")
    prefill = _flag(params, "decoder_input_details")
    if streaming and prefill:
        raise validation_error(
            "`decoder_input_details` == true is not supported when streaming tokens"
        )
    _refuse_unsupported(params, streaming)
    top_n = _int(params, "top_n_tokens", 0, None) or 0  # its limit: admission's
    tokens = streaming or details  # every streamed event carries its token
    response = ResponseOptions(
        generated_tokens=tokens,
        token_logprobs=tokens,
        top_n_tokens=top_n if tokens else 0,
        input_tokens=details and prefill,
    )
    generation = GenerationParams(
        sampling=_sampling(params),
        stopping=_stopping(params, max_new_tokens),
        response=response,
        truncate_input_tokens=_truncate(params, max_input_tokens),
        guided=_guided(params.get("grammar")),
    )
    call = GenerationCall(
        (_inputs(fields),),
        generation,
        adapter_id=_adapter_id(params),
        add_special_tokens=_flag(fields, "add_special_tokens", True),
    )
    return TGIRequest(
        call,
        stream=streaming,
        details=details,
        decoder_input_details=details and prefill,
        return_full_text=_flag(params, "return_full_text"),
        top_n_tokens=top_n,
    )


def parse_tokenize(body: object, *, max_input_tokens: int) -> TokenizeRequest:
    """A ``/tokenize`` body (a generation body, of which ``inputs``,
    ``add_special_tokens`` and ``parameters.truncate`` count)."""
    fields = _fields(body, _TOP_FIELDS)
    parameters = fields.get("parameters")
    params = _fields({} if parameters is None else parameters, _PARAMETERS, "parameters")
    return TokenizeRequest(
        _inputs(fields),
        _flag(fields, "add_special_tokens", True),
        _truncate(params, max_input_tokens),
    )


# ---- the parameters ----------------------------------------------------------------------------


def _refuse_unsupported(params: Mapping[str, Any], streaming: bool) -> None:
    best_of = _int(params, "best_of", 1, None)
    if best_of is not None and best_of > 1:
        if streaming:
            raise validation_error("`best_of` != 1 is not supported when streaming tokens")
        raise validation_error(
            "`best_of` > 1 is not supported: this server generates one sequence per request"
        )
    if _flag(params, "watermark"):
        raise validation_error("`watermark` is not supported")
    penalty = _number(params, "frequency_penalty")
    if penalty is not None and not -2.0 <= penalty <= 2.0:
        raise validation_error("`frequency_penalty` must be >= -2.0 and <= 2.0")
    if penalty:
        raise validation_error(
            "`frequency_penalty` is not supported: the engine has no frequency penalty "
            "normalized as TGI's (use `repetition_penalty`)"
        )


def _sampling(params: Mapping[str, Any]) -> SamplingParams:
    """Sampling when ``do_sample`` or any warper is set, as TGI decides; else greedy."""
    temperature = _number(params, "temperature")
    if temperature is not None and temperature <= 0:
        raise validation_error("`temperature` must be strictly positive")
    top_k = _int(params, "top_k", None, _MAX_TOP_K)
    if top_k is not None and top_k <= 0:
        raise validation_error("`top_k` must be strictly positive")
    top_p = _unit_interval(params, "top_p")
    typical_p = _unit_interval(params, "typical_p")
    penalty = _number(params, "repetition_penalty")
    if penalty is not None and penalty <= 0:
        raise validation_error("`repetition_penalty` must be strictly positive")
    seed = _int(params, "seed", 0, _MAX_SEED)
    warped = (
        (temperature is not None and temperature != 1.0)
        or top_k is not None
        or top_p is not None
        or typical_p is not None
    )
    repetition = 1.0 if penalty is None else penalty
    if not (_flag(params, "do_sample") or warped):
        return SamplingParams(repetition_penalty=repetition)
    return SamplingParams(
        temperature=1.0 if temperature is None else temperature,
        top_k=top_k or 0,
        top_p=1.0 if top_p is None else top_p,
        typical_p=1.0 if typical_p is None else typical_p,
        seed=seed,
        repetition_penalty=repetition,
    )


def _stopping(params: Mapping[str, Any], limit: int) -> StoppingParams:
    """TGI keeps a stop sequence in the text; ``null`` max_new_tokens is the server's limit."""
    if "max_new_tokens" in params and params["max_new_tokens"] is None:
        max_new_tokens = limit
    else:
        given = _int(params, "max_new_tokens", None, None)
        if given is not None and given <= 0:
            raise validation_error("`max_new_tokens` must be strictly positive")
        max_new_tokens = min(DEFAULT_MAX_NEW_TOKENS, limit) if given is None else given
    stop = params.get("stop")
    if stop is None:
        stop = []
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise validation_error("`stop` must be a list of strings")
    return StoppingParams(
        max_new_tokens=max_new_tokens, stop_sequences=tuple(stop), include_stop_sequence=True
    )


def _truncate(params: Mapping[str, Any], max_input_tokens: int) -> int:
    truncate = _int(params, "truncate", None, None)
    if truncate is None:
        return 0
    if not 0 < truncate <= max_input_tokens:
        raise validation_error(
            f"`truncate` must be strictly positive and at most {max_input_tokens}. "
            f"Given: {truncate}"
        )
    return truncate


def _guided(grammar: object) -> GuidedRequest | None:
    """TGI's ``{"type": "json", "value": schema}`` or ``{"type": "regex", "value": text}``."""
    if grammar is None:
        return None
    kind = grammar.get("type") if isinstance(grammar, dict) else None
    value = grammar.get("value") if isinstance(grammar, dict) else None
    if kind == "regex":
        if not isinstance(value, str) or not value:
            raise validation_error("a `regex` grammar's `value` must be a non-empty string")
        return GuidedRequest(GuidedKind.REGEX, text=value)
    if kind != "json":
        raise validation_error("`grammar.type` must be `json` or `regex`")
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (json.JSONDecodeError, RecursionError):
            raise validation_error("a `json` grammar's `value` must be a JSON schema") from None
    if not isinstance(value, dict) and not isinstance(value, bool):
        raise validation_error("a `json` grammar's `value` must be a JSON schema")
    try:
        text = json.dumps(value)
    except RecursionError:
        raise validation_error("the grammar's schema is nested too deeply") from None
    return GuidedRequest(GuidedKind.JSON_SCHEMA, text=text)


def _inputs(fields: Mapping[str, Any]) -> str:
    inputs = fields.get("inputs")
    if not isinstance(inputs, str):
        raise validation_error("`inputs` must be a string")
    if not inputs:
        raise validation_error("`inputs` cannot be empty")
    return inputs


def _adapter_id(params: Mapping[str, Any]) -> str:
    adapter = params.get("adapter_id")
    if adapter is not None and not isinstance(adapter, str):
        raise validation_error("`adapter_id` must be a string")
    return adapter or ""


# ---- field access ----------------------------------------------------------------------------


def _fields(body: object, known: frozenset[str], where: str = "") -> Mapping[str, Any]:
    if not isinstance(body, dict):
        raise validation_error(f"`{where}` must be an object" if where else "a JSON object")
    for name in body:
        if name not in known:
            field = f"{where}.{name}" if where else name
            raise validation_error(f"unknown field `{field}`")
    return body


def _flag(fields: Mapping[str, Any], name: str, default: bool = False) -> bool:
    value = fields.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise validation_error(f"`{name}` must be a boolean")
    return value


def _int(fields: Mapping[str, Any], name: str, low: int | None, high: int | None) -> int | None:
    value = fields.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise validation_error(f"`{name}` must be an integer")
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f">= {low}" if high is None else f"<= {high}" if low is None else ""
        bounds = bounds or f">= {low} and <= {high}"
        raise validation_error(f"`{name}` must be {bounds}. Given: {value}")
    return value


def _number(fields: Mapping[str, Any], name: str) -> float | None:
    value = fields.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise validation_error(f"`{name}` must be a number")
    return float(value)


def _unit_interval(fields: Mapping[str, Any], name: str) -> float | None:
    """``top_p`` and ``typical_p``: strictly between 0 and 1, as TGI requires."""
    value = _number(fields, name)
    if value is not None and not 0.0 < value < 1.0:
        raise validation_error(f"`{name}` must be > 0.0 and < 1.0")
    return value
