"""The router's configuration: one frozen dataclass built by the CLI, read everywhere else."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True, kw_only=True)
class TlsConfig:
    """PEM files for the gRPC port; client_ca_path set means client certificates are required."""

    cert_path: str
    key_path: str
    client_ca_path: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class RouterConfig:
    """Everything the router needs to start; see `text-generation-router --help`."""

    max_concurrent_requests: int = 512
    """Inputs in flight (queued or running); more are refused with `Model is overloaded`."""
    max_sequence_length: int = 2048
    """Limit on input + output tokens of one request."""
    max_new_tokens: int = 1024
    """Server limit on max_new_tokens (lowered to max_sequence_length - 1 if not smaller)."""
    max_batch_size: int = 12
    """Most sequences in one forward pass."""
    max_prefill_padding: float = 0.2
    """Accepted for compatibility; the paged engine never pads."""
    max_waiting_tokens: int = 24
    """Accepted for compatibility; new requests join the running batch at the next step."""
    max_batch_tokens: int = 4096
    """Most tokens computed in one step (prefill chunks + decodes); longer prompts are chunked."""
    port: int = 3000
    grpc_port: int = 8033
    shard_uds_path: str = "/tmp/text-generation-server-0"
    tokenizer_path: str
    model_name: str = ""
    tokenization_workers: int = 1
    json_output: bool = False
    tls: TlsConfig | None = None
    output_special_tokens: bool = False
    default_include_stop_seqs: bool = False
    shard_connect_timeout: float = 60.0

    @property
    def effective_max_new_tokens(self) -> int:
        return min(self.max_new_tokens, self.max_sequence_length - 1)

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
        if not 0.0 <= self.max_prefill_padding <= 1.0:
            raise ValueError(
                f"max_prefill_padding ({self.max_prefill_padding}) must be a percentage in the "
                "range [0.0, 1.0]"
            )
        if self.max_batch_size < 1:
            raise ValueError("max_batch_size must be > 0")
        if self.max_batch_tokens < 1:
            raise ValueError("max_batch_tokens must be > 0")
