"""OpenTelemetry tracing of generation calls, exported with OTLP/gRPC (``--otlp-endpoint``).

Optional: the packages come with ``pip install 'tgis[otel]'``. Without them, or without an
endpoint, ``setup_tracing`` returns None and the servicer creates no span objects at all
(one ``is None`` test per call).

One trace per Generate / GenerateStream call (and per OpenAI generation request, its root
named ``POST /v1/completions`` or ``POST /v1/chat/completions`` with the HTTP attributes),
its parent taken from the W3C ``traceparent`` metadata or header when the client sends one::

    fmaas.GenerationService/Generate      the whole call (correlation_id, prefix_id and
                                          adapter_id when sent, status)
    ├── validation                        parameters checked, inputs tokenized
    │   └── guided_compile                the guided constraint compiled (kind; cached
    │                                     ones take microseconds), when the call has one
    ├── queue          (one per input)    submitted to the engine .. first scheduled
    └── inference      (one per input)    first scheduled .. last token

The child spans are recorded when the call ends, from the times the servicer and the engine
already keep (monotonic clock, converted to the epoch), so nothing runs per token.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from tgis.router.config import TracingConfig
from tgis.router.core.request_state import RequestState
from tgis.router.request_types import GuidedKind, StopReason

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span

log = logging.getLogger(__name__)

SERVICE = "fmaas.GenerationService"
_STOPPED = frozenset(StopReason) - {
    StopReason.NOT_FINISHED,
    StopReason.CANCELLED,
    StopReason.ERROR,
}
MISSING_PACKAGES_WARNING = (
    "OTLP_ENDPOINT is set but the OpenTelemetry packages are not installed "
    "(pip install 'tgis[otel]'): tracing is off"
)


def otlp_target(endpoint: str) -> tuple[str, bool]:
    """(endpoint with a scheme, insecure): ``host:port`` alone means plaintext, as
    in-cluster collectors usually are; ``https://`` means TLS."""
    if "://" not in endpoint:
        endpoint = f"http://{endpoint}"
    return endpoint, not endpoint.startswith("https://")


def span_identity(method: str) -> tuple[str, dict[str, str]]:
    """The root span's name and attributes for a call: ``method`` is a gRPC method of the
    service (``Generate``) or an HTTP verb and route (``POST /v1/completions``), named as
    OpenTelemetry's semantic conventions name RPC and HTTP server spans."""
    verb, _, route = method.partition(" ")
    if route:
        return method, {"http.request.method": verb, "http.route": route}
    return f"{SERVICE}/{method}", {
        "rpc.system": "grpc",
        "rpc.service": SERVICE,
        "rpc.method": method,
    }


class Tracing:
    """The router's tracer; ``start`` opens the span of one call."""

    def __init__(self, provider: TracerProvider, propagator: Any) -> None:
        self._provider = provider
        self._tracer = provider.get_tracer("tgis.router")
        self._propagator = propagator
        # monotonic seconds -> epoch nanoseconds (the servicer and engine keep monotonic times)
        self._offset_ns = time.time_ns() - time.monotonic_ns()

    def epoch_ns(self, monotonic: float) -> int:
        return int(monotonic * 1e9) + self._offset_ns

    def start(
        self,
        method: str,
        metadata: Iterable[tuple[str, str | bytes]] | None,
        correlation_id: str,
        arrival: float,
    ) -> RequestSpan:
        carrier = {key.lower(): value for key, value in metadata or () if isinstance(value, str)}
        parent = self._propagator.extract(carrier=carrier)
        from opentelemetry.trace import SpanKind

        name, attributes = span_identity(method)
        span = self._tracer.start_span(
            name,
            context=parent,
            kind=SpanKind.SERVER,
            start_time=self.epoch_ns(arrival),
            attributes={**attributes, "correlation_id": correlation_id},
        )
        return RequestSpan(self, span, arrival)

    def child(
        self,
        parent: Span,
        name: str,
        start: float,
        end: float,
        error: str | None = None,
        **attributes: Any,
    ) -> Span:
        """A span under ``parent`` from ``start`` to ``end``, already ended (its status is
        ERROR with ``error`` when one is given: an ended span's status cannot change)."""
        from opentelemetry.trace import Status, StatusCode, set_span_in_context

        span = self._tracer.start_span(
            name,
            context=set_span_in_context(parent),
            start_time=self.epoch_ns(start),
            attributes=attributes,
        )
        if error is not None:
            span.set_status(Status(StatusCode.ERROR, error))
        span.end(end_time=self.epoch_ns(max(end, start)))
        return span

    def shutdown(self, timeout: float) -> None:
        """Export what is buffered and stop the exporter, waiting ``timeout`` seconds at most
        (an unreachable collector must not hold up the exit)."""
        worker = threading.Thread(target=self._provider.shutdown, name="otel-flush", daemon=True)
        worker.start()
        worker.join(timeout)


class RequestSpan:
    """The spans of one call; the servicer marks the moments, ``finish`` records them."""

    def __init__(self, tracing: Tracing, span: Span, arrival: float) -> None:
        self._tracing = tracing
        self.span = span
        self.arrival = arrival
        self.validated_at: float | None = None
        self.states: Sequence[RequestState] = ()
        self.compile: tuple[GuidedKind, float, float, str | None] | None = None

    def adapters(self, prefix_id: str | None, adapter_id: str | None) -> None:
        """The request's ``prefix_id`` and ``adapter_id``, as span attributes of the same
        names (None: not sent, no attribute)."""
        if prefix_id is not None:
            self.span.set_attribute("prefix_id", prefix_id)
        if adapter_id is not None:
            self.span.set_attribute("adapter_id", adapter_id)

    def guided_compiled(
        self, kind: GuidedKind, start: float, end: float, error: str | None
    ) -> None:
        """The guided constraint was compiled (``error``: the refusal)."""
        self.compile = (kind, start, end, error)

    def validated(self, states: Sequence[RequestState], at: float) -> None:
        """Validation ended and these inputs went to the engine at ``at``."""
        self.validated_at = at
        self.states = states

    def finish(self, error: str | None, end: float | None = None) -> None:
        """Record the child spans and end the call's span (``error``: how it failed)."""
        from opentelemetry.trace import Status, StatusCode

        end = time.monotonic() if end is None else end
        tracing, span = self._tracing, self.span
        validation_end = self.validated_at if self.validated_at is not None else end
        refused = error if self.validated_at is None else None
        child = tracing.child(span, "validation", self.arrival, validation_end, refused)
        if self.compile is not None:
            kind, start, compiled, refusal = self.compile
            tracing.child(child, "guided_compile", start, compiled, refusal, kind=kind.value)
        for index, state in enumerate(self.states):
            started = None if state.started_at is None else min(state.started_at, end)
            tracing.child(
                span,
                "queue",
                validation_end,
                started if started is not None else end,
                request_id=state.request_id,
                input_index=index,
                input_tokens=state.request.input_length,
            )
            if started is not None:
                # The last token's time, unless it ended otherwise (failed, cancelled).
                finished = state.last_token_at if state.finish_reason in _STOPPED else None
                tracing.child(
                    span,
                    "inference",
                    started,
                    end if finished is None else min(finished, end),
                    request_id=state.request_id,
                    input_index=index,
                    generated_tokens=len(state.generated_ids),
                    stop_reason=state.finish_reason.name if state.finish_reason else "",
                )
        if error is not None:
            span.set_status(Status(StatusCode.ERROR, error))
        span.end(end_time=tracing.epoch_ns(end))


def setup_tracing(config: TracingConfig | None) -> Tracing | None:
    """The tracer exporting to ``config.endpoint``; None when tracing is off (no endpoint,
    or the packages are missing: one warning)."""
    if config is None:
        return None
    try:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
    except ImportError:
        log.warning(MISSING_PACKAGES_WARNING)
        return None
    endpoint, insecure = otlp_target(config.endpoint)
    provider = TracerProvider(resource=Resource.create({"service.name": config.service_name}))
    exporter = OTLPSpanExporter(endpoint=endpoint, insecure=insecure)
    provider.add_span_processor(BatchSpanProcessor(exporter))
    log.info("tracing: OTLP spans to %s as service %s", endpoint, config.service_name)
    return Tracing(provider, TraceContextTextMapPropagator())
