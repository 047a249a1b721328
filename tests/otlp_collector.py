"""A stand-in OpenTelemetry collector: the OTLP/gRPC TraceService on 127.0.0.1, in the test
process, built from opentelemetry-proto's generated classes. It keeps every span exported."""

from __future__ import annotations

import threading
import time
from concurrent import futures
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


@dataclass(frozen=True)
class ExportedSpan:
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    status_code: int
    status_message: str
    service_name: str


def _value(any_value: Any) -> Any:
    kind = any_value.WhichOneof("value")
    return getattr(any_value, kind) if kind else None


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, collector: OtlpCollector) -> None:
        self.collector = collector

    def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: grpc.ServicerContext
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        spans = []
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    spans.append(
                        ExportedSpan(
                            name=span.name,
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent_span_id=span.parent_span_id.hex(),
                            start_ns=span.start_time_unix_nano,
                            end_ns=span.end_time_unix_nano,
                            attributes={a.key: _value(a.value) for a in span.attributes},
                            status_code=span.status.code,
                            status_message=span.status.message,
                            service_name=str(resource.get("service.name", "")),
                        )
                    )
        self.collector.add(spans)
        return trace_service_pb2.ExportTraceServiceResponse()


class OtlpCollector:
    """``with OtlpCollector() as c:`` serves on ``c.endpoint`` (http://127.0.0.1:PORT)."""

    def __init__(self) -> None:
        self.spans: list[ExportedSpan] = []
        self._changed = threading.Condition()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_TraceService(self), self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def add(self, spans: list[ExportedSpan]) -> None:
        with self._changed:
            self.spans.extend(spans)
            self._changed.notify_all()

    def wait_for(self, count: int, name: str | None = None, timeout: float = 10.0) -> None:
        """Until ``count`` spans (named ``name``, if given) arrived."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while len([s for s in self.spans if name is None or s.name == name]) < count:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"no {count} spans {name or ''} in {self.spans}")
                self._changed.wait(left)

    def __enter__(self) -> OtlpCollector:
        self._server.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._server.stop(0)
