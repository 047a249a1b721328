"""OpenAI request bodies in, :class:`GenerationCall` s out (``/v1/completions``,
``/v1/chat/completions``); OpenAI's error shape and field readers are ``openai_fields.py``,
its penalties and bias and vLLM's extra fields ``openai_extras.py``.

Every field a body may hold is known here: a field that would change the output and that
tgis cannot honour is refused with 400 naming it (``suffix``, ``best_of``, functions...),
never ignored; a field neither OpenAI nor vLLM defines is refused as OpenAI refuses it
("Unrecognized request argument supplied"). Fields that change nothing in the output
(``user``, ``metadata``...) are accepted.

The parameters map onto the gRPC API's (TGIS's validation then applies, with its
messages): ``temperature`` 0 is greedy, otherwise sampling with ``top_p`` and vLLM's
``top_k``; ``seed``; ``stop`` (a string or a list; the stop text is left out of the
output, as OpenAI does); ``max_tokens`` (completions: 16 when absent, as OpenAI; chat, also
``max_completion_tokens``: the server's limit, lowered to fit the context); vLLM's
``min_tokens`` and ``repetition_penalty``; ``logprobs`` / ``top_logprobs`` as generated
token details; ``response_format`` as guided decoding (TGI's forms too); ``model``
absent, "" or ``huggingface_hub``'s ``"dummy"`` is the served model. ``n`` (1 to 128)
repeats each prompt n times in the call (choice ``p * n + j`` is prompt p's j-th), each a
sequence of its own: sampled ones get different seeds (:func:`choice_seeds`), greedy ones
are alike. Completions' ``echo`` with ``logprobs`` asks for the prompt's token details too
(lm-eval's loglikelihood requests), and ``max_tokens: 0`` is allowed with ``echo`` only:
one token is generated (the engine always generates one) and dropped from the reply.
Chat's ``tools``, ``tool_choice`` and ``parallel_tool_calls`` are ``openai_tools.py``'s.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from tgis.router.edge.openai_extras import (
    EXTRA_FIELDS,
    Extras,
    body_constraint,
    read_extras,
)
from tgis.router.edge.openai_fields import (
    OpenAIError,
    bad_request,
    fields_of,
    optional_bool,
    optional_int,
    optional_number,
    read_prompt,
    refuse_unless,
)
from tgis.router.edge.openai_tools import (
    ToolChoice,
    forced_constraint,
    read_tools,
    template_message,
)
from tgis.router.intake.admission import GenerationCall
from tgis.router.request_types import (
    GenerationParams,
    GuidedRequest,
    ResponseOptions,
    SamplingParams,
    StoppingParams,
    ValidatedRequest,
)

__all__ = ["OpenAIError", "OpenAIRequest", "choice_seeds", "parse_chat", "parse_completion"]

Render = Callable[[list[Mapping[str, Any]], list[dict[str, Any]] | None], str]
"""The chat template: (messages, tools or None) to the prompt, raising OpenAIError."""

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's limit for /v1/completions' logprobs
MAX_TOP_LOGPROBS = 20  # OpenAI's limit for chat's top_logprobs
MAX_TOP_K = (1 << 31) - 1  # the gRPC API's largest top_k (its uint32 is read as an int32)
MAX_N = 128  # OpenAI's limit
SEED_SPACE = 1 << 64


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
    n: int = 1  # choices per prompt: the call's texts are each prompt n times
    drop_output: bool = False  # max_tokens 0 (with echo): the token generated is left out
    tools: ToolChoice | None = None  # chat: the tools and the tool choice
    tool_call_parser: str = "hermes"  # chat, tool_choice auto: the model's call format


@dataclass(frozen=True)
class _Asked:
    """What a body asks of the output beyond its text."""

    logprobs: int | None = None
    prompt_logprobs: bool = False  # echo with logprobs: the prompt's token details too
    guided: GuidedRequest | None = None
    skip_special_tokens: bool | None = None  # the default when the body does not say
    chat: bool = False


# What huggingface_hub's InferenceClient sends as ``model`` to a server named by its URL
# (TGI serves one model and reads no name): the served model here too.
HUB_PLACEHOLDER_MODEL = "dummy"

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
    """A ``/v1/completions`` body: ``prompt`` a string, a list of strings, a list of token
    ids or a list of such lists (``n`` choices each, as a gRPC batch)."""
    fields = fields_of(body, _COMPLETION_FIELDS)
    refuse_unless(fields, "suffix", lambda v: v in (None, ""), "suffix is not supported")
    refuse_unless(fields, "best_of", lambda v: v in (None, 1), "best_of must be 1")
    prompts, token_ids = read_prompt(fields.get("prompt"))
    logprobs = optional_int(fields, "logprobs", 0, MAX_COMPLETION_LOGPROBS)
    echo = optional_bool(fields, "echo") or False
    max_tokens = optional_int(fields, "max_tokens", 0, None)
    if max_tokens == 0 and not echo:
        raise bad_request(
            "max_tokens must be at least 1 (0 only with echo: the prompt alone)", "max_tokens"
        )
    if max_tokens == 0 and fields.get("min_tokens"):
        raise bad_request("min_tokens must be at most max_tokens", "min_tokens")
    if max_tokens is None:
        max_tokens = min(COMPLETION_DEFAULT_MAX_TOKENS, max_new_tokens)
    asked = _Asked(logprobs, echo and logprobs is not None, body_constraint(fields))
    request = _request(fields, prompts, max(max_tokens, 1), asked)
    if token_ids is not None:  # used as they are: no special tokens added
        repeated = tuple(ids for ids in token_ids for _ in range(request.n))
        call = replace(request.call, token_ids=repeated, add_special_tokens=False)
        request = replace(request, call=call)
    return replace(request, echo=echo, drop_output=max_tokens == 0)


def parse_chat(
    body: object,
    render: Render,
    *,
    max_new_tokens: int,
    tool_call_parser: str = "hermes",
) -> OpenAIRequest:
    """A ``/v1/chat/completions`` body; ``render`` turns its messages (and tools) into the
    prompt (the chat template)."""
    fields = fields_of(body, _CHAT_FIELDS)
    for name in ("audio", "prediction", "web_search_options"):
        refuse_unless(fields, name, lambda v: not v, f"{name} is not supported")
    refuse_unless(fields, "functions", lambda v: not v, "functions is not supported: use tools")
    refuse_unless(
        fields,
        "function_call",
        lambda v: v in (None, "none"),
        "function_call is not supported: use tool_choice",
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
    tools = read_tools(fields)
    logprobs = None
    if optional_bool(fields, "logprobs"):
        logprobs = optional_int(fields, "top_logprobs", 0, MAX_TOP_LOGPROBS) or 0
    elif fields.get("top_logprobs") is not None:
        raise bad_request("top_logprobs needs logprobs to be true", "top_logprobs")
    max_tokens = optional_int(fields, "max_completion_tokens", 1, None)
    if max_tokens is None:
        max_tokens = optional_int(fields, "max_tokens", 1, None)
    asked = _Asked(
        logprobs,
        guided=_chat_guided(fields, tools),
        # Hermes's tags may be special tokens (vLLM keeps them for its parser too)
        skip_special_tokens=_hermes_keeps_tags(tools, tool_call_parser),
        chat=True,
    )
    prompt = render(
        [template_message(_text_message(m)) for m in messages],
        None if tools is None else list(tools.tools),
    )
    call_max = max_tokens if max_tokens is not None else max_new_tokens
    request = _request(fields, (prompt,), call_max, asked)
    return replace(request, chat=True, tools=tools, tool_call_parser=tool_call_parser)


def _chat_guided(fields: Mapping[str, Any], tools: ToolChoice | None) -> GuidedRequest | None:
    """The chat's constraint: the body's, or the one that forces its tool calls."""
    guided = body_constraint(fields)
    if tools is None or not tools.forced:
        return guided
    if guided is not None:
        raise bad_request(
            f"tool_choice {tools.mode} cannot be combined with another output constraint",
            "tool_choice",
        )
    return forced_constraint(tools)


def _hermes_keeps_tags(tools: ToolChoice | None, parser: str) -> bool | None:
    return False if tools is not None and tools.mode == "auto" and parser == "hermes" else None


def choice_seeds(
    request: OpenAIRequest, validated: Sequence[ValidatedRequest]
) -> list[ValidatedRequest]:
    """The inputs of a call with ``n`` > 1 and a seed, choice j of each prompt seeded with
    ``seed + j`` (mod 2^64; vLLM's rule), so that its choices differ and the same body
    gives the same choices. Without a seed each sampled input has a random seed of its own
    already (``SamplingParams.seeded``); greedy ones have none."""
    seed = request.call.params.sampling.seed
    if request.n == 1 or seed is None:
        return list(validated)
    return [
        replace(v, sampling=replace(v.sampling, seed=(seed + i % request.n) % SEED_SPACE))
        for i, v in enumerate(validated)
    ]


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
    fields: Mapping[str, Any], prompts: tuple[str, ...], max_tokens: int, asked: _Asked
) -> OpenAIRequest:
    """The request, each prompt ``n`` times; a chat's prompt carries its special tokens
    (the template wrote its BOS), so none are added again."""
    model = fields.get("model")  # absent or "": the served model, as vLLM and TGI take it
    if model is not None and not isinstance(model, str):
        raise bad_request("model must be the served model's name", "model")
    if model == HUB_PLACEHOLDER_MODEL:
        model = None
    n = optional_int(fields, "n", 1, MAX_N) or 1
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
    logprobs = asked.logprobs
    skip = extras.skip_special_tokens
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
            input_tokens=asked.prompt_logprobs,
            token_logprobs=logprobs is not None,
            top_n_tokens=logprobs or 0,
            skip_special_tokens=asked.skip_special_tokens if skip is None else skip,
        ),
        guided=asked.guided,
    )
    texts = tuple(prompt for prompt in prompts for _ in range(n))
    call = GenerationCall(texts, params, add_special_tokens=not asked.chat)
    return OpenAIRequest(model or None, call, stream, include_usage, logprobs, n=n)


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
