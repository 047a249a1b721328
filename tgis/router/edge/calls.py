"""The surroundings of every generation call: drain, correlation id and span.

``async with gate.open(method, context, arrival) as span:`` refuses the call with
``UNAVAILABLE`` while the server drains (SIGTERM), counts it in, binds its
``x-correlation-id`` to the task's log lines (``ops/request_context.py``) and opens its span
when tracing is on; leaving the block undoes all three, the span ending with how the call
failed, if it did (``status.py: describe_failure``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from contextvars import Token
from types import TracebackType

import grpc

from tgis.log import bind_log_fields, reset_log_fields
from tgis.router.edge.status import abort, describe_failure
from tgis.router.edge.tracing import RequestSpan, Tracing
from tgis.router.errors import UnavailableError
from tgis.router.ops.drain import SHUTTING_DOWN_MESSAGE, Drain
from tgis.router.ops.request_context import correlation_id

__all__ = ["CallGate", "OpenCall"]


class CallGate:
    """Opens calls against one drain state and one tracer (None: tracing off)."""

    def __init__(self, drain: Drain, tracing: Tracing | None = None) -> None:
        self.drain = drain
        self.tracing = tracing

    def open(self, method: str, context: grpc.aio.ServicerContext, arrival: float) -> OpenCall:
        return OpenCall(self, method, context, arrival)


class OpenCall:
    """One call inside its gate (an async context manager; its value is the span)."""

    __slots__ = ("_arrival", "_context", "_fields", "_gate", "_method", "_span")

    def __init__(
        self, gate: CallGate, method: str, context: grpc.aio.ServicerContext, arrival: float
    ) -> None:
        self._gate = gate
        self._method = method
        self._context = context
        self._arrival = arrival
        self._fields: Token[Mapping[str, object]] | None = None
        self._span: RequestSpan | None = None

    async def __aenter__(self) -> RequestSpan | None:
        gate = self._gate
        if not gate.drain.enter():
            await abort(self._context, UnavailableError(SHUTTING_DOWN_MESSAGE))
        metadata = self._context.invocation_metadata()
        correlation = correlation_id(metadata)
        self._fields = bind_log_fields(correlation_id=correlation)
        if gate.tracing is not None:
            self._span = gate.tracing.start(self._method, metadata, correlation, self._arrival)
        return self._span

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._gate.drain.exit()
        if self._span is not None:
            self._span.finish(describe_failure(error, self._context))
        if self._fields is not None:
            with contextlib.suppress(ValueError):  # a generator closed from another context
                reset_log_fields(self._fields)
