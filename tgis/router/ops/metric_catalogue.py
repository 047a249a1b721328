"""The catalogue of router metrics: every metric's name, kind, labels, buckets and help text,
once, in exposition order (TGIS's, spec §8.2, plus the extras vLLM/TGI operators expect).

The Gateway API Inference Extension's model-server protocol (its proposal 003) is served
by five of them, which its endpoint picker's metric flags name: ``tgi_queue_size``
(queued), ``tgi_batch_current_size`` (running), ``tgi_kv_cache_usage_ratio`` (KV-cache
utilisation, 0..1), ``tgi_cache_config_info`` and ``tgi_lora_requests_info``
(``deployment/gateway/``).

``metrics.py: Metrics`` registers them and records into them; README.md ("HTTP endpoints
and metrics") lists what each means.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

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
GUIDED_KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")


class Buckets(enum.Enum):
    """A histogram's bucket set (TGIS's, spec §8.1; ``prometheus.py``)."""

    DURATION = "geometric seconds: 0.0001 * 1.5**k, 35 buckets"
    NEW_TOKENS = "64 equal steps up to the server's max_new_tokens"
    SEQUENCE_LENGTH = "64 equal steps up to max_sequence_length"
    BATCH_SIZE = "1 .. max_batch_size"
    TOKENIZE = "powers of two, 64 .. 2**19 tokens"


@dataclass(frozen=True, slots=True)
class Counter:
    """A counter, rendered under two names (``prometheus.py: DualCounter``); ``initial``
    lists the label values whose series exist from the start."""

    key: str
    name: str
    doc: str
    labels: tuple[str, ...] = ()
    initial: tuple[tuple[str, ...], ...] = ()


@dataclass(frozen=True, slots=True)
class Gauge:
    """A gauge; one with ``labels`` is an info gauge whose labels carry the facts (one
    series at a time, ``metrics.py``)."""

    key: str
    name: str
    doc: str
    labels: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Histogram:
    key: str
    name: str
    doc: str
    buckets: Buckets
    labels: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Summary:
    """Quantiles over the last minute (``prometheus.py: WindowedSummary``)."""

    key: str
    name: str
    doc: str


CATALOGUE: tuple[Counter | Gauge | Histogram | Summary, ...] = (
    Counter(
        "request_count",
        "tgi_request_count",
        "Generate/GenerateStream calls, counted on arrival before any check",
        labels=("kind",),
        initial=tuple((k,) for k in KINDS),
    ),
    Counter("request_input_count", "tgi_request_input_count", "Inputs received"),
    Counter(
        "request_failure",
        "tgi_request_failure",
        "Failed requests by cause",
        labels=("err",),
        initial=tuple((e,) for e in FAILURE_ERRS),
    ),
    Counter(
        "request_success",
        "tgi_request_success",
        "Inputs that completed, by stop reason and call kind",
        labels=("stop_reason", "kind"),
        initial=tuple((r, k) for r in SUCCESS_STOP_REASONS for k in KINDS),
    ),
    Counter(
        "batch_concatenation",
        "tgi_batch_concatenation_count",
        "Steps that admitted new requests into a non-empty running batch",
    ),
    Counter(
        "inference_count",
        "tgi_batch_inference_count",
        "Shard steps started",
        labels=("method",),
        initial=tuple((m,) for m in METHODS),
    ),
    Counter(
        "inference_ok",
        "tgi_batch_inference_success",
        "Shard steps that succeeded",
        labels=("method",),
        initial=tuple((m,) for m in METHODS),
    ),
    Counter(
        "inference_failed",
        "tgi_batch_inference_failure",
        "Shard steps that failed, by reason",
        labels=("method", "reason"),
        initial=tuple((m, r) for m in METHODS for r in FAILURE_REASONS),
    ),
    Counter(
        "queue_jump",
        "tgi_queue_jump",
        "Requests admitted ahead of an earlier queued request that did not fit",
    ),
    Counter(
        "granular_batch_addition",
        "tgi_granular_batch_addition",
        "Requests that fit only thanks to a finer-grained memory check",
    ),
    Counter(
        "prefill_weight_limit_exceeded",
        "tgi_prefill_weight_limit_exceeded",
        "Queued requests held back by the per-step prefill budget",
    ),
    Counter(
        "prefill_padding_limit_exceeded",
        "tgi_prefill_padding_limit_exceeded",
        "Queued requests held back by the padding limit (always 0: no padding)",
    ),
    Counter("prompt_load_failure", "tgi_prompt_load_failure", "Prompt-prefix lookups that failed"),
    Counter(
        "guided_request",
        "tgi_guided_request",
        "Generate/GenerateStream calls with a guided-decoding constraint, by kind",
        labels=("kind",),
        initial=tuple((k,) for k in GUIDED_KINDS),
    ),
    Counter(
        "guided_compile_failure",
        "tgi_guided_compile_failure",
        "Guided-decoding constraints refused by the compiler (or past its time limit), by kind",
        labels=("kind",),
        initial=tuple((k,) for k in GUIDED_KINDS),
    ),
    Counter("tokenize_count", "tgi_tokenize_request_count", "Tokenize calls"),
    Counter("tokenize_inputs", "tgi_tokenize_request_input_count", "Texts tokenized"),
    Counter(
        "prompt_tokens",
        "tgi_prompt_tokens",
        "Prompt tokens computed by successful steps (prefill throughput)",
    ),
    Counter(
        "generated_tokens",
        "tgi_generated_tokens",
        "Tokens sampled by successful steps (generation throughput)",
    ),
    Counter(
        "preemption",
        "tgi_request_preemption_count",
        "Running requests preempted to free KV-cache blocks",
    ),
    Counter(
        "prefix_cache_queries",
        "tgi_prefix_cache_queries",
        "Known tokens of admitted requests looked up in the prefix cache",
    ),
    Counter(
        "prefix_cache_hits",
        "tgi_prefix_cache_hits",
        "Of those, tokens found cached (their KV reused, not computed)",
    ),
    Counter(
        "spec_steps",
        "tgi_spec_steps",
        "Steps in which decoding sequences verified drafted tokens (speculative decoding)",
    ),
    Counter(
        "spec_draft_tokens",
        "tgi_spec_draft_tokens",
        "Tokens drafted by prompt lookup and verified (acceptance rate = accepted / drafted)",
    ),
    Counter(
        "spec_accepted_tokens",
        "tgi_spec_accepted_tokens",
        "Drafted tokens the model confirmed (each saves a step)",
    ),
    Gauge("batch_size", "tgi_batch_current_size", "Requests in the running batch"),
    Gauge(
        "batch_input_tokens",
        "tgi_batch_input_tokens",
        "Tokens (prompt + generated so far) of the running batch",
    ),
    Gauge(
        "batch_max_remaining_tokens",
        "tgi_batch_max_remaining_tokens",
        "Tokens the running batch may still generate (sum of max_new_tokens - generated)",
    ),
    Gauge("queue_size", "tgi_queue_size", "Requests waiting in the queue"),
    Gauge(
        "kv_cache_usage",
        "tgi_kv_cache_usage_ratio",
        "Fraction of the KV-cache blocks in use (0..1)",
    ),
    Gauge("kv_cache_used_blocks", "tgi_kv_cache_used_blocks", "KV-cache blocks in use"),
    Gauge("kv_cache_total_blocks", "tgi_kv_cache_total_blocks", "KV-cache blocks the shard has"),
    Gauge(
        "cache_config_info",
        "tgi_cache_config_info",
        "KV-cache configuration in labels (value 1): block_size, tokens per block; "
        "num_gpu_blocks, blocks of the pool the router schedules",
        labels=("block_size", "num_gpu_blocks"),
    ),
    Gauge(
        "lora_requests_info",
        "tgi_lora_requests_info",
        "LoRA adapters in labels, value the Unix time of the last update: max_lora, most "
        "adapters in a step; running_lora_adapters and waiting_lora_adapters, the adapters of "
        "the running and the waiting requests (comma-separated)",
        labels=("max_lora", "running_lora_adapters", "waiting_lora_adapters"),
    ),
    Gauge(
        "prefix_cache_blocks",
        "tgi_prefix_cache_blocks",
        "KV-cache blocks holding a cached prompt prefix (in use or idle)",
    ),
    Gauge(
        "prefix_cache_idle_blocks",
        "tgi_prefix_cache_idle_blocks",
        "Cached blocks no request holds (free: evicted, oldest first, when blocks run out)",
    ),
    Summary(
        "raw_input_length",
        "tgi_request_raw_input_length",
        "Input tokens before truncation, every tokenized input",
    ),
    Histogram(
        "input_length",
        "tgi_request_input_length",
        "Input tokens after truncation, per validated input",
        Buckets.SEQUENCE_LENGTH,
    ),
    Histogram(
        "max_new_tokens",
        "tgi_request_max_new_tokens",
        "Requested max_new_tokens, per validated input",
        Buckets.NEW_TOKENS,
    ),
    Histogram(
        "validation_duration",
        "tgi_request_validation_duration",
        "Seconds from RPC arrival to the end of validation",
        Buckets.DURATION,
    ),
    Histogram(
        "queue_duration",
        "tgi_request_queue_duration",
        "Seconds from RPC arrival to admission into the running batch",
        Buckets.DURATION,
    ),
    Histogram(
        "inference_duration",
        "tgi_request_inference_duration",
        "Seconds from admission to the final token, per completed input",
        Buckets.DURATION,
    ),
    Histogram(
        "mean_time_per_token",
        "tgi_request_mean_time_per_token_duration",
        "Inference seconds per generated token, per completed input",
        Buckets.DURATION,
    ),
    Histogram(
        "request_duration",
        "tgi_request_duration",
        "End-to-end seconds per completed input",
        Buckets.DURATION,
    ),
    Histogram(
        "generated_tokens",
        "tgi_request_generated_tokens",
        "Generated tokens per completed input",
        Buckets.NEW_TOKENS,
    ),
    Histogram(
        "total_tokens",
        "tgi_request_total_tokens",
        "Input plus generated tokens per completed input",
        Buckets.SEQUENCE_LENGTH,
    ),
    Summary("next_tokens", "tgi_batch_next_tokens", "Prompt tokens computed per prefill step"),
    Histogram(
        "batch_size_hist",
        "tgi_batch_inference_batch_size",
        "Requests per shard step",
        Buckets.BATCH_SIZE,
        labels=("method",),
    ),
    Histogram(
        "step_duration",
        "tgi_batch_inference_duration",
        "Wall seconds of each successful shard step",
        Buckets.DURATION,
        labels=("method", "makeup"),
    ),
    Histogram(
        "forward_duration",
        "tgi_batch_inference_forward_duration",
        "Shard-reported forward seconds of each successful step",
        Buckets.DURATION,
        labels=("method", "makeup"),
    ),
    Histogram(
        "tokproc_duration",
        "tgi_batch_inference_tokproc_duration",
        "Router seconds spent processing a step's output tokens",
        Buckets.DURATION,
        labels=("method", "makeup"),
    ),
    Histogram(
        "prompt_load_duration",
        "tgi_prompt_load_duration",
        "Seconds per successful prompt-prefix lookup",
        Buckets.DURATION,
    ),
    Histogram(
        "guided_compile_duration",
        "tgi_guided_compile_duration",
        "Seconds per successful guided-decoding compilation (cache misses only)",
        Buckets.DURATION,
    ),
    Histogram(
        "tokenize_tokens",
        "tgi_tokenize_request_tokens",
        "Tokens returned per Tokenize call",
        Buckets.TOKENIZE,
    ),
    Histogram(
        "tokenize_duration",
        "tgi_tokenize_request_duration",
        "Seconds per Tokenize call",
        Buckets.DURATION,
    ),
    Histogram(
        "time_to_first_token",
        "tgi_request_time_to_first_token_duration",
        "Seconds from RPC arrival to the first generated token",
        Buckets.DURATION,
    ),
    Histogram(
        "inter_token",
        "tgi_request_inter_token_duration",
        "Seconds between consecutive generated tokens of a request (inter-token latency)",
        Buckets.DURATION,
    ),
)
