"""Launcher configuration as types: the flag values (`LauncherConfig`) with their defaults and
the words they accept, the settings derived from them (`ResolvedConfig`), and `ConfigError`.

`validation.py` checks the flags, `environment.py` and `model_config.py` read the rest,
`resolution.py` ties them into a `ResolvedConfig`. A bad value raises `ConfigError` whose
message is the one line shown to the user and written to the termination log.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from tgis.router.config import DEFAULT_MAX_BATCH_PREFILL_TOKENS, DEFAULT_SHUTDOWN_GRACE_S
from tgis.shard.config import DEFAULT_MAX_LORA_RANK, DEFAULT_MAX_LORAS

DEPLOYMENT_FRAMEWORKS = (
    "hf_transformers",
    "tgis_native",
    "hf_accelerate",
    "hf_optimum_ort",
    "hf_optimum_bt",
    "ibm_fms",
)
LEGACY_DEPLOYMENT_FRAMEWORKS = {"hf_custom_tp": "tgis_native"}

DTYPE_ALIASES = {
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
}

# --quantize: the shard's formats (checkpoints/quantized/scheme.py), and TGIS's and TGI's names
# for weight-only int8.
QUANTIZE_METHODS = ("gptq", "awq", "compressed-tensors", "fp8", "int8", "bitsandbytes", "eetq")

# The name the router reports when no --model-name is given.
EMBEDDED_MODEL_NAME = "tgis-tiny-llama (embedded)"


class ConfigError(ValueError):
    """An unknown or inconsistent setting; the message is one line for the user."""


@dataclass(frozen=True)
class LauncherConfig:
    """The launcher's flags as given (command line, else env, else these defaults)."""

    model_name: str | None = None
    revision: str | None = None
    deployment_framework: str = "hf_transformers"
    dtype: str | None = None
    dtype_str: str | None = None
    quantize: str | None = None
    num_shard: int | None = None
    max_concurrent_requests: int = 512
    max_sequence_length: int | None = None
    max_new_tokens: int = 1024
    max_batch_size: int | None = None  # default: by capacity (the KV cache; 256 at most)
    max_prefill_padding: float = 0.2
    batch_safety_margin: int = 20
    max_waiting_tokens: int | None = None  # with the ratio unset too: join at the next step
    waiting_served_ratio: float | None = None  # router default 1.2 when the rule applies
    max_batch_prefill_tokens: int | None = None  # router default 4096 (or the total)
    max_batch_total_tokens: int | None = None  # default: the shard's KV capacity
    max_client_batch_size: int | None = None  # default: no limit
    max_input_tokens: int | None = None  # default: max_sequence_length - 1
    port: int = 3000
    grpc_port: int = 8033
    shard_uds_path: str = "/tmp/text-generation-server"
    master_addr: str = "localhost"
    master_port: int = 29500
    json_output: bool = False
    tls_cert_path: str | None = None
    tls_key_path: str | None = None
    tls_client_ca_cert_path: str | None = None
    output_special_tokens: bool = False
    disable_prefix_caching: bool = False
    served_model_name: str | None = None  # the OpenAI routes' model id (default: model_name)
    chat_template: str | None = None  # /v1/chat/completions' template: a file or the text
    # A bearer token the /v1 routes require; passed to the router in its environment, and
    # kept out of the launcher's "Args:" log line.
    api_key: str | None = field(default=None, repr=False)
    http_tls: bool = False  # the HTTP port over TLS too (the gRPC port's cert and key)
    speculate: int = 0  # tokens drafted per sequence and step (0: off, or 4 with a draft model)
    speculator_name: str | None = None  # a draft model (TGIS's SPECULATOR_NAME)
    speculator_max_batch_size: int = 16
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 3
    cuda_process_memory_fraction: float = 1.0
    default_include_stop_seqs: bool = True
    otlp_endpoint: str | None = None
    otlp_service_name: str | None = None
    shard_startup_timeout: float = 600.0
    load_format: str = "auto"  # "dummy": random weights from config.json (benchmarks)
    shutdown_grace_period: float | None = None  # router default: DEFAULT_SHUTDOWN_GRACE_S
    adapter_cache: str | None = None  # PEFT adapters for `adapter_id` (none: refused)
    max_loras: int = DEFAULT_MAX_LORAS  # different LoRA adapters in one step
    max_lora_rank: int = DEFAULT_MAX_LORA_RANK  # the largest LoRA rank accepted


def default_of(name: str) -> Any:
    """The default value of the LauncherConfig field `name` (the single source of defaults)."""
    for f in fields(LauncherConfig):
        if f.name == name:
            return f.default
    raise KeyError(name)


@dataclass(frozen=True)
class ResolvedConfig:
    """Validated settings derived from the flags and the environment, ready to build commands."""

    flags: LauncherConfig
    model_dir: Path
    served_model_name: str
    deployment_framework: str
    dtype: str | None
    num_shard: int
    max_sequence_length: int
    hf_hub_cache: Path
    load_format: str = "auto"


def blank(value: str | None) -> bool:
    """An unset setting: None, empty or only whitespace."""
    return value is None or not value.strip()


def effective_max_batch_prefill_tokens(flags: LauncherConfig) -> int | None:
    """What the router will use when either budget is set (None: both are defaults)."""
    if flags.max_batch_prefill_tokens is not None:
        return flags.max_batch_prefill_tokens
    if flags.max_batch_total_tokens is not None:
        return min(DEFAULT_MAX_BATCH_PREFILL_TOKENS, flags.max_batch_total_tokens)
    return None


def shutdown_grace_period(flags: LauncherConfig) -> float:
    """Seconds the router lets in-flight requests run after SIGTERM."""
    grace = flags.shutdown_grace_period
    return DEFAULT_SHUTDOWN_GRACE_S if grace is None else grace
