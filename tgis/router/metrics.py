"""The tgi_* Prometheus metrics, each defined once (name, labels, buckets).

TGIS's exporter emits every counter twice, as `name` and `name_total`; `DualCounter`
does the same so dashboards written for either spelling keep working.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, Metric, UnknownMetricFamily
from prometheus_client.registry import Collector

DURATION_BUCKETS = tuple(0.0001 * 1.5**k for k in range(1, 36))


class DualCounter(Collector):
    """A labelled counter rendered as both `<name>` and `<name>_total`."""

    def __init__(self, name: str, doc: str, labelnames: Sequence[str] = ()) -> None:
        self.name = name
        self.doc = doc
        self.labelnames = tuple(labelnames)
        self._values: dict[tuple[str, ...], float] = {}

    def inc(self, *labels: str, amount: float = 1.0) -> None:
        if len(labels) != len(self.labelnames):
            raise ValueError(f"{self.name} takes labels {self.labelnames}")
        self._values[labels] = self._values.get(labels, 0.0) + amount

    def value(self, *labels: str) -> float:
        return self._values.get(labels, 0.0)

    def collect(self) -> Iterator[Metric]:
        total = CounterMetricFamily(self.name, self.doc, labels=self.labelnames)
        plain = UnknownMetricFamily(self.name, self.doc, labels=self.labelnames)
        for labels, value in sorted(self._values.items()):
            total.add_metric(list(labels), value)
            plain.add_metric(list(labels), value)
        yield plain
        yield total


def _steps(limit: int, count: int = 64) -> tuple[float, ...]:
    step = max(limit / count, 1.0)
    return tuple(step * k for k in range(1, count + 1))


class Metrics:
    """Every router metric, registered in one registry (rendered by GET /metrics)."""

    def __init__(self, *, max_sequence_length: int, max_new_tokens: int, max_batch_size: int):
        self.registry = CollectorRegistry(auto_describe=True)
        counters = {
            "request_count": ("tgi_request_count", "gRPC generate calls", ("kind",)),
            "request_input_count": ("tgi_request_input_count", "inputs received", ()),
            "request_failure": ("tgi_request_failure", "failed requests", ("err",)),
            "request_success": (
                "tgi_request_success",
                "successful inputs",
                ("stop_reason", "kind"),
            ),
            "inference_count": ("tgi_batch_inference_count", "shard steps", ("method",)),
            "inference_ok": ("tgi_batch_inference_success", "successful steps", ("method",)),
            "inference_failed": (
                "tgi_batch_inference_failure",
                "failed steps",
                ("method", "reason"),
            ),
            "tokenize_count": ("tgi_tokenize_request_count", "Tokenize calls", ()),
            "tokenize_inputs": ("tgi_tokenize_request_input_count", "texts tokenized", ()),
        }
        self._counters: dict[str, DualCounter] = {}
        for key, (name, doc, labels) in counters.items():
            counter = DualCounter(name, doc, labels)
            self.registry.register(counter)
            self._counters[key] = counter
        reg = self.registry
        self.queue_size = Gauge("tgi_queue_size", "queued requests", registry=reg)
        self.batch_size = Gauge("tgi_batch_current_size", "running batch size", registry=reg)
        self.input_length = Histogram(
            "tgi_request_input_length",
            "validated input tokens",
            buckets=_steps(max_sequence_length),
            registry=reg,
        )
        self.generated_tokens = Histogram(
            "tgi_request_generated_tokens",
            "generated tokens per request",
            buckets=_steps(max_new_tokens),
            registry=reg,
        )
        self.request_duration = Histogram(
            "tgi_request_duration",
            "end-to-end request seconds",
            buckets=DURATION_BUCKETS,
            registry=reg,
        )
        self.queue_duration = Histogram(
            "tgi_request_queue_duration",
            "seconds queued",
            buckets=DURATION_BUCKETS,
            registry=reg,
        )
        self.inference_duration = Histogram(
            "tgi_batch_inference_duration",
            "seconds per shard step",
            ["method", "makeup"],
            buckets=DURATION_BUCKETS,
            registry=reg,
        )
        self.forward_duration = Histogram(
            "tgi_batch_inference_forward_duration",
            "shard-reported forward seconds per step",
            ["method", "makeup"],
            buckets=DURATION_BUCKETS,
            registry=reg,
        )
        self.batch_size_hist = Histogram(
            "tgi_batch_inference_batch_size",
            "sequences per step",
            ["method"],
            buckets=tuple(float(b) for b in range(1, max_batch_size + 1)),
            registry=reg,
        )
        self.tokenize_tokens = Histogram(
            "tgi_tokenize_request_tokens",
            "tokens returned per Tokenize call",
            buckets=tuple(float(2**k) for k in range(6, 20)),
            registry=reg,
        )
        self.tokenize_duration = Histogram(
            "tgi_tokenize_request_duration",
            "seconds per Tokenize call",
            buckets=DURATION_BUCKETS,
            registry=reg,
        )

    def counter(self, key: str) -> DualCounter:
        return self._counters[key]

    def request_failure(self, err: str) -> None:
        self._counters["request_failure"].inc(err)

    def inference_failure(self, reason: str) -> None:
        self._counters["inference_count"].inc("step")
        self._counters["inference_failed"].inc("step", reason)

    def inference_success(self, seconds: float, forward_ns: int) -> None:
        self._counters["inference_count"].inc("step")
        self._counters["inference_ok"].inc("step")
        self.inference_duration.labels("step", "mixed").observe(seconds)
        self.forward_duration.labels("step", "mixed").observe(forward_ns / 1e9)

    def render(self) -> bytes:
        return generate_latest(self.registry)
