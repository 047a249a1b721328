"""The surroundings of every generation call: drain, correlation id and span.

``async with gate.open(method, context, arrival) as span:`` (a gRPC call) refuses the call
with ``UNAVAILABLE`` while the server drains (SIGTERM), counts it in, binds its
``x-correlation-id`` to the task's log lines (``ops/request_context.py``) and opens its span
when tracing is on; leaving the block undoes all three, the span ending with how the call
failed, if it did (``status.py: describe_failure``). ``gate.enter`` is the same for any
protocol: an HTTP route (``openai_routes.py``) gives its headers, its own refusal and its
own description of a failure.

``async with admitted(engine, admission, call, arrival, span) as states:`` is what every
generation call of the HTTP routes does between its parsing and its answer: the batch size,
the permits, the validation, the requests submitted to the engine, and, when the block
ends however it ends, the requests ended (``end_requests``) and the permits returned.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from contextvars import Token
from types import TracebackType
from typing import NoReturn

import grpc

from tgis.log import bind_log_fields, reset_log_fields
from tgis.router.core.engine import Engine
from tgis.router.core.request_state import RequestState
from tgis.router.edge.status import abort, describe_failure
from tgis.router.edge.tracing import RequestSpan, Tracing
from tgis.router.errors import UnavailableError
from tgis.router.intake.admission import Admission, GenerationCall
from tgis.router.ops.drain import SHUTTING_DOWN_MESSAGE, Drain
from tgis.router.ops.request_context import correlation_id
from tgis.router.request_types import StopReason, ValidatedRequest

__all__ = ["CallGate", "OpenCall", "admitted", "end_requests"]

Refusal = Callable[[], Awaitable[NoReturn]]
"""Ends a call that arrives while the server drains (raises)."""
Describe = Callable[[BaseException | None], "str | None"]
"""How a call failed, for its span (None: it did not)."""


class CallGate:
    """Opens calls against one drain state and one tracer (None: tracing off)."""

    def __init__(self, drain: Drain, tracing: Tracing | None = None) -> None:
        self.drain = drain
        self.tracing = tracing

    def open(self, method: str, context: grpc.aio.ServicerContext, arrival: float) -> OpenCall:
        """A gRPC call: refused with ``UNAVAILABLE`` while draining."""

        async def refuse() -> NoReturn:
            await abort(context, UnavailableError(SHUTTING_DOWN_MESSAGE))

        def describe(error: BaseException | None) -> str | None:
            return describe_failure(error, context)

        return self.enter(method, context.invocation_metadata(), arrival, refuse, describe)

    def enter(
        self,
        method: str,
        metadata: Iterable[tuple[str, str | bytes]] | None,
        arrival: float,
        refuse: Refusal,
        describe: Describe,
    ) -> OpenCall:
        """A call of any protocol: ``metadata`` its headers, ``refuse`` what a call that
        arrives while draining gets, ``describe`` how a failure reads in its span."""
        return OpenCall(self, method, tuple(metadata or ()), arrival, refuse, describe)


class OpenCall:
    """One call inside its gate (an async context manager; its value is the span)."""

    __slots__ = (
        "_arrival",
        "_describe",
        "_fields",
        "_gate",
        "_metadata",
        "_method",
        "_refuse",
        "_span",
    )

    def __init__(
        self,
        gate: CallGate,
        method: str,
        metadata: tuple[tuple[str, str | bytes], ...],
        arrival: float,
        refuse: Refusal,
        describe: Describe,
    ) -> None:
        self._gate = gate
        self._method = method
        self._metadata = metadata
        self._arrival = arrival
        self._refuse = refuse
        self._describe = describe
        self._fields: Token[Mapping[str, object]] | None = None
        self._span: RequestSpan | None = None

    async def __aenter__(self) -> RequestSpan | None:
        gate = self._gate
        if not gate.drain.enter():
            await self._refuse()
        correlation = correlation_id(self._metadata)
        self._fields = bind_log_fields(correlation_id=correlation)
        if gate.tracing is not None:
            self._span = gate.tracing.start(
                self._method, self._metadata, correlation, self._arrival
            )
        return self._span

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._gate.drain.exit()
        if self._span is not None:
            self._span.finish(self._describe(error))
        if self._fields is not None:
            with contextlib.suppress(ValueError):  # a generator closed from another context
                reset_log_fields(self._fields)


def end_requests(engine: Engine, admission: Admission, states: Sequence[RequestState]) -> None:
    """What a call does with its requests when it ends, however it ends: cancel those still
    live (a no-op for finished ones); the prefix and adapter of one that failed are looked
    up again by the next call."""
    for state in states:
        engine.abort(state)
        if state.finish_reason is StopReason.ERROR:
            admission.forget_lookups(state.request)


@contextlib.asynccontextmanager
async def admitted(
    engine: Engine,
    admission: Admission,
    call: GenerationCall,
    arrival: float,
    span: RequestSpan | None,
    adjust: Callable[[list[ValidatedRequest]], list[ValidatedRequest]] | None = None,
) -> AsyncIterator[list[RequestState]]:
    """``call``'s inputs admitted (``--max-client-batch-size``, one permit each, validation)
    and submitted to the engine, one state per input; when the block ends, however it ends
    (a client that disconnects cancels it), they are ended and their permits returned.
    ``adjust`` may rewrite the validated requests before they are submitted (the OpenAI
    routes' per-choice seeds).

    Raises:
        RouterError: a refusal (counted where it was found).
    """
    count = len(call.texts)
    admission.check_batch_size(count)
    with admission.permits(count):
        on_compile = None if span is None else span.guided_compiled
        validated = await admission.validate(call, arrival, on_compile)
        if adjust is not None:
            validated = adjust(validated)
        states = [engine.submit(v, arrival) for v in validated]
        if span is not None:
            span.validated(states, time.monotonic())
        try:
            yield states
        finally:
            end_requests(engine, admission, states)
