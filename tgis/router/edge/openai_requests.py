"""OpenAI request bodies in, :class:`GenerationCall` s out (``/v1/completions``,
``/v1/chat/completions``), and OpenAI's error shape.

Every field a body may hold is known here: a field that would change the output and that
tgis cannot honour is refused with 400 naming it (``n`` other than 1, non-zero presence and
frequency penalties, ``logit_bias``, tools, ``suffix``...), never ignored; a field OpenAI
does not define is refused as OpenAI refuses it ("Unrecognized request argument supplied").
Fields that change nothing in the output (``user``, ``metadata``...) are accepted.

The parameters map onto the gRPC API's (TGIS's validation then applies, with its
messages): ``temperature`` 0 is greedy, otherwise sampling with ``top_p`` and vLLM's
``top_k``; ``seed``; ``stop`` (a string or a list; the stop text is left out of the
output, as OpenAI does); ``max_tokens`` (completions: 16 when absent, as OpenAI; chat, also
``max_completion_tokens``: the server's limit, lowered to fit the context); vLLM's
``min_tokens`` and ``repetition_penalty``; ``logprobs`` / ``top_logprobs`` as generated
token details; ``response_format`` as guided decoding.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
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

__all__ = ["OpenAIError", "OpenAIRequest", "parse_chat", "parse_completion"]

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's limit for /v1/completions' logprobs
MAX_TOP_LOGPROBS = 20  # OpenAI's limit for chat's top_logprobs
MAX_TOP_K = (1 << 31) - 1  # the gRPC API's largest top_k (its uint32 is read as an int32)


class OpenAIError(Exception):
    """A refusal in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``
    with an HTTP status the ``openai`` client maps to its exception classes."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param)


@dataclass(frozen=True)
class OpenAIRequest:
    """A completion or chat request in plain terms."""

    model: str | None  # None: not named, the served model
    call: GenerationCall
    stream: bool = False
    include_usage: bool = False
    # Token logprobs: None for none, else how many alternatives per position (0 or more).
    logprobs: int | None = None
    echo: bool = False  # completions: the prompt before the output
    chat: bool = False  # /v1/chat/completions (its prompt rendered by the chat template)


# Fields accepted and not used: they change nothing in the output.
_INERT = frozenset({"user", "metadata", "store", "service_tier", "stream_options"})
_COMMON = frozenset(
    {
        "model",
        "max_tokens",
        "temperature",
        "top_p",
        "n",
        "stream",
        "stop",
        "seed",
        "presence_penalty",
        "frequency_penalty",
        "logit_bias",
        "logprobs",
        "response_format",
        # vLLM's extras
        "top_k",
        "min_tokens",
        "repetition_penalty",
    }
)
_COMPLETION_FIELDS = _COMMON | _INERT | {"prompt", "echo", "suffix", "best_of"}
_CHAT_FIELDS = (
    _COMMON
    | _INERT
    | {
        "messages",
        "max_completion_tokens",
        "top_logprobs",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "functions",
        "function_call",
        "modalities",
        "audio",
        "prediction",
        "reasoning_effort",
        "web_search_options",
    }
)


def parse_completion(body: object, *, max_new_tokens: int) -> OpenAIRequest:
    """A ``/v1/completions`` body: ``prompt`` a string or a list of strings (one choice
    each, as a gRPC batch)."""
    fields = _fields(body, _COMPLETION_FIELDS)
    _refuse_unless(fields, "suffix", lambda v: v in (None, ""), "suffix is not supported")
    _refuse_unless(fields, "best_of", lambda v: v in (None, 1), "best_of must be 1")
    prompt = fields.get("prompt")
    if isinstance(prompt, str):
        prompts: tuple[str, ...] = (prompt,)
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        prompts = tuple(prompt)
    elif prompt is None:
        raise bad_request("you must provide a prompt", "prompt")
    else:
        raise bad_request("prompt must be a string or a list of strings", "prompt")
    logprobs = _optional_int(fields, "logprobs", 0, MAX_COMPLETION_LOGPROBS)
    echo = _optional_bool(fields, "echo") or False
    if echo and logprobs is not None:
        raise bad_request("echo with logprobs is not supported", "echo")
    max_tokens = _optional_int(fields, "max_tokens", 1, None)
    if max_tokens is None:
        max_tokens = min(COMPLETION_DEFAULT_MAX_TOKENS, max_new_tokens)
    return _request(fields, prompts, max_tokens, logprobs, echo=echo)


def parse_chat(
    body: object,
    render: Callable[[list[Mapping[str, Any]]], str],
    *,
    max_new_tokens: int,
) -> OpenAIRequest:
    """A ``/v1/chat/completions`` body; ``render`` turns its messages into the prompt (the
    chat template), raising OpenAIError."""
    fields = _fields(body, _CHAT_FIELDS)
    for name in ("tools", "functions", "audio", "prediction", "web_search_options"):
        _refuse_unless(fields, name, lambda v: not v, f"{name} is not supported")
    _refuse_unless(fields, "tool_choice", lambda v: v in (None, "none"), "tools are not supported")
    _refuse_unless(
        fields, "function_call", lambda v: v in (None, "none"), "functions are not supported"
    )
    _refuse_unless(
        fields, "modalities", lambda v: v in (None, ["text"]), "only text output is supported"
    )
    _refuse_unless(
        fields, "reasoning_effort", lambda v: v is None, "reasoning_effort is not supported"
    )
    messages = fields.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list", "messages")
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise bad_request("each message must be an object with a role", "messages")
    logprobs = None
    if _optional_bool(fields, "logprobs"):
        logprobs = _optional_int(fields, "top_logprobs", 0, MAX_TOP_LOGPROBS) or 0
    elif fields.get("top_logprobs") is not None:
        raise bad_request("top_logprobs needs logprobs to be true", "top_logprobs")
    max_tokens = _optional_int(fields, "max_completion_tokens", 1, None)
    if max_tokens is None:
        max_tokens = _optional_int(fields, "max_tokens", 1, None)
    prompt = render([_text_message(m) for m in messages])
    call_max = max_tokens if max_tokens is not None else max_new_tokens
    return _request(fields, (prompt,), call_max, logprobs, chat=True)


def _text_message(message: Mapping[str, Any]) -> Mapping[str, Any]:
    """A message with its content as text: a list of text parts is joined (as vLLM
    does); other parts (images, audio) are refused. Content may be null (or absent) only in
    an assistant message, as OpenAI allows; it is then rendered as empty text."""
    content = message.get("content")
    if isinstance(content, str):
        return message
    if content is None:
        if message.get("role") != "assistant":
            raise bad_request(
                "message content must be a string or a list of text parts "
                "(null only in an assistant message)",
                "messages",
            )
        return {**message, "content": ""}
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise bad_request("only text content parts are supported", "messages")
            text = part.get("text")
            if not isinstance(text, str):
                raise bad_request("a text content part's text must be a string", "messages")
            texts.append(text)
        return {**message, "content": "\n".join(texts)}
    raise bad_request("message content must be a string or a list of text parts", "messages")


def _request(
    fields: Mapping[str, Any],
    prompts: tuple[str, ...],
    max_tokens: int,
    logprobs: int | None,
    *,
    echo: bool = False,
    chat: bool = False,
) -> OpenAIRequest:
    """The request; a chat's prompt carries its special tokens (the template wrote its BOS),
    so none are added again."""
    model = fields.get("model")  # absent: the served model, as vLLM takes it
    if model is not None and (not isinstance(model, str) or not model):
        raise bad_request("model must be the served model's name", "model")
    _refuse_unless(fields, "n", lambda v: v in (None, 1), "n must be 1: one choice per prompt")
    for name in ("presence_penalty", "frequency_penalty"):
        _refuse_unless(
            fields,
            name,
            lambda v: v in (None, 0),
            f"{name} is not supported (use repetition_penalty)",
        )
    _refuse_unless(fields, "logit_bias", lambda v: not v, "logit_bias is not supported")
    stream = _optional_bool(fields, "stream") or False
    options = fields.get("stream_options")
    if options is not None and (not stream or not isinstance(options, dict)):
        raise bad_request("stream_options is only allowed with stream: true", "stream_options")
    include_usage = bool(options and options.get("include_usage"))
    min_tokens = _optional_int(fields, "min_tokens", 0, None) or 0
    params = GenerationParams(
        sampling=_sampling(fields, min_tokens),
        stopping=StoppingParams(
            max_new_tokens=max_tokens,
            min_new_tokens=min_tokens,
            stop_sequences=_stops(fields.get("stop")),
        ),
        response=ResponseOptions(
            generated_tokens=logprobs is not None,
            token_logprobs=logprobs is not None,
            top_n_tokens=logprobs or 0,
        ),
        guided=_guided(fields.get("response_format")),
    )
    call = GenerationCall(prompts, params, add_special_tokens=not chat)
    return OpenAIRequest(model, call, stream, include_usage, logprobs, echo, chat)


def _sampling(fields: Mapping[str, Any], min_tokens: int) -> SamplingParams:
    """The sampling parameters; ``min_tokens`` also masks EOS (as gRPC's min_new_tokens).
    ``top_k`` is bounded as the gRPC API's (a larger one failed the step it was sent in,
    and the router with it)."""
    temperature = _optional_number(fields, "temperature", 0.0, 2.0)
    seed = _optional_int(fields, "seed", -(1 << 63), (1 << 64) - 1)
    penalty = _optional_number(fields, "repetition_penalty", 0.0, None)
    greedy = temperature == 0.0
    return SamplingParams(
        temperature=0.0 if greedy else (1.0 if temperature is None else temperature),
        top_p=1.0 if greedy else (_optional_number(fields, "top_p", 0.0, 1.0) or 1.0),
        top_k=0 if greedy else max(_optional_int(fields, "top_k", -1, MAX_TOP_K) or 0, 0),
        seed=None if greedy or seed is None else seed % (1 << 64),
        repetition_penalty=1.0 if penalty is None else penalty,
        min_new_tokens=min_tokens,
    )


def _stops(value: object) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return tuple(value)
    raise bad_request("stop must be a string or a list of strings", "stop")


def _guided(value: object) -> GuidedRequest | None:
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return GuidedRequest(GuidedKind.JSON_OBJECT)
    if kind == "json_schema":
        spec = value.get("json_schema") if isinstance(value, dict) else None
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise bad_request(
                "response_format.json_schema.schema must be an object", "response_format"
            )
        try:
            text = json.dumps(schema)
        except RecursionError:
            raise bad_request(
                "response_format.json_schema.schema is nested too deeply", "response_format"
            ) from None
        return GuidedRequest(GuidedKind.JSON_SCHEMA, text=text)
    raise bad_request(
        "response_format.type must be text, json_object or json_schema", "response_format"
    )


# ---- field access ----------------------------------------------------------------------------


def _fields(body: object, known: frozenset[str]) -> Mapping[str, Any]:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    for name in body:
        if name not in known:
            raise bad_request(f"Unrecognized request argument supplied: {name}", name)
    return body


def _refuse_unless(
    fields: Mapping[str, Any], name: str, accepted: Callable[[Any], bool], message: str
) -> None:
    if not accepted(fields.get(name)):
        raise bad_request(message, name)


def _optional_bool(fields: Mapping[str, Any], name: str) -> bool | None:
    value = fields.get(name)
    if value is None or isinstance(value, bool):
        return value
    raise bad_request(f"{name} must be a boolean", name)


def _optional_int(fields: Mapping[str, Any], name: str, low: int, high: int | None) -> int | None:
    value = fields.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"{name} must be an integer", name)
    if value < low or (high is not None and value > high):
        bounds = f"between {low} and {high}" if high is not None else f"at least {low}"
        raise bad_request(f"{name} must be {bounds}", name)
    return value


def _optional_number(
    fields: Mapping[str, Any], name: str, low: float, high: float | None
) -> float | None:
    value = fields.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise bad_request(f"{name} must be a number", name)
    if value < low or (high is not None and value > high):
        bounds = f"between {low:g} and {high:g}" if high is not None else f"at least {low:g}"
        raise bad_request(f"{name} must be {bounds}", name)
    return float(value)
