"""HF TGI's REST routes on the HTTP port: ``POST /generate``, ``POST /generate_stream``
(server-sent events: ``data:{event}`` lines, one per token), ``POST /`` (either, as the
body's ``stream`` says; unary answers come as a one-element list, as TGI's), ``GET /info``
and ``POST /tokenize``. ``GET /health`` is ``http_server.py``'s, shared by every API.

A generation request goes the other APIs' way (``calls.py``): refused with 503 while the
server drains, its ``x-correlation-id`` on its log lines, its span when tracing is on,
counted in the ``tgi_*`` series, admitted (batch size, permits, validation, tokenization)
and submitted to the engine; when the handler ends, however it ends (a client that
disconnects cancels it), its request is aborted (a no-op once finished) and its permit
returned. Behind ``--api-key`` (``Authorization: Bearer``) but for ``/info``, as TGI's.

Refusals have TGI's shape, ``{"error", "error_type"}`` (``tgi_requests.py: TGIError``): 422
``validation`` (a body or parameter refused, a grammar that cannot be followed), 424
``generation`` (a failure during generation), 429 ``overloaded`` (no concurrency permit
left), 503 ``unavailable`` (draining), 401, 413. A failure once a stream has started is an
event of that shape, and the stream ends.
"""

from __future__ import annotations

import functools
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, NoReturn

from aiohttp import web

from tgis.router.core.engine import Engine
from tgis.router.core.request_state import RequestState
from tgis.router.edge.calls import CallGate, admitted
from tgis.router.edge.http_bodies import bearer_matches, read_json
from tgis.router.edge.status import describe_exception
from tgis.router.edge.tgi_replies import TGIReplies
from tgis.router.edge.tgi_requests import (
    TGIError,
    TGIRequest,
    parse_generate,
    parse_tokenize,
    validation_error,
)
from tgis.router.edge.tracing import RequestSpan
from tgis.router.errors import (
    ConstraintError,
    GenerationError,
    OverloadedError,
    RouterError,
    TokenizationError,
    UnavailableError,
    ValidationError,
)
from tgis.router.intake.admission import Admission
from tgis.router.ops.drain import SHUTTING_DOWN_MESSAGE

__all__ = ["TGIRoutes", "tgi_error"]

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

_EVENT_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


class TGIRoutes:
    """TGI's handlers of one served model; ``info`` is ``/info``'s body
    (``tgi_replies.py: server_info``)."""

    def __init__(
        self,
        *,
        admission: Admission,
        engine: Engine,
        replies: TGIReplies,
        gate: CallGate,
        info: dict[str, Any],
        api_key: str | None = None,
    ) -> None:
        self.admission = admission
        self.engine = engine
        self.replies = replies
        self.gate = gate
        self.info = info
        self.api_key = api_key
        self.metrics = admission.metrics

    def add_to(self, app: web.Application) -> None:
        app.router.add_post("/generate", self._guarded(functools.partial(self._generate, False)))
        app.router.add_post(
            "/generate_stream", self._guarded(functools.partial(self._generate, True))
        )
        app.router.add_post("/", self._guarded(functools.partial(self._generate, None)))
        app.router.add_post("/tokenize", self._guarded(self.tokenize))
        app.router.add_get("/info", self.get_info)

    # ---- handlers ----------------------------------------------------------------------------

    async def get_info(self, _: web.Request) -> web.StreamResponse:
        return web.json_response(self.info)

    async def tokenize(self, request: web.Request) -> web.StreamResponse:
        started = time.monotonic()
        self.metrics.tokenize_received(1)
        limits = self.admission.limits
        max_input = limits.max_input_tokens or limits.max_sequence_length - 1
        parsed = parse_tokenize(await _json_body(request), max_input_tokens=max_input)
        tokenizer = self.admission.tokenizer
        try:
            tokens = await tokenizer.run_async(functools.partial(self.replies.tokenize, parsed))
        except Exception as err:  # a tokenizer failure is the caller's input problem
            raise tgi_error(TokenizationError(str(err))) from None
        self.metrics.tokenize_done(len(tokens), time.monotonic() - started)
        return web.json_response(tokens)

    async def _generate(self, stream: bool | None, request: web.Request) -> web.StreamResponse:
        """``stream``: the route's choice; None (``POST /``): the body's."""
        arrival = time.monotonic()
        # The call's name in its span: the verb and the route (fixed paths).
        method = f"{request.method} {request.path}"
        call = self.gate.enter(
            method, request.headers.items(), arrival, _refuse_draining, _describe_failure
        )
        async with call as span:
            return await self._admit_and_answer(request, stream, arrival, span)

    async def _admit_and_answer(
        self, request: web.Request, stream: bool | None, arrival: float, span: RequestSpan | None
    ) -> web.StreamResponse:
        limits = self.admission.limits
        try:
            parsed = parse_generate(
                await _json_body(request),
                stream=stream,
                max_new_tokens=limits.max_new_tokens,
                max_input_tokens=limits.max_input_tokens or limits.max_sequence_length - 1,
            )
        except TGIError:
            self.metrics.request_received("single", 1)
            self.metrics.request_failure("validation")
            raise
        self.metrics.request_received("stream" if parsed.stream else "single", 1)
        try:
            async with admitted(self.engine, self.admission, parsed.call, arrival, span) as states:
                if parsed.stream:
                    return await self._send_events(request, parsed, states[0], arrival)
                body, headers = await self.replies.generate(parsed, states[0], arrival)
                listed = stream is None  # POST / answers a list, as TGI's
                return web.json_response([body] if listed else body, headers=headers)
        except RouterError as err:
            if isinstance(err, GenerationError):
                self.metrics.request_failure("generate")
            raise tgi_error(err) from None

    async def _send_events(
        self, request: web.Request, parsed: TGIRequest, state: RequestState, arrival: float
    ) -> web.StreamResponse:
        """The stream's events; a failure once it has started is an error event, and the
        stream ends (TGI sends no end marker)."""
        response = web.StreamResponse(headers=_EVENT_HEADERS)
        await response.prepare(request)
        try:
            async for events in self.replies.events(parsed, state, arrival):
                await response.write(b"".join(map(_event, events)))
        except RouterError as err:
            if isinstance(err, GenerationError):
                self.metrics.request_failure("generate")
            await response.write(_event(tgi_error(err).body()))
        await response.write_eof()
        return response

    # ---- authorization and errors ------------------------------------------------------------

    def _guarded(self, handler: Handler) -> Handler:
        """``handler`` behind the API key (when one is set), its TGIErrors as JSON."""

        async def guarded(request: web.Request) -> web.StreamResponse:
            try:
                if self.api_key is not None and not bearer_matches(request, self.api_key):
                    raise TGIError(401, "Unauthorized", "authorization")
                return await handler(request)
            except TGIError as err:
                return web.json_response(err.body(), status=err.status)

        return guarded


def _event(data: dict[str, Any]) -> bytes:
    """One server-sent event, as TGI writes it (``data:`` and the JSON, no space)."""
    return b"data:" + json.dumps(data).encode() + b"\n\n"


def tgi_error(err: RouterError) -> TGIError:
    """The router's errors in TGI's shape and statuses."""
    if isinstance(err, ValidationError | TokenizationError):
        return validation_error(err.message)
    if isinstance(err, ConstraintError):  # the grammar could not be followed: the input's
        return TGIError(422, err.message, "validation")
    if isinstance(err, OverloadedError):
        return TGIError(429, err.message, "overloaded")
    if isinstance(err, UnavailableError):
        return TGIError(503, err.message, "unavailable")
    if isinstance(err, GenerationError):
        log.error("Request failed: %s", err)
        return TGIError(424, err.message, "generation")
    return TGIError(500, err.message, "internal")


async def _refuse_draining() -> NoReturn:
    raise TGIError(503, SHUTTING_DOWN_MESSAGE, "unavailable")


def _describe_failure(error: BaseException | None) -> str | None:
    """How a request failed, for its span: the status and message it was refused with."""
    if isinstance(error, TGIError):
        return f"{error.status}: {error.message}"
    return describe_exception(error)


async def _json_body(request: web.Request) -> object:
    def refuse(status: int, message: str) -> TGIError:
        if status == 413:
            return TGIError(413, message, "validation")
        return validation_error(message)

    return await read_json(request, refuse)
