"""The router's configuration: one frozen dataclass built by the CLI, read everywhere else."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from tgis.settings.catalogue import default
from tgis.settings.declaration import Process
from tgis.settings.serving import (
    DEFAULT_OTLP_SERVICE_NAME,
    DEFAULT_SHUTDOWN_GRACE_S,
    DEFAULT_STEP_TIMEOUT_S,
    DEFAULT_STREAM_STALL_TIMEOUT_S,
)
from tgis.shard_api.messages import DEFAULT_MAX_BATCH_SIZE

__all__ = [
    "DEFAULT_MAX_BATCH_PREFILL_TOKENS",
    "DEFAULT_OTLP_SERVICE_NAME",
    "DEFAULT_SHUTDOWN_GRACE_S",
    "DEFAULT_STEP_TIMEOUT_S",
    "DEFAULT_STREAM_STALL_TIMEOUT_S",
    "RouterConfig",
    "TlsConfig",
    "TracingConfig",
    "check_batching",
]

DEFAULT_MAX_BATCH_PREFILL_TOKENS = 4096
DEFAULT_MAX_BATCH_PREFILL_TOKENS_CPU = 512
"""On a CPU shard: a 4,096-token prefill step stalls every decode for a long time there
(BENCHMARKS.md: TTFT p50 at 32 streams 405 -> 226 ms for the same throughput)."""
DEFAULT_MAX_WAITING_TOKENS = 24
DEFAULT_WAITING_SERVED_RATIO = 1.2
"""TGIS's joining rule, applied when either of its flags is set."""


def _d(name: str) -> Any:
    return default(name, Process.ROUTER)


@dataclass(frozen=True, slots=True, kw_only=True)
class TlsConfig:
    """PEM files for the gRPC port; client_ca_path set means client certificates are required."""

    cert_path: str
    key_path: str
    client_ca_path: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class TracingConfig:
    """OpenTelemetry: spans exported with OTLP/gRPC to ``endpoint``."""

    endpoint: str
    service_name: str = DEFAULT_OTLP_SERVICE_NAME


@dataclass(frozen=True, slots=True, kw_only=True)
class RouterConfig:
    """Everything the router needs to start; see `text-generation-router --help`."""

    max_concurrent_requests: int = _d("max_concurrent_requests")
    """Inputs in flight (queued or running); more are refused with `Model is overloaded`."""
    max_sequence_length: int = _d("max_sequence_length")
    """Limit on input + output tokens of one request."""
    max_new_tokens: int = _d("max_new_tokens")
    """Server limit on max_new_tokens (lowered to max_sequence_length - 1 if not smaller)."""
    max_batch_size: int | None = _d("max_batch_size")
    """Most sequences in one forward pass; None: by capacity (the KV cache, at most
    DEFAULT_MAX_BATCH_SIZE)."""
    max_prefill_padding: float = _d("max_prefill_padding")
    """Accepted for compatibility; the paged engine never pads."""
    max_waiting_tokens: int | None = _d("max_waiting_tokens")
    """Steps after which queued requests join the running batch whatever their number. None
    with waiting_served_ratio None: no joining rule (join at the next step)."""
    waiting_served_ratio: float | None = _d("waiting_served_ratio")
    """Queued requests join a running batch of n at once when floor(n × ratio) of them can."""
    max_batch_prefill_tokens: int | None = _d("max_batch_prefill_tokens")
    """Prompt tokens computed per step (longer prompts are chunked); None: 4096, or
    max_batch_total_tokens if that is smaller."""
    max_batch_total_tokens: int | None = _d("max_batch_total_tokens")
    """KV tokens the running batch may hold; None: the shard's capacity."""
    max_client_batch_size: int | None = _d("max_client_batch_size")
    """Most inputs in one Generate call; None: no limit."""
    max_input_tokens: int | None = _d("max_input_tokens")
    """Longest input (after truncation); None: only max_sequence_length limits it."""
    max_stop_sequences: int = _d("max_stop_sequences")
    """Most stop sequences one request may give (TGIS: 6)."""
    max_top_n_tokens: int | None = _d("max_top_n_tokens")
    """Largest top_n_tokens a request may ask for; None: no limit (TGIS)."""
    max_best_of: int = _d("max_best_of")
    """TGI's limit on best_of (above 1 is refused whatever it says: one sequence a choice)."""
    hostname: str | None = _d("hostname")
    """The address both ports listen on; None: every interface, IPv4 and IPv6."""
    port: int = _d("port")
    grpc_port: int = _d("grpc_port")
    master_shard_uds_path: str = _d("master_shard_uds_path")
    tokenizer_path: str
    served_model_name: str = _d("served_model_name")
    """The served model's name: the id of the OpenAI routes' model, and in logs."""
    model_dir: str | None = _d("model_dir")
    """The model's directory: its chat_template.jinja and tokenizer_config.json."""
    chat_template: str | None = _d("chat_template")
    """The OpenAI chat route's template: a file, or the template itself (None: the model's)."""
    tool_call_parser: str | None = _d("tool_call_parser")
    """The model's tool-call format (hermes, llama3_json, granite); None: from the template."""
    api_key: str | None = _d("api_key")
    """A bearer token the /v1 routes and TGI's generation routes require (None: none)."""
    cors_allow_origin: tuple[str, ...] = _d("cors_allow_origin")
    """Origins whose browser pages may call the HTTP routes (CORS; "*": any; (): none)."""
    http_tls: bool = _d("http_tls")
    """Serve the HTTP port (health, metrics, /v1) over TLS with the gRPC port's cert and key."""
    tokenization_workers: int = 1
    json_output: bool = _d("json_output")
    tls: TlsConfig | None = None
    output_special_tokens: bool = _d("output_special_tokens")
    default_include_stop_seqs: bool = _d("default_include_stop_seqs")
    disable_prefix_caching: bool = _d("disable_prefix_caching")
    """Compute every prompt in full (the prefix cache is on by default where the shard's
    engine supports it)."""
    speculate: int = _d("speculate")
    """Speculative decoding: tokens drafted per sequence and step by prompt lookup (0: off)."""
    speculator_max_batch_size: int = _d("speculator_max_batch_size")
    """Speculation applies while at most this many sequences run (TGIS's variable)."""
    speculate_always: bool = _d("speculate_always")
    """Draft in every step it applies, whatever the acceptance (default: as it pays)."""
    prompt_lookup_min: int = _d("prompt_lookup_min")
    prompt_lookup_max: int = _d("prompt_lookup_max")
    """The shortest and longest suffix (in tokens) prompt lookup searches for."""
    shard_connect_timeout: float = _d("shard_connect_timeout")
    pipeline_depth: int = _d("pipeline_depth")
    """Steps in flight: 2 overlaps the router's work with the shard's, 1 is the serial loop."""
    step_timeout: float = _d("step_timeout")
    """Seconds the shard may take to answer one step before it is taken as hung."""
    stream_stall_timeout: float = _d("stream_stall_timeout")
    """Seconds a stream's message may wait for a client that does not read; then the
    stream is cancelled."""
    tracing: TracingConfig | None = None
    shutdown_grace_period: float = _d("shutdown_grace_period")
    """Seconds in-flight requests may run after SIGTERM (new ones are refused meanwhile)."""

    @property
    def effective_max_batch_size(self) -> int:
        return self.max_batch_size or DEFAULT_MAX_BATCH_SIZE

    @property
    def joining_rule(self) -> tuple[int, float]:
        """(max_waiting_tokens, waiting_served_ratio) of TGI's rule; (0, 0.0), which admits
        at the next step, when neither is set."""
        if self.max_waiting_tokens is None and self.waiting_served_ratio is None:
            return 0, 0.0
        waiting = (
            DEFAULT_MAX_WAITING_TOKENS
            if self.max_waiting_tokens is None
            else (self.max_waiting_tokens)
        )
        ratio = (
            DEFAULT_WAITING_SERVED_RATIO
            if self.waiting_served_ratio is None
            else (self.waiting_served_ratio)
        )
        return waiting, ratio

    @property
    def effective_max_new_tokens(self) -> int:
        return min(self.max_new_tokens, self.max_sequence_length - 1)

    @property
    def effective_max_batch_prefill_tokens(self) -> int:
        """The prefill budget on a GPU shard (``prefill_budget`` chooses by device)."""
        return self.prefill_budget(on_cpu=False)

    def prefill_budget(self, on_cpu: bool) -> int:
        """--max-batch-prefill-tokens, else 4,096 (512 on a CPU shard), at most the total."""
        if self.max_batch_prefill_tokens is not None:
            return self.max_batch_prefill_tokens
        default = (
            DEFAULT_MAX_BATCH_PREFILL_TOKENS_CPU if on_cpu else DEFAULT_MAX_BATCH_PREFILL_TOKENS
        )
        return min(default, self.max_batch_total_tokens or 1 << 62)

    def __post_init__(self) -> None:
        if self.max_concurrent_requests <= 0:
            raise ValueError("max_concurrent_requests must be > 0")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens ({self.max_new_tokens}) at least 1")
        if self.max_sequence_length < 2:
            raise ValueError(
                f"max_sequence_length ({self.max_sequence_length}) must be at least 2 "
                "(1 input + 1 output)"
            )
        if self.tokenization_workers <= 0:
            raise ValueError("tokenization_workers must be > 0")
        self._check_timeouts()
        if self.pipeline_depth not in (1, 2):
            raise ValueError(f"pipeline depth ({self.pipeline_depth}) must be 1 or 2")
        if not 0.0 <= self.max_prefill_padding <= 1.0:
            raise ValueError(
                f"max_prefill_padding ({self.max_prefill_padding}) must be a percentage in the "
                "range [0.0, 1.0]"
            )
        if self.max_batch_size is not None and self.max_batch_size < 1:
            raise ValueError("max_batch_size must be > 0")
        check_batching(
            max_sequence_length=self.max_sequence_length,
            max_waiting_tokens=self.max_waiting_tokens,
            waiting_served_ratio=self.waiting_served_ratio,
            max_batch_prefill_tokens=self.max_batch_prefill_tokens,
            max_batch_total_tokens=self.max_batch_total_tokens,
            max_client_batch_size=self.max_client_batch_size,
            max_input_tokens=self.max_input_tokens,
        )

    def _check_timeouts(self) -> None:
        for name in ("step_timeout", "stream_stall_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} ({getattr(self, name)}) must be > 0 seconds")
        if not 0.0 <= self.shutdown_grace_period < 86400.0:
            raise ValueError(
                f"shutdown_grace_period ({self.shutdown_grace_period}) must be in range "
                "0 <= x < 86400"
            )


def check_batching(
    *,
    max_sequence_length: int | None,
    max_waiting_tokens: int | None,
    waiting_served_ratio: float | None,
    max_batch_prefill_tokens: int | None,
    max_batch_total_tokens: int | None,
    max_client_batch_size: int | None,
    max_input_tokens: int | None,
) -> None:
    """ValueError (one line) for inconsistent batching settings; shared with the launcher.
    ``max_sequence_length`` None: not known yet (the checks against it are skipped)."""
    if max_waiting_tokens is not None and max_waiting_tokens < 0:
        raise ValueError(f"max_waiting_tokens ({max_waiting_tokens}) must be >= 0")
    if waiting_served_ratio is not None and not 0.0 <= waiting_served_ratio < math.inf:
        raise ValueError(f"waiting_served_ratio ({waiting_served_ratio}) must be >= 0")
    if max_batch_prefill_tokens is not None and max_batch_prefill_tokens < 1:
        raise ValueError(f"max_batch_prefill_tokens ({max_batch_prefill_tokens}) must be > 0")
    if max_batch_total_tokens is not None:
        _check_total_tokens(max_batch_total_tokens, max_sequence_length, max_batch_prefill_tokens)
    if max_client_batch_size is not None and max_client_batch_size < 1:
        raise ValueError(f"max_client_batch_size ({max_client_batch_size}) must be > 0")
    if max_input_tokens is not None:
        _check_input_tokens(max_input_tokens, max_sequence_length)


def _check_total_tokens(
    max_batch_total_tokens: int,
    max_sequence_length: int | None,
    max_batch_prefill_tokens: int | None,
) -> None:
    if max_sequence_length is not None and max_batch_total_tokens < max_sequence_length:
        raise ValueError(
            f"max_batch_total_tokens ({max_batch_total_tokens}) must be >= "
            f"max_sequence_length ({max_sequence_length}): one request of the maximum "
            "length must fit"
        )
    if max_batch_prefill_tokens is not None and max_batch_prefill_tokens > (max_batch_total_tokens):
        raise ValueError(
            f"max_batch_prefill_tokens ({max_batch_prefill_tokens}) must be <= "
            f"max_batch_total_tokens ({max_batch_total_tokens})"
        )


def _check_input_tokens(max_input_tokens: int, max_sequence_length: int | None) -> None:
    if max_input_tokens < 1:
        raise ValueError(f"max_input_tokens ({max_input_tokens}) must be > 0")
    if max_sequence_length is not None and max_input_tokens >= max_sequence_length:
        raise ValueError(
            f"max_input_tokens ({max_input_tokens}) must be < max_sequence_length "
            f"({max_sequence_length})"
        )
