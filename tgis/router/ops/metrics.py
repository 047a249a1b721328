"""The tgi_* Prometheus metrics: every metric defined once (name, kind, labels, buckets).

The catalogue is TGIS's (spec §8.2) plus a few extras vLLM/TGI operators expect (KV-cache
usage, time to first token, inter-token latency, token throughput, preemptions). README.md
("HTTP endpoints and metrics") lists every metric with its meaning.

Exposition (``GET /metrics``, Prometheus text format 0.0.4):

* **Counters under both names.** TGIS increments every counter twice, as ``name`` and
  ``name_total``; the OpenShift AI dashboards query the plain names
  (``increase(tgi_request_success[...])``). Here each counter is one ``DualCounter`` rendered
  as two families with the same samples: ``name`` typed ``untyped`` and ``name_total`` typed
  ``counter``. TGIS types both ``counter``, which ``promtool check metrics`` rejects
  ("counter metrics should have "_total" suffix"); ``untyped`` keeps the plain name
  queryable and PromQL's ``rate``/``increase`` work on it just the same.
* **Known label values start at 0** (every ``err``, ``stop_reason`` x ``kind``, ``method``,
  ...), so series exist before their first event and ``increase()`` sees the first one.
* **Histograms** use TGIS's bucket sets (§8.1): names ending in ``duration`` get 35
  geometric buckets ``0.0001 * 1.5**k``; token counts get 64 equal steps up to their
  limit; the batch size gets 1..max_batch_size. No ``_created`` series (TGIS has none).
* **Summaries.** TGIS's exporter turns histograms without buckets into summaries with
  quantiles 0, 0.5, 0.9, 0.95, 0.99, 0.999 and 1. Two metrics keep that form:
  ``tgi_request_raw_input_length`` (raw prompts are unbounded: truncation may cut them to
  any size, so no fixed bucket set fits) and ``tgi_batch_next_tokens``. Their quantiles
  cover the last 60 seconds of observations (NaN when there were none); ``_sum`` and
  ``_count`` are cumulative.

Who records what: the servicer (generation_service.py) every request-level metric (the
prompt-prefix cache, prefixes.py, the two ``tgi_prompt_load_*`` ones on its misses), the
engine/scheduler every step-, queue-, batch- and KV-level one (the methods under
"engine and scheduler" below). A continuous-batching step is labelled
``method="prefill"`` when it computes any prompt tokens (new sequences or prefill chunks,
possibly with decodes riding along) and ``method="next_token"`` when it only decodes; see
``step_method``. ``makeup`` is always ``single_only`` (TGIS's only value: no beam search).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence

from prometheus_client import (
    CollectorRegistry,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, Metric, UnknownMetricFamily
from prometheus_client.registry import Collector

DURATION_BUCKETS = tuple(0.0001 * 1.5**k for k in range(1, 36))
TOKENIZE_BUCKETS = tuple(float(2**k) for k in range(6, 20))
SUMMARY_QUANTILES = (0.0, 0.5, 0.9, 0.95, 0.99, 0.999, 1.0)
SUMMARY_WINDOW_S = 60.0

KINDS = ("single", "batch", "stream")
FAILURE_ERRS = (
    "conc_limit",
    "queue_full",
    "validation",
    "generate",
    "cancelled",
    "timeout",
    "unknown",
)
SUCCESS_STOP_REASONS = ("MAX_TOKENS", "EOS_TOKEN", "TIME_LIMIT", "STOP_SEQUENCE", "TOKEN_LIMIT")
METHODS = ("prefill", "next_token")
FAILURE_REASONS = ("oom", "connection", "error")
MAKEUP = "single_only"


def step_method(prompt_tokens: int) -> str:
    """The ``method`` label of one step: ``prefill`` if it computes any prompt token."""
    return "prefill" if prompt_tokens > 0 else "next_token"


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


class Metrics:
    """Every router metric, registered in one registry (rendered by GET /metrics)."""

    def __init__(self, *, max_sequence_length: int, max_new_tokens: int, max_batch_size: int):
        disable_created_metrics()  # process-wide: TGIS exports no *_created series
        self.registry = CollectorRegistry(auto_describe=True)
        reg = self.registry
        self._counters: dict[str, DualCounter] = {}

        def counter(
            key: str,
            name: str,
            doc: str,
            labels: Sequence[str] = (),
            initial: Iterable[Sequence[str]] = (),
        ) -> DualCounter:
            c = DualCounter(name, doc, labels, initial)
            reg.register(c)
            self._counters[key] = c
            return c

        def histogram(
            name: str, doc: str, buckets: Sequence[float], labels: Sequence[str] = ()
        ) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=reg)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, registry=reg)

        def summary(name: str, doc: str) -> WindowedSummary:
            s = WindowedSummary(name, doc)
            reg.register(s)
            return s

        methods = [(m,) for m in METHODS]
        token_steps = equal_steps(max_new_tokens)
        sequence_steps = equal_steps(max_sequence_length)

        # ---- TGIS counters (§8.2) -----------------------------------------------------------
        counter(
            "request_count",
            "tgi_request_count",
            "Generate/GenerateStream calls, counted on arrival before any check",
            ("kind",),
            [(k,) for k in KINDS],
        )
        counter("request_input_count", "tgi_request_input_count", "Inputs received")
        counter(
            "request_failure",
            "tgi_request_failure",
            "Failed requests by cause",
            ("err",),
            [(e,) for e in FAILURE_ERRS],
        )
        counter(
            "request_success",
            "tgi_request_success",
            "Inputs that completed, by stop reason and call kind",
            ("stop_reason", "kind"),
            [(r, k) for r in SUCCESS_STOP_REASONS for k in KINDS],
        )
        counter(
            "batch_concatenation",
            "tgi_batch_concatenation_count",
            "Steps that admitted new requests into a non-empty running batch",
        )
        counter(
            "inference_count",
            "tgi_batch_inference_count",
            "Shard steps started",
            ("method",),
            methods,
        )
        counter(
            "inference_ok",
            "tgi_batch_inference_success",
            "Shard steps that succeeded",
            ("method",),
            methods,
        )
        counter(
            "inference_failed",
            "tgi_batch_inference_failure",
            "Shard steps that failed, by reason",
            ("method", "reason"),
            [(m, r) for m in METHODS for r in FAILURE_REASONS],
        )
        counter(
            "queue_jump",
            "tgi_queue_jump",
            "Requests admitted ahead of an earlier queued request that did not fit",
        )
        counter(
            "granular_batch_addition",
            "tgi_granular_batch_addition",
            "Requests that fit only thanks to a finer-grained memory check",
        )
        counter(
            "prefill_weight_limit_exceeded",
            "tgi_prefill_weight_limit_exceeded",
            "Queued requests held back by the per-step prefill budget",
        )
        counter(
            "prefill_padding_limit_exceeded",
            "tgi_prefill_padding_limit_exceeded",
            "Queued requests held back by the padding limit (always 0: no padding)",
        )
        counter(
            "prompt_load_failure",
            "tgi_prompt_load_failure",
            "Prompt-prefix lookups that failed",
        )
        counter("tokenize_count", "tgi_tokenize_request_count", "Tokenize calls")
        counter("tokenize_inputs", "tgi_tokenize_request_input_count", "Texts tokenized")
        # ---- extras --------------------------------------------------------------------------
        counter(
            "prompt_tokens",
            "tgi_prompt_tokens",
            "Prompt tokens computed by successful steps (prefill throughput)",
        )
        counter(
            "generated_tokens",
            "tgi_generated_tokens",
            "Tokens sampled by successful steps (generation throughput)",
        )
        counter(
            "preemption",
            "tgi_request_preemption_count",
            "Running requests preempted to free KV-cache blocks",
        )

        # ---- TGIS gauges ----------------------------------------------------------------------
        self.batch_size = gauge("tgi_batch_current_size", "Requests in the running batch")
        self.batch_input_tokens = gauge(
            "tgi_batch_input_tokens",
            "Tokens (prompt + generated so far) of the running batch",
        )
        self.batch_max_remaining_tokens = gauge(
            "tgi_batch_max_remaining_tokens",
            "Tokens the running batch may still generate (sum of max_new_tokens - generated)",
        )
        self.queue_size = gauge("tgi_queue_size", "Requests waiting in the queue")
        # ---- extra gauges: the KV cache -------------------------------------------------------
        self.kv_cache_usage = gauge(
            "tgi_kv_cache_usage_ratio", "Fraction of the KV-cache blocks in use (0..1)"
        )
        self.kv_cache_used_blocks = gauge("tgi_kv_cache_used_blocks", "KV-cache blocks in use")
        self.kv_cache_total_blocks = gauge(
            "tgi_kv_cache_total_blocks", "KV-cache blocks the shard has"
        )

        # ---- TGIS histograms and summaries ----------------------------------------------------
        self.raw_input_length = summary(
            "tgi_request_raw_input_length",
            "Input tokens before truncation, every tokenized input",
        )
        self.input_length = histogram(
            "tgi_request_input_length",
            "Input tokens after truncation, per validated input",
            sequence_steps,
        )
        self.max_new_tokens = histogram(
            "tgi_request_max_new_tokens",
            "Requested max_new_tokens, per validated input",
            token_steps,
        )
        self.validation_duration = histogram(
            "tgi_request_validation_duration",
            "Seconds from RPC arrival to the end of validation",
            DURATION_BUCKETS,
        )
        self.queue_duration = histogram(
            "tgi_request_queue_duration",
            "Seconds from RPC arrival to admission into the running batch",
            DURATION_BUCKETS,
        )
        self.inference_duration = histogram(
            "tgi_request_inference_duration",
            "Seconds from admission to the final token, per completed input",
            DURATION_BUCKETS,
        )
        self.mean_time_per_token = histogram(
            "tgi_request_mean_time_per_token_duration",
            "Inference seconds per generated token, per completed input",
            DURATION_BUCKETS,
        )
        self.request_duration = histogram(
            "tgi_request_duration",
            "End-to-end seconds per completed input",
            DURATION_BUCKETS,
        )
        self.generated_tokens = histogram(
            "tgi_request_generated_tokens",
            "Generated tokens per completed input",
            token_steps,
        )
        self.total_tokens = histogram(
            "tgi_request_total_tokens",
            "Input plus generated tokens per completed input",
            sequence_steps,
        )
        self.next_tokens = summary(
            "tgi_batch_next_tokens", "Prompt tokens computed per prefill step"
        )
        self.batch_size_hist = histogram(
            "tgi_batch_inference_batch_size",
            "Requests per shard step",
            tuple(float(b) for b in range(1, max(max_batch_size, 1) + 1)),
            ("method",),
        )
        self.step_duration = histogram(
            "tgi_batch_inference_duration",
            "Wall seconds of each successful shard step",
            DURATION_BUCKETS,
            ("method", "makeup"),
        )
        self.forward_duration = histogram(
            "tgi_batch_inference_forward_duration",
            "Shard-reported forward seconds of each successful step",
            DURATION_BUCKETS,
            ("method", "makeup"),
        )
        self.tokproc_duration = histogram(
            "tgi_batch_inference_tokproc_duration",
            "Router seconds spent processing a step's output tokens",
            DURATION_BUCKETS,
            ("method", "makeup"),
        )
        self.prompt_load_duration = histogram(
            "tgi_prompt_load_duration",
            "Seconds per successful prompt-prefix lookup",
            DURATION_BUCKETS,
        )
        self.tokenize_tokens = histogram(
            "tgi_tokenize_request_tokens",
            "Tokens returned per Tokenize call",
            TOKENIZE_BUCKETS,
        )
        self.tokenize_duration = histogram(
            "tgi_tokenize_request_duration",
            "Seconds per Tokenize call",
            DURATION_BUCKETS,
        )
        # ---- extra histograms: per-token latency ----------------------------------------------
        self.time_to_first_token = histogram(
            "tgi_request_time_to_first_token_duration",
            "Seconds from RPC arrival to the first generated token",
            DURATION_BUCKETS,
        )
        self.inter_token = histogram(
            "tgi_request_inter_token_duration",
            "Seconds between consecutive generated tokens of a request (inter-token latency)",
            DURATION_BUCKETS,
        )
        for method in METHODS:
            self.batch_size_hist.labels(method)
            for h in (self.step_duration, self.forward_duration, self.tokproc_duration):
                h.labels(method, MAKEUP)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def counter(self, key: str) -> DualCounter:
        return self._counters[key]

    # ---- servicer: generation_service.py --------------------------------------------------------

    def request_received(self, kind: str, inputs: int) -> None:
        """A Generate (kind single/batch) or GenerateStream (stream) call, before any check."""
        self._counters["request_count"].inc(kind)
        if inputs > 0:
            self._counters["request_input_count"].inc(amount=inputs)

    def request_failure(self, err: str) -> None:
        """``tgi_request_failure{err}``; err is one of FAILURE_ERRS."""
        self._counters["request_failure"].inc(err)

    def input_tokenized(self, raw_length: int) -> None:
        """An input's token count before truncation (also for inputs later rejected)."""
        self.raw_input_length.observe(raw_length)

    def input_validated(self, input_length: int, max_new_tokens: int) -> None:
        """Per input that passed validation: truncated length, requested max_new_tokens."""
        self.input_length.observe(input_length)
        self.max_new_tokens.observe(max_new_tokens)

    def validation_done(self, seconds: float) -> None:
        """Once per RPC whose validation succeeded: seconds since the RPC arrived."""
        self.validation_duration.observe(seconds)

    def prompt_load_failed(self) -> None:
        """A prompt-prefix lookup on the shard failed (cache misses only)."""
        self._counters["prompt_load_failure"].inc()

    def prompt_loaded(self, seconds: float) -> None:
        """A prompt-prefix lookup on the shard succeeded in ``seconds`` (cache misses only)."""
        self.prompt_load_duration.observe(seconds)

    def request_succeeded(
        self,
        *,
        stop_reason: str,
        kind: str,
        input_length: int,
        generated_tokens: int,
        duration: float,
        inference_seconds: float,
    ) -> None:
        """One input completed (any stop reason but CANCELLED/ERROR)."""
        self._counters["request_success"].inc(stop_reason, kind)
        self.request_duration.observe(duration)
        self.generated_tokens.observe(generated_tokens)
        self.total_tokens.observe(input_length + generated_tokens)
        self.inference_duration.observe(inference_seconds)
        self.mean_time_per_token.observe(
            inference_seconds / generated_tokens if generated_tokens else 0.0
        )

    def tokenize_received(self, texts: int) -> None:
        self._counters["tokenize_count"].inc()
        self._counters["tokenize_inputs"].inc(amount=texts)

    def tokenize_done(self, tokens: int, seconds: float) -> None:
        self.tokenize_tokens.observe(tokens)
        self.tokenize_duration.observe(seconds)

    # ---- engine and scheduler -----------------------------------------------------------------

    def request_admitted(self, queue_seconds: float) -> None:
        """A queued request joined the running batch, ``queue_seconds`` after its RPC arrived."""
        self.queue_duration.observe(queue_seconds)

    def request_cancelled(self) -> None:
        """The engine dropped a queued or running request whose client went away (once each)."""
        self.request_failure("cancelled")

    def request_timed_out(self) -> None:
        """A queued request's deadline passed before it was admitted."""
        self.request_failure("timeout")

    def request_preempted(self) -> None:
        self._counters["preemption"].inc()

    def first_token(self, seconds: float) -> None:
        """A request's first generated token, ``seconds`` after its RPC arrived."""
        self.time_to_first_token.observe(seconds)

    def next_token(self, seconds: float) -> None:
        """A request's later token, ``seconds`` after its previous one."""
        self.inter_token.observe(seconds)

    def set_queue_size(self, size: int) -> None:
        self.queue_size.set(size)

    def set_batch(self, size: int, input_tokens: int, max_remaining_tokens: int) -> None:
        """The running batch before a step (all 0 when it empties)."""
        self.batch_size.set(size)
        self.batch_input_tokens.set(input_tokens)
        self.batch_max_remaining_tokens.set(max_remaining_tokens)

    def set_kv_cache(self, used_blocks: int, total_blocks: int) -> None:
        self.kv_cache_used_blocks.set(used_blocks)
        self.kv_cache_total_blocks.set(total_blocks)
        self.kv_cache_usage.set(used_blocks / total_blocks if total_blocks else 0.0)

    def batch_concatenated(self) -> None:
        self._counters["batch_concatenation"].inc()

    def prefill_budget_exceeded(self) -> None:
        """A queued request could not be admitted because the step's token budget ran out."""
        self._counters["prefill_weight_limit_exceeded"].inc()

    def step_started(self, method: str, batch_size: int, prompt_tokens: int) -> None:
        """Before the shard call (TGIS order): count, batch size and prefill tokens."""
        self._counters["inference_count"].inc(method)
        self.batch_size_hist.labels(method).observe(batch_size)
        if method == "prefill":
            self.next_tokens.observe(prompt_tokens)

    def step_succeeded(
        self,
        method: str,
        seconds: float,
        forward_seconds: float,
        *,
        prompt_tokens: int = 0,
        generated_tokens: int = 0,
    ) -> None:
        """After a successful shard call: wall and forward time, tokens computed/sampled."""
        self._counters["inference_ok"].inc(method)
        self.step_duration.labels(method, MAKEUP).observe(seconds)
        self.forward_duration.labels(method, MAKEUP).observe(forward_seconds)
        if prompt_tokens:
            self._counters["prompt_tokens"].inc(amount=prompt_tokens)
        if generated_tokens:
            self._counters["generated_tokens"].inc(amount=generated_tokens)

    def step_processed(self, method: str, seconds: float) -> None:
        """The router finished processing a successful step's output (tokproc time)."""
        self.tokproc_duration.labels(method, MAKEUP).observe(seconds)

    def step_failed(self, method: str, reason: str) -> None:
        """A failed shard call; reason is oom, connection or error."""
        self._counters["inference_failed"].inc(method, reason)
