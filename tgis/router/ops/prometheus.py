"""Prometheus collectors for TGIS's exposition (see ``metrics.py`` for the rules): counters
rendered under two names, summaries over a sliding window, and TGIS's bucket sets."""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence

from prometheus_client.core import CounterMetricFamily, Metric, UnknownMetricFamily
from prometheus_client.registry import Collector

__all__ = [
    "DURATION_BUCKETS",
    "SUMMARY_QUANTILES",
    "SUMMARY_WINDOW_S",
    "TOKENIZE_BUCKETS",
    "DualCounter",
    "WindowedSummary",
    "equal_steps",
]

DURATION_BUCKETS = tuple(0.0001 * 1.5**k for k in range(1, 36))
TOKENIZE_BUCKETS = tuple(float(2**k) for k in range(6, 20))
SUMMARY_QUANTILES = (0.0, 0.5, 0.9, 0.95, 0.99, 0.999, 1.0)
SUMMARY_WINDOW_S = 60.0


def equal_steps(limit: int, count: int = 64) -> tuple[float, ...]:
    """TGIS's token buckets: ``limit/64 * (1..64)``; 1..limit when limit < 64 (whole tokens)."""
    if limit >= count:
        return tuple(limit / count * k for k in range(1, count + 1))
    return tuple(float(k) for k in range(1, max(limit, 1) + 1))


class DualCounter(Collector):
    """A counter rendered as ``<name>`` (untyped) and ``<name>_total`` (counter)."""

    def __init__(
        self,
        name: str,
        doc: str,
        labelnames: Sequence[str] = (),
        initial: Iterable[Sequence[str]] = (),
    ) -> None:
        self.name = name
        self.doc = doc
        self.labelnames = tuple(labelnames)
        self._values: dict[tuple[str, ...], float] = {}
        if not self.labelnames:
            self._values[()] = 0.0
        for labels in initial:
            self._check(tuple(labels))
            self._values[tuple(labels)] = 0.0

    def _check(self, labels: tuple[str, ...]) -> None:
        if len(labels) != len(self.labelnames):
            raise ValueError(f"{self.name} takes labels {self.labelnames}, got {labels}")

    def inc(self, *labels: str, amount: float = 1.0) -> None:
        self._check(labels)
        if amount < 0:
            raise ValueError(f"{self.name}: counters only go up")
        self._values[labels] = self._values.get(labels, 0.0) + amount

    def value(self, *labels: str) -> float:
        return self._values.get(labels, 0.0)

    def collect(self) -> Iterator[Metric]:
        plain = UnknownMetricFamily(self.name, self.doc, labels=self.labelnames)
        total = CounterMetricFamily(self.name, self.doc, labels=self.labelnames)
        for labels, value in sorted(self._values.items()):
            plain.add_metric(list(labels), value)
            total.add_metric(list(labels), value)
        yield plain
        yield total


class WindowedSummary(Collector):
    """A summary as TGIS's exporter renders it: quantiles over a sliding time window."""

    def __init__(
        self,
        name: str,
        doc: str,
        *,
        window_s: float = SUMMARY_WINDOW_S,
        max_samples: int = 4096,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.name = name
        self.doc = doc
        self.window_s = window_s
        self._clock = clock
        self._recent: deque[tuple[float, float]] = deque(maxlen=max_samples)
        self.count = 0
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self._recent.append((self._clock(), float(value)))
        self.count += 1
        self.sum += value

    def quantiles(self) -> dict[float, float]:
        cutoff = self._clock() - self.window_s
        while self._recent and self._recent[0][0] < cutoff:
            self._recent.popleft()
        values = sorted(v for _, v in self._recent)
        if not values:
            return dict.fromkeys(SUMMARY_QUANTILES, math.nan)
        # Nearest rank: the smallest value with at least q of the observations at or below it.
        n = len(values)
        return {q: values[max(math.ceil(q * n) - 1, 0)] for q in SUMMARY_QUANTILES}

    def collect(self) -> Iterator[Metric]:
        family = Metric(self.name, self.doc, "summary")
        for q, value in self.quantiles().items():
            family.add_sample(self.name, {"quantile": format(q, "g")}, value)
        family.add_sample(self.name + "_sum", {}, self.sum)
        family.add_sample(self.name + "_count", {}, float(self.count))
        yield family
