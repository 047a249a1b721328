"""The OpenAI-compatible routes on the HTTP port: ``GET /v1/models``,
``POST /v1/completions`` and ``POST /v1/chat/completions`` (server-sent events when
``stream`` is true: ``data: {chunk}`` lines, then ``data: [DONE]``).

Each generation request goes the gRPC calls' way: refused with 503 while the server drains,
its ``x-correlation-id`` on its log lines, its span when tracing is on, counted in the
``tgi_*`` series, then admitted (``intake/admission.py``: batch size, permits, validation,
tokenization) and submitted to the engine; when the handler ends, however it ends (a
client that disconnects cancels it), its requests are aborted (a no-op for finished ones)
and its permits returned. Refusals have OpenAI's error shape (``openai_requests.py``):
400 for invalid requests, 401 for a wrong ``--api-key``, 404 for another model, 413 for a
body past the size limit, 429 when no concurrency permit is left, 503 while draining, 500
for a failure during generation.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import replace
from functools import partial
from typing import Any, NoReturn

from aiohttp import web

from tgis.router.core.engine import Engine
from tgis.router.core.request_state import RequestState
from tgis.router.edge.calls import CallGate, admitted
from tgis.router.edge.http_bodies import bearer_matches, read_json
from tgis.router.edge.openai_chat_replies import ChatReplies
from tgis.router.edge.openai_replies import OpenAIReplies
from tgis.router.edge.openai_requests import (
    OpenAIError,
    OpenAIRequest,
    bad_request,
    choice_seeds,
    parse_chat,
    parse_completion,
)
from tgis.router.edge.status import describe_exception
from tgis.router.edge.tracing import RequestSpan
from tgis.router.errors import (
    ConstraintError,
    GenerationError,
    OverloadedError,
    RouterError,
    UnavailableError,
    ValidationError,
)
from tgis.router.intake.admission import Admission
from tgis.router.intake.chat_template import ChatTemplate, ChatTemplateError
from tgis.router.ops.drain import SHUTTING_DOWN_MESSAGE
from tgis.router.ops.metrics import Metrics

__all__ = ["OpenAIRoutes"]

log = logging.getLogger(__name__)


NO_TEMPLATE_MESSAGE = (
    "this model has no chat template: give one with --chat-template (a file or the template "
    "itself), or put chat_template.jinja in the model directory; /v1/completions works "
    "without one"
)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class OpenAIRoutes:
    """The ``/v1`` handlers of one served model."""

    def __init__(
        self,
        *,
        admission: Admission,
        engine: Engine,
        replies: OpenAIReplies,
        gate: CallGate,
        chat_template: ChatTemplate | None,
        api_key: str | None = None,
        tool_call_parser: str = "hermes",
    ) -> None:
        self.admission = admission
        self.engine = engine
        self.replies = replies
        self.chat_replies = ChatReplies(replies)
        self.gate = gate
        self.chat_template = chat_template
        self.api_key = api_key
        self.tool_call_parser = tool_call_parser
        """The format of the model's own tool calls (``openai_tool_parsers.py``)."""
        self.metrics = admission.metrics
        self.created = int(time.time())
        self.named_models: dict[str, None] = {}
        """Adapters and prefixes named by ``model`` that resolved, in order (a set)."""

    def add_to(self, app: web.Application) -> None:
        app.router.add_get("/v1/models", self._guarded(self.models))
        app.router.add_post("/v1/completions", self._guarded(self.completions))
        app.router.add_post("/v1/chat/completions", self._guarded(self.chat_completions))

    # ---- handlers ----------------------------------------------------------------------------

    async def models(self, _: web.Request) -> web.StreamResponse:
        """The served model, then each adapter or prompt prefix requests have named by
        ``model`` since the start (their ``parent`` the served model, as vLLM lists LoRA
        modules); the router cannot list the adapter store's directory itself."""
        limits = self.admission.limits
        served = self.replies.model
        cards = [
            {
                "id": name,
                "object": "model",
                "created": self.created,
                "owned_by": "tgis",
                "root": served if name == served else name,
                "parent": None if name == served else served,
                "max_model_len": limits.max_sequence_length,
            }
            for name in [served, *self.named_models]
        ]
        return web.json_response({"object": "list", "data": cards})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, self._parse_completion)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, self._parse_chat)

    def _parse_completion(self, body: object) -> OpenAIRequest:
        limit = self.admission.limits.max_new_tokens
        return parse_completion(body, max_new_tokens=limit)

    def _parse_chat(self, body: object) -> OpenAIRequest:
        template = self.chat_template
        if template is None:
            raise bad_request(NO_TEMPLATE_MESSAGE, "messages")

        def render(messages: list[Mapping[str, Any]], tools: list[dict[str, Any]] | None) -> str:
            try:
                return template.render(messages, add_generation_prompt=True, tools=tools)
            except ChatTemplateError as err:
                raise bad_request(str(err), "messages") from None

        limit = self.admission.limits.max_new_tokens
        return parse_chat(
            body, render, max_new_tokens=limit, tool_call_parser=self.tool_call_parser
        )

    # ---- one generation request --------------------------------------------------------------

    async def _generate(
        self, request: web.Request, parse: Callable[[object], OpenAIRequest]
    ) -> web.StreamResponse:
        arrival = time.monotonic()
        headers = request.headers.items()
        # The call's name in its span: the verb and the route ("POST /v1/completions"; the
        # routes are fixed paths, so the path matched is the route).
        method = f"{request.method} {request.path}"
        call = self.gate.enter(method, headers, arrival, _refuse_draining, _describe_failure)
        async with call as span:
            return await self._admit_and_answer(request, parse, arrival, span)

    async def _admit_and_answer(
        self,
        request: web.Request,
        parse: Callable[[object], OpenAIRequest],
        arrival: float,
        span: RequestSpan | None,
    ) -> web.StreamResponse:
        try:
            parsed = await self._for_model(parse(await read_json(request, OpenAIError)))
            parsed = await self._with_prompt_texts(parsed)
        except OpenAIError:
            self.metrics.request_received("single", 1)
            self.metrics.request_failure("validation")
            raise
        count = len(parsed.call.texts)
        kind = "stream" if parsed.stream else ("single" if count == 1 else "batch")
        self.metrics.request_received(kind, count)
        try:
            seeded = partial(choice_seeds, parsed)
            call = admitted(self.engine, self.admission, parsed.call, arrival, span, seeded)
            async with call as states:
                return await self._answer(request, parsed, states, arrival)
        except RouterError as err:
            if isinstance(err, GenerationError):
                self.metrics.request_failure("generate")
            raise _openai_error(err) from None

    async def _answer(
        self,
        request: web.Request,
        parsed: OpenAIRequest,
        states: Sequence[RequestState],
        arrival: float,
    ) -> web.StreamResponse:
        if not parsed.stream:
            if parsed.chat:
                body = await self.chat_replies.chat(parsed, states, arrival)
            else:
                body = await self.replies.completion(parsed, states, arrival)
            return web.json_response(body)
        if parsed.chat:
            chunks = self.chat_replies.chat_chunks(parsed, states, arrival)
        else:
            chunks = self.replies.completion_chunks(parsed, states, arrival)
        return await _send_events(request, chunks, self.metrics)

    async def _with_prompt_texts(self, parsed: OpenAIRequest) -> OpenAIRequest:
        """Prompts given as token ids get their texts (what ``echo`` shows, special tokens
        included), decoded on the tokenizer's pool."""
        token_ids = parsed.call.token_ids
        if token_ids is None:
            return parsed
        tokenizer = self.admission.tokenizer

        def decode() -> tuple[str, ...]:
            return tuple(tokenizer.decode(ids, skip_special_tokens=False) for ids in token_ids)

        return replace(parsed, call=replace(parsed.call, texts=await tokenizer.run_async(decode)))

    async def _for_model(self, parsed: OpenAIRequest) -> OpenAIRequest:
        """``parsed`` for the model it names: the served model as is; another name is a
        LoRA or prompt-tuning adapter of the adapter store (vLLM's convention), else a
        prompt-tuning prefix of the prefix store (TGIS's ``prefix_id``); else 404."""
        name = parsed.model
        if name is None or name == self.replies.model:
            return parsed
        candidates = [replace(parsed.call, prefix_id=name)]
        if self.admission.adapters is not None:
            candidates.insert(0, replace(parsed.call, adapter_id=name))
        for call in candidates:
            try:
                await self.admission.resolve_adapters(call.prefix_id, call.adapter_id)
            except ValidationError:
                continue
            self.named_models[name] = None
            return replace(parsed, call=call)
        raise OpenAIError(
            404, f"The model `{name}` does not exist.", param="model", code="model_not_found"
        )

    # ---- authorization and errors ------------------------------------------------------------

    def _guarded(self, handler: Handler) -> Handler:
        """``handler`` behind the API key (when one is set), its OpenAIErrors as JSON."""

        async def guarded(request: web.Request) -> web.StreamResponse:
            try:
                self._authorize(request)
                return await handler(request)
            except OpenAIError as err:
                return web.json_response(err.body(), status=err.status)

        return guarded

    def _authorize(self, request: web.Request) -> None:
        if self.api_key is not None and not bearer_matches(request, self.api_key):
            raise OpenAIError(401, "Incorrect API key provided.", code="invalid_api_key")


async def _refuse_draining() -> NoReturn:
    raise OpenAIError(503, SHUTTING_DOWN_MESSAGE, type="service_unavailable")


def _describe_failure(error: BaseException | None) -> str | None:
    """How a request failed, for its span: the status and message it was refused with."""
    if isinstance(error, OpenAIError):
        return f"{error.status}: {error.message}"
    return describe_exception(error)


def _openai_error(err: RouterError) -> OpenAIError:
    if isinstance(err, ValidationError | ConstraintError):
        return bad_request(err.message)
    if isinstance(err, OverloadedError):
        return OpenAIError(429, err.message, type="rate_limit_exceeded")
    if isinstance(err, UnavailableError):
        return OpenAIError(503, err.message, type="service_unavailable")
    if isinstance(err, GenerationError):
        log.error("Request failed: %s", err)
    return OpenAIError(500, err.message, type="server_error")


async def _send_events(
    request: web.Request, chunks: AsyncIterator[dict[str, Any]], metrics: Metrics
) -> web.StreamResponse:
    """Stream ``chunks`` as server-sent events, then ``[DONE]``. A failure once the
    stream has started is sent as an error event (the status is already sent), followed
    by ``[DONE]`` (as vLLM does) unless the server is shutting down: a stream the drain
    ended closes without it, so that no client can take it for a complete one."""
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await response.prepare(request)
    try:
        async for chunk in chunks:
            await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
    except RouterError as err:
        if isinstance(err, GenerationError):
            metrics.request_failure("generate")
        error = _openai_error(err)
        await response.write(b"data: " + json.dumps(error.body()).encode() + b"\n\n")
        if isinstance(err, UnavailableError):
            await response.write_eof()
            return response
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response
