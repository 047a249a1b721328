"""OpenAI request bodies in, :class:`GenerationCall` s out (``/v1/completions``,
``/v1/chat/completions``); OpenAI's error shape and field readers are ``openai_fields.py``,
its penalties and bias and vLLM's extra fields ``openai_extras.py``.

Every field a body may hold is known here: a field that would change the output and that
tgis cannot honour is refused with 400 naming it (``n`` other than 1, tools, ``suffix``...),
never ignored; a field neither OpenAI nor vLLM defines is refused as OpenAI refuses it
("Unrecognized request argument supplied"). Fields that change nothing in the output
(``user``, ``metadata``...) are accepted.

The parameters map onto the gRPC API's (TGIS's validation then applies, with its
messages): ``temperature`` 0 is greedy, otherwise sampling with ``top_p`` and vLLM's
``top_k``; ``seed``; ``stop`` (a string or a list; the stop text is left out of the
output, as OpenAI does); ``max_tokens`` (completions: 16 when absent, as OpenAI; chat, also
``max_completion_tokens``: the server's limit, lowered to fit the context); vLLM's
``min_tokens`` and ``repetition_penalty``; ``logprobs`` / ``top_logprobs`` as generated
token details; ``response_format`` as guided decoding; ``model`` absent or "" is the
served model.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from tgis.router.edge.openai_extras import (
    EXTRA_FIELDS,
    Extras,
    guided_extra,
    read_extras,
    schema_text,
)
from tgis.router.edge.openai_fields import (
    OpenAIError,
    bad_request,
    fields_of,
    optional_bool,
    optional_int,
    optional_number,
    refuse_unless,
)
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
        # vLLM's extras (and openai_extras.EXTRA_FIELDS)
        "top_k",
        "min_tokens",
        "repetition_penalty",
    }
    | EXTRA_FIELDS
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
    fields = fields_of(body, _COMPLETION_FIELDS)
    refuse_unless(fields, "suffix", lambda v: v in (None, ""), "suffix is not supported")
    refuse_unless(fields, "best_of", lambda v: v in (None, 1), "best_of must be 1")
    prompt = fields.get("prompt")
    if isinstance(prompt, str):
        prompts: tuple[str, ...] = (prompt,)
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        prompts = tuple(prompt)
    elif prompt is None:
        raise bad_request("you must provide a prompt", "prompt")
    else:
        raise bad_request("prompt must be a string or a list of strings", "prompt")
    logprobs = optional_int(fields, "logprobs", 0, MAX_COMPLETION_LOGPROBS)
    echo = optional_bool(fields, "echo") or False
    if echo and logprobs is not None:
        raise bad_request("echo with logprobs is not supported", "echo")
    max_tokens = optional_int(fields, "max_tokens", 1, None)
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
    fields = fields_of(body, _CHAT_FIELDS)
    for name in ("tools", "functions", "audio", "prediction", "web_search_options"):
        refuse_unless(fields, name, lambda v: not v, f"{name} is not supported")
    refuse_unless(fields, "tool_choice", lambda v: v in (None, "none"), "tools are not supported")
    refuse_unless(
        fields, "function_call", lambda v: v in (None, "none"), "functions are not supported"
    )
    refuse_unless(
        fields, "modalities", lambda v: v in (None, ["text"]), "only text output is supported"
    )
    refuse_unless(
        fields, "reasoning_effort", lambda v: v is None, "reasoning_effort is not supported"
    )
    messages = fields.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list", "messages")
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise bad_request("each message must be an object with a role", "messages")
    logprobs = None
    if optional_bool(fields, "logprobs"):
        logprobs = optional_int(fields, "top_logprobs", 0, MAX_TOP_LOGPROBS) or 0
    elif fields.get("top_logprobs") is not None:
        raise bad_request("top_logprobs needs logprobs to be true", "top_logprobs")
    max_tokens = optional_int(fields, "max_completion_tokens", 1, None)
    if max_tokens is None:
        max_tokens = optional_int(fields, "max_tokens", 1, None)
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
    model = fields.get("model")  # absent or "": the served model, as vLLM and TGI take it
    if model is not None and not isinstance(model, str):
        raise bad_request("model must be the served model's name", "model")
    refuse_unless(fields, "n", lambda v: v in (None, 1), "n must be 1: one choice per prompt")
    extras = read_extras(fields)
    stream = optional_bool(fields, "stream") or False
    options = fields.get("stream_options")
    if options is not None and (not stream or not isinstance(options, dict)):
        raise bad_request("stream_options is only allowed with stream: true", "stream_options")
    include_usage = bool(options and options.get("include_usage"))
    min_tokens = optional_int(fields, "min_tokens", 0, None) or 0
    # ignore_eos: the shard masks EOS all the way to max_tokens (as lowered to fit), while
    # the request's own min_new_tokens, checked against the context, stays min_tokens
    masked_until = max_tokens if extras.ignore_eos else min_tokens
    params = GenerationParams(
        sampling=_sampling(fields, masked_until, extras),
        stopping=StoppingParams(
            max_new_tokens=max_tokens,
            min_new_tokens=min_tokens,
            stop_sequences=_stops(fields.get("stop")),
            include_stop_sequence=extras.include_stop_str_in_output,
            stop_token_ids=extras.stop_token_ids,
        ),
        response=ResponseOptions(
            generated_tokens=logprobs is not None,
            token_logprobs=logprobs is not None,
            top_n_tokens=logprobs or 0,
            skip_special_tokens=extras.skip_special_tokens,
        ),
        guided=_guided(fields),
    )
    call = GenerationCall(prompts, params, add_special_tokens=not chat)
    return OpenAIRequest(model or None, call, stream, include_usage, logprobs, echo, chat)


def _sampling(fields: Mapping[str, Any], eos_masked_until: int, extras: Extras) -> SamplingParams:
    """The sampling parameters; EOS is masked until ``eos_masked_until`` tokens (gRPC's
    min_new_tokens, or max_tokens with ignore_eos). ``top_k`` is bounded as the gRPC API's
    (a larger one failed the step it was sent in, and the router with it); ``top_p`` 0 is
    refused (OpenAI takes it as near-greedy, vLLM refuses it: temperature 0 is greedy)."""
    temperature = optional_number(fields, "temperature", 0.0, 2.0)
    seed = optional_int(fields, "seed", -(1 << 63), (1 << 64) - 1)
    penalty = optional_number(fields, "repetition_penalty", 0.0, None)
    top_p = optional_number(fields, "top_p", 0.0, 1.0)
    if top_p == 0.0:
        raise bad_request(
            "top_p must be greater than 0 (for greedy decoding, set temperature to 0)", "top_p"
        )
    greedy = temperature == 0.0
    return SamplingParams(
        temperature=0.0 if greedy else (1.0 if temperature is None else temperature),
        top_p=1.0 if greedy or top_p is None else top_p,
        top_k=0 if greedy else max(optional_int(fields, "top_k", -1, MAX_TOP_K) or 0, 0),
        seed=None if greedy or seed is None else seed % (1 << 64),
        repetition_penalty=1.0 if penalty is None else penalty,
        min_new_tokens=eos_masked_until,
        presence_penalty=extras.presence_penalty,
        frequency_penalty=extras.frequency_penalty,
        logit_bias=extras.logit_bias,
        min_p=extras.min_p,
    )


def _stops(value: object) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return tuple(value)
    raise bad_request("stop must be a string or a list of strings", "stop")


def _guided(fields: Mapping[str, Any]) -> GuidedRequest | None:
    """The request's constraint: ``response_format`` or one of vLLM's guided fields."""
    formatted = _response_format(fields.get("response_format"))
    extra = guided_extra(fields)
    if extra is None:
        return formatted
    if formatted is not None:
        raise bad_request(f"response_format and {extra[0]} cannot be combined", extra[0])
    return extra[1]


def _response_format(value: object) -> GuidedRequest | None:
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
        text = schema_text(schema, "response_format")
        return GuidedRequest(GuidedKind.JSON_SCHEMA, text=text)
    raise bad_request(
        "response_format.type must be text, json_object or json_schema", "response_format"
    )
