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

* **Info gauges** (``tgi_cache_config_info``, ``tgi_lora_requests_info``) carry their facts
  in labels and keep one series: a change of labels removes the old series, so the endpoint
  picker of the inference gateway, which reads the series with the greatest value of the
  LoRA gauge, and a dashboard see only the current state. The LoRA gauge's value is the
  Unix time of its last update (the protocol's "last updated timestamp"); it is updated
  with the other engine gauges, before every step, and exists from the start (``max_lora``
  0 when the server takes no LoRA adapter).

The catalogue (every name, label set, bucket set and help text) is ``metric_catalogue.py``;
the collectors are ``prometheus.py``; this module registers them and is what the rest of
the router records through. Who records what: the edge and intake every request-level
metric (admission, replies, and the prompt-prefix cache, ``intake/prefixes.py``, the two
``tgi_prompt_load_*`` ones on its misses), the engine every step-, queue-, batch- and
KV-level one (the methods under "engine and scheduler" below). A continuous-batching
step is labelled ``method="prefill"`` when it computes any prompt tokens (new sequences or
prefill chunks, possibly with decodes riding along) and ``method="next_token"`` when it
only decodes; see ``step_method``. ``makeup`` is always ``single_only`` (TGIS's only
value: no beam search).
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import prometheus_client
from prometheus_client import CollectorRegistry, disable_created_metrics, generate_latest

from tgis.router.ops.metric_catalogue import (
    CATALOGUE,
    METHODS,
    Buckets,
    Counter,
    Gauge,
    Histogram,
    Summary,
)
from tgis.router.ops.prometheus import (
    DURATION_BUCKETS,
    TOKENIZE_BUCKETS,
    DualCounter,
    WindowedSummary,
    equal_steps,
)

__all__ = ["MAKEUP", "Metrics", "step_method"]

MAKEUP = "single_only"


def step_method(prompt_tokens: int) -> str:
    """The ``method`` label of one step: ``prefill`` if it computes any prompt token."""
    return "prefill" if prompt_tokens > 0 else "next_token"


class Metrics:
    """Every router metric, registered in one registry (rendered by GET /metrics)."""

    def __init__(self, *, max_sequence_length: int, max_new_tokens: int, max_batch_size: int):
        disable_created_metrics()  # process-wide: TGIS exports no *_created series
        self.registry = CollectorRegistry(auto_describe=True)
        buckets = {
            Buckets.DURATION: DURATION_BUCKETS,
            Buckets.NEW_TOKENS: equal_steps(max_new_tokens),
            Buckets.SEQUENCE_LENGTH: equal_steps(max_sequence_length),
            Buckets.BATCH_SIZE: tuple(float(b) for b in range(1, max(max_batch_size, 1) + 1)),
            Buckets.TOKENIZE: TOKENIZE_BUCKETS,
        }
        self._counters: dict[str, DualCounter] = {}
        self._gauges: dict[str, prometheus_client.Gauge] = {}
        self._histograms: dict[str, prometheus_client.Histogram] = {}
        self._summaries: dict[str, WindowedSummary] = {}
        self._info_labels: dict[str, tuple[str, ...]] = {}
        """The labels of each info gauge's one series."""
        for spec in CATALOGUE:
            self._register(spec, buckets)
        self.set_lora_requests(0, (), ())  # until the engine knows the shard's max_loras
        for method in METHODS:
            self._histograms["batch_size_hist"].labels(method)
            for key in ("step_duration", "forward_duration", "tokproc_duration"):
                self._histograms[key].labels(method, MAKEUP)

    def _register(
        self,
        spec: Counter | Gauge | Histogram | Summary,
        buckets: dict[Buckets, tuple[float, ...]],
    ) -> None:
        reg = self.registry
        if isinstance(spec, Counter):
            counter = DualCounter(spec.name, spec.doc, spec.labels, spec.initial)
            reg.register(counter)
            self._counters[spec.key] = counter
        elif isinstance(spec, Gauge):
            self._gauges[spec.key] = prometheus_client.Gauge(
                spec.name, spec.doc, spec.labels, registry=reg
            )
        elif isinstance(spec, Histogram):
            self._histograms[spec.key] = prometheus_client.Histogram(
                spec.name, spec.doc, spec.labels, buckets=buckets[spec.buckets], registry=reg
            )
        else:
            summary = WindowedSummary(spec.name, spec.doc)
            reg.register(summary)
            self._summaries[spec.key] = summary

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def counter(self, key: str) -> DualCounter:
        return self._counters[key]

    # ---- edge and intake -----------------------------------------------------------------------

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
        self._summaries["raw_input_length"].observe(raw_length)

    def input_validated(self, input_length: int, max_new_tokens: int) -> None:
        """Per input that passed validation: truncated length, requested max_new_tokens."""
        self._histograms["input_length"].observe(input_length)
        self._histograms["max_new_tokens"].observe(max_new_tokens)

    def validation_done(self, seconds: float) -> None:
        """Once per RPC whose validation succeeded: seconds since the RPC arrived."""
        self._histograms["validation_duration"].observe(seconds)

    def prompt_load_failed(self) -> None:
        """A prompt-prefix lookup on the shard failed (cache misses only)."""
        self._counters["prompt_load_failure"].inc()

    def prompt_loaded(self, seconds: float) -> None:
        """A prompt-prefix lookup on the shard succeeded in ``seconds`` (cache misses only)."""
        self._histograms["prompt_load_duration"].observe(seconds)

    def guided_request(self, kind: str) -> None:
        """A call with a guided-decoding constraint of ``kind`` (GUIDED_KINDS)."""
        self._counters["guided_request"].inc(kind)

    def guided_compile_failed(self, kind: str) -> None:
        """The compiler refused a ``kind`` constraint (or ran past its time limit)."""
        self._counters["guided_compile_failure"].inc(kind)

    def guided_compiled(self, seconds: float) -> None:
        """A constraint compiled in ``seconds`` (cache misses only)."""
        self._histograms["guided_compile_duration"].observe(seconds)

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
        self._histograms["request_duration"].observe(duration)
        self._histograms["generated_tokens"].observe(generated_tokens)
        self._histograms["total_tokens"].observe(input_length + generated_tokens)
        self._histograms["inference_duration"].observe(inference_seconds)
        self._histograms["mean_time_per_token"].observe(
            inference_seconds / generated_tokens if generated_tokens else 0.0
        )

    def tokenize_received(self, texts: int) -> None:
        self._counters["tokenize_count"].inc()
        self._counters["tokenize_inputs"].inc(amount=texts)

    def tokenize_done(self, tokens: int, seconds: float) -> None:
        self._histograms["tokenize_tokens"].observe(tokens)
        self._histograms["tokenize_duration"].observe(seconds)

    # ---- engine and scheduler -----------------------------------------------------------------

    def request_admitted(self, queue_seconds: float) -> None:
        """A queued request joined the running batch, ``queue_seconds`` after its RPC arrived."""
        self._histograms["queue_duration"].observe(queue_seconds)

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
        self._histograms["time_to_first_token"].observe(seconds)

    def next_token(self, seconds: float) -> None:
        """A request's later token, ``seconds`` after its previous one."""
        self._histograms["inter_token"].observe(seconds)

    def set_queue_size(self, size: int) -> None:
        self._gauges["queue_size"].set(size)

    def set_batch(self, size: int, input_tokens: int, max_remaining_tokens: int) -> None:
        """The running batch before a step (all 0 when it empties)."""
        self._gauges["batch_size"].set(size)
        self._gauges["batch_input_tokens"].set(input_tokens)
        self._gauges["batch_max_remaining_tokens"].set(max_remaining_tokens)

    def set_kv_cache(self, used_blocks: int, total_blocks: int) -> None:
        self._gauges["kv_cache_used_blocks"].set(used_blocks)
        self._gauges["kv_cache_total_blocks"].set(total_blocks)
        self._gauges["kv_cache_usage"].set(used_blocks / total_blocks if total_blocks else 0.0)

    def set_cache_config(self, block_size: int, num_blocks: int) -> None:
        """``tgi_cache_config_info``: tokens per KV block and the blocks of the router's pool."""
        self._set_info("cache_config_info", (str(block_size), str(num_blocks)), 1.0)

    def set_lora_requests(
        self, max_lora: int, running: Iterable[str], waiting: Iterable[str]
    ) -> None:
        """``tgi_lora_requests_info``: the LoRA adapters of the running and of the waiting
        requests (each listed once, sorted, comma-separated without spaces: the endpoint
        picker splits on ","), stamped with the current Unix time."""
        labels = (str(max_lora), ",".join(sorted(set(running))), ",".join(sorted(set(waiting))))
        self._set_info("lora_requests_info", labels, time.time())

    def _set_info(self, key: str, labels: tuple[str, ...], value: float) -> None:
        """Set the info gauge's one series, removing the series of other labels."""
        gauge = self._gauges[key]
        current = self._info_labels.get(key)
        if current is not None and current != labels:
            gauge.remove(*current)
        self._info_labels[key] = labels
        gauge.labels(*labels).set(value)

    def set_prefix_cache(self, cached_blocks: int, idle_blocks: int) -> None:
        self._gauges["prefix_cache_blocks"].set(cached_blocks)
        self._gauges["prefix_cache_idle_blocks"].set(idle_blocks)

    def prefix_cache_looked_up(self, queried_tokens: int, hit_tokens: int) -> None:
        """Admitted requests looked up ``queried_tokens`` known tokens, ``hit_tokens`` of
        them cached."""
        if queried_tokens:
            self._counters["prefix_cache_queries"].inc(amount=queried_tokens)
        if hit_tokens:
            self._counters["prefix_cache_hits"].inc(amount=hit_tokens)

    def speculated(self, steps: int, drafted_tokens: int, accepted_tokens: int) -> None:
        """``steps`` steps verified ``drafted_tokens`` drafts, ``accepted_tokens`` of them
        confirmed."""
        self._counters["spec_steps"].inc(amount=steps)
        self._counters["spec_draft_tokens"].inc(amount=drafted_tokens)
        if accepted_tokens:
            self._counters["spec_accepted_tokens"].inc(amount=accepted_tokens)

    def batch_concatenated(self) -> None:
        self._counters["batch_concatenation"].inc()

    def prefill_budget_exceeded(self) -> None:
        """A queued request could not be admitted because the step's token budget ran out."""
        self._counters["prefill_weight_limit_exceeded"].inc()

    def step_started(self, method: str, batch_size: int, prompt_tokens: int) -> None:
        """Before the shard call (TGIS order): count, batch size and prefill tokens."""
        self._counters["inference_count"].inc(method)
        self._histograms["batch_size_hist"].labels(method).observe(batch_size)
        if method == "prefill":
            self._summaries["next_tokens"].observe(prompt_tokens)

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
        self._histograms["step_duration"].labels(method, MAKEUP).observe(seconds)
        self._histograms["forward_duration"].labels(method, MAKEUP).observe(forward_seconds)
        if prompt_tokens:
            self._counters["prompt_tokens"].inc(amount=prompt_tokens)
        if generated_tokens:
            self._counters["generated_tokens"].inc(amount=generated_tokens)

    def step_processed(self, method: str, seconds: float) -> None:
        """The router finished processing a successful step's output (tokproc time)."""
        self._histograms["tokproc_duration"].labels(method, MAKEUP).observe(seconds)

    def step_failed(self, method: str, reason: str) -> None:
        """A failed shard call; reason is oom, connection or error."""
        self._counters["inference_failed"].inc(method, reason)
