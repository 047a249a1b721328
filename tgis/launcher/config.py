"""Launcher configuration: the flag values (`LauncherConfig`) and the rules that turn them into
a validated `ResolvedConfig` (model directory, shard count, max_sequence_length, HF cache).

Everything here is checked before any process is started. A bad value raises `ConfigError`
whose message is the one line shown to the user and written to the termination log.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from tgis.model_files import ModelNotFoundError, resolve_model_dir
from tgis.router.config import (
    DEFAULT_MAX_BATCH_PREFILL_TOKENS,
    DEFAULT_SHUTDOWN_GRACE_S,
    TlsConfig,
    check_batching,
)
from tgis.router.edge.tls import TlsError, load_material
from tgis.shard.config import DEFAULT_MAX_LORA_RANK, DEFAULT_MAX_LORAS, LOAD_FORMATS

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

QUANTIZE_METHODS = ("bitsandbytes", "gptq")

# config.json keys holding the model's context length, in the order TGIS tries them.
MAX_SEQUENCE_LENGTH_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "seq_length",
    "max_sequence_length",
    "max_seq_length",
    "seq_len",
)
DEFAULT_MAX_SEQUENCE_LENGTH = 2048

# The name the router reports when no --model-name is given.
EMBEDDED_MODEL_NAME = "tgis-tiny-llama (embedded)"

# Linux limit on the path of a Unix socket (sizeof(sun_path) - 1).
MAX_UDS_PATH_BYTES = 107

# Deprecated env vars that name the hub cache, checked against HF_HUB_CACHE and each other.
_HF_CACHE_VARS = ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "TRANSFORMERS_CACHE")

# Env vars of flags TGIS removed: only a log line says they are ignored.
IGNORED_ENV_VARS = ("MAX_BATCH_WEIGHT", "MAX_PREFILL_WEIGHT")


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


def _blank(value: str | None) -> bool:
    return value is None or not value.strip()


def normalize_deployment_framework(value: str, log: logging.Logger) -> str:
    """Map the legacy `hf_custom_tp` to `tgis_native` (with a warning); reject unknown names."""
    name = value.strip()
    if name in LEGACY_DEPLOYMENT_FRAMEWORKS:
        new = LEGACY_DEPLOYMENT_FRAMEWORKS[name]
        log.warning("deployment_framework %s is deprecated, using %s instead", name, new)
        return new
    if name not in DEPLOYMENT_FRAMEWORKS:
        raise ConfigError(
            f"unknown deployment_framework '{value}': expected one of "
            + ", ".join(DEPLOYMENT_FRAMEWORKS)
        )
    return name


def resolve_dtype(dtype: str | None, dtype_str: str | None) -> str | None:
    """The canonical torch dtype name from --dtype / --dtype-str (aliases allowed), or None."""
    canonical: list[str] = []
    for value in (dtype, dtype_str):
        if _blank(value):
            continue
        assert value is not None
        name = DTYPE_ALIASES.get(value.strip().lower())
        if name is None:
            raise ConfigError(
                f"unknown dtype '{value}': expected one of " + ", ".join(DTYPE_ALIASES)
            )
        canonical.append(name)
    if len(canonical) == 2 and canonical[0] != canonical[1]:
        raise ConfigError("dtype and dtype_str args both provided with different values")
    return canonical[0] if canonical else None


def resolve_load_format(value: str) -> str:
    """``auto`` or ``dummy`` (any case); ConfigError otherwise."""
    name = value.strip().lower()
    if name not in LOAD_FORMATS:
        raise ConfigError(
            f"unknown load_format '{value}': expected one of {', '.join(LOAD_FORMATS)}"
        )
    return name


def validate_quantize(quantize: str | None) -> None:
    """Only the quantization methods TGIS knows."""
    if not _blank(quantize) and quantize not in QUANTIZE_METHODS:
        raise ConfigError(
            f"unknown quantize '{quantize}': expected one of " + ", ".join(QUANTIZE_METHODS)
        )


def validate_limits(flags: LauncherConfig) -> None:
    """Numeric flags: counts, fractions, ports and the shard start-up timeout."""
    if flags.max_concurrent_requests <= 0:
        raise ConfigError("max_concurrent_requests must be > 0")
    if flags.max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens ({flags.max_new_tokens}) at least 1")
    if flags.max_sequence_length is not None and flags.max_sequence_length < 2:
        raise ConfigError(
            f"max_sequence_length ({flags.max_sequence_length}) must be at least 2 "
            "(1 input + 1 output)"
        )
    if flags.max_batch_size is not None and flags.max_batch_size < 1:
        raise ConfigError(f"max_batch_size ({flags.max_batch_size}) must be at least 1")
    if flags.max_loras < 1:
        raise ConfigError(f"max_loras ({flags.max_loras}) must be at least 1")
    if flags.max_lora_rank < 1:
        raise ConfigError(f"max_lora_rank ({flags.max_lora_rank}) must be at least 1")
    if flags.adapter_cache and not Path(flags.adapter_cache).is_dir():
        raise ConfigError(f"adapter_cache {flags.adapter_cache} is not a directory")
    if not 0.0 <= flags.max_prefill_padding <= 1.0:
        raise ConfigError(
            f"max_prefill_padding ({flags.max_prefill_padding}) must be in range 0 <= x <= 1"
        )
    if not 0 <= flags.batch_safety_margin <= 100:
        raise ConfigError(
            f"batch_safety_margin ({flags.batch_safety_margin}) must be in range 0 <= x <= 100"
        )
    validate_batching(flags, max_sequence_length=flags.max_sequence_length)
    if not 0.0 < flags.cuda_process_memory_fraction <= 1.0:
        raise ConfigError("cuda_process_memory_fraction must be in range 0 < x <= 1")
    for name in ("port", "grpc_port", "master_port"):
        value = getattr(flags, name)
        if not 1 <= value <= 65535:
            raise ConfigError(f"{name} ({value}) must be in range 1..65535")
    if flags.port == flags.grpc_port:
        raise ConfigError(f"port and grpc_port must differ (both {flags.port})")
    grace = flags.shutdown_grace_period
    if grace is not None and not 0.0 <= grace < 86400.0:
        raise ConfigError(f"shutdown_grace_period ({grace}) must be in range 0 <= x < 86400")
    if not flags.shard_startup_timeout > 0:
        raise ConfigError(
            f"shard_startup_timeout ({flags.shard_startup_timeout}) must be > 0 seconds"
        )


def validate_batching(flags: LauncherConfig, max_sequence_length: int | None) -> None:
    """The batching flags, alone and against each other (the router's own checks)."""
    try:
        check_batching(
            max_sequence_length=max_sequence_length,
            max_waiting_tokens=flags.max_waiting_tokens,
            waiting_served_ratio=flags.waiting_served_ratio,
            max_batch_prefill_tokens=flags.max_batch_prefill_tokens,
            max_batch_total_tokens=flags.max_batch_total_tokens,
            max_client_batch_size=flags.max_client_batch_size,
            max_input_tokens=flags.max_input_tokens,
        )
    except ValueError as e:
        raise ConfigError(str(e)) from None


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


def validate_tls(flags: LauncherConfig) -> None:
    """Both or neither of cert/key; a client CA needs the key pair; every named file exists."""
    cert, key, ca = flags.tls_cert_path, flags.tls_key_path, flags.tls_client_ca_cert_path
    if (cert is None) != (key is None):
        raise ConfigError("tls: must provide both cert and key")
    if ca is not None and cert is None:
        raise ConfigError("tls: cannot provide client ca cert without keypair")
    for what, path in (("cert", cert), ("key", key), ("client ca cert", ca)):
        if path is not None and not Path(path).is_file():
            raise ConfigError(f"tls: {what} file not found: {path}")
    if cert is not None and key is not None:
        # What the router checks again at start and on every rotation, checked here before
        # any shard loads: readable PEM, a key matching the certificate, a certificate
        # still valid, a readable client CA bundle.
        try:
            load_material(TlsConfig(cert_path=cert, key_path=key, client_ca_path=ca))
        except TlsError as e:
            raise ConfigError(str(e)) from None


def resolve_num_shard(num_shard: int | None, environ: Mapping[str, str]) -> int:
    """Number of shards: --num-shard / NUM_GPUS (must agree), else the count of visible devices."""
    num_gpus: int | None = None
    raw = environ.get("NUM_GPUS")
    if raw is not None and raw.strip():
        try:
            num_gpus = int(raw.strip())
        except ValueError:
            raise ConfigError("NUM_GPUS must be a positive integer") from None
        if num_gpus < 0:
            raise ConfigError("NUM_GPUS must be a positive integer")
    if num_gpus is not None and num_shard is not None and num_gpus != num_shard:
        raise ConfigError(
            f"NUM_GPUS and num_shard are set to different values ({num_gpus} and {num_shard})"
        )
    count = num_shard if num_shard is not None else num_gpus
    if count is None:
        for var in ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES"):
            devices = environ.get(var)
            if devices is not None:
                count = len(devices.split(","))  # TGIS: an empty value counts as 1
                break
        else:
            count = 1
    if count < 1:
        raise ConfigError("`num_shard` / NUM_GPUS cannot be < 1")
    return count


def resolve_hf_hub_cache(environ: Mapping[str, str], log: logging.Logger) -> Path:
    """HF_HUB_CACHE, or a deprecated alias that agrees with it, else HF_HOME/hub, else ~/.cache."""
    given = [(var, environ[var]) for var in _HF_CACHE_VARS if not _blank(environ.get(var))]
    for var, _value in given:
        if var != "HF_HUB_CACHE":
            log.warning("%s is deprecated, use HF_HUB_CACHE instead", var)
    for i, (var, value) in enumerate(given):
        for other, other_value in given[:i]:
            if value != other_value:
                raise ConfigError(f"{var} and {other} env vars can't be set to different values")
    if given:
        return Path(given[0][1])
    hf_home = environ.get("HF_HOME")
    if not _blank(hf_home):
        assert hf_home is not None
        return Path(hf_home) / "hub"
    return Path(environ.get("HOME") or Path.home()) / ".cache" / "huggingface" / "hub"


def model_max_sequence_length(model_config: Mapping[str, Any]) -> int | None:
    """The first integer among the known context-length keys of a config.json, if any."""
    for key in MAX_SEQUENCE_LENGTH_KEYS:
        value = model_config.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
    return None


def read_model_config(model_dir: Path) -> dict[str, Any]:
    """Parse `<model_dir>/config.json`."""
    path = model_dir / "config.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"model config not found: {path}") from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read model config {path}: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"model config {path} is not a JSON object")
    return data


def resolve_max_sequence_length(
    user_value: int | None, model_config: Mapping[str, Any], log: logging.Logger
) -> int:
    """User value, else the model's (config.json), else 2048; logged with its source."""
    model_value = model_max_sequence_length(model_config)
    if user_value is not None:
        if model_value is not None and user_value > model_value:
            log.warning(
                "max_sequence_length (%d) is larger than the model's (%d)", user_value, model_value
            )
        source, value = "user-defined", user_value
    elif model_value is not None:
        source, value = "model", model_value
    else:
        source, value = "default", DEFAULT_MAX_SEQUENCE_LENGTH
    log.info("Using %s max_sequence_length: %d", source, value)
    if value < 2:
        raise ConfigError(f"max_sequence_length ({value}) must be at least 2 (1 input + 1 output)")
    return value


def validate_shard_uds_path(prefix: str, num_shard: int) -> None:
    """The socket directory must exist and `<prefix>-<rank>` must fit in a Unix socket address."""
    if not prefix:
        raise ConfigError("shard_uds_path must not be empty")
    directory = Path(prefix).parent
    if not directory.is_dir():
        raise ConfigError(f"shard_uds_path: directory {directory} does not exist")
    longest = f"{prefix}-{num_shard - 1}"
    if len(os.fsencode(longest)) > MAX_UDS_PATH_BYTES:
        raise ConfigError(
            f"shard_uds_path too long for a Unix socket ({longest!r} is over "
            f"{MAX_UDS_PATH_BYTES} bytes)"
        )


def log_ignored_env(environ: Mapping[str, str], log: logging.Logger) -> None:
    """TGIS removed MAX_BATCH_WEIGHT / MAX_PREFILL_WEIGHT; say so when they are still set."""
    for var in IGNORED_ENV_VARS:
        value = environ.get(var)
        if not _blank(value):
            log.info("%s is set to %s but this parameter will be ignored.", var, value)


def resolve(
    flags: LauncherConfig, environ: Mapping[str, str], log: logging.Logger
) -> ResolvedConfig:
    """Validate every flag and derive the settings the shards and the router are started with."""
    framework = normalize_deployment_framework(flags.deployment_framework, log)
    dtype = resolve_dtype(flags.dtype, flags.dtype_str)
    load_format = resolve_load_format(flags.load_format)
    validate_quantize(flags.quantize)
    validate_limits(flags)
    validate_tls(flags)
    num_shard = resolve_num_shard(flags.num_shard, environ)
    validate_shard_uds_path(flags.shard_uds_path, num_shard)
    hf_hub_cache = resolve_hf_hub_cache(environ, log)
    try:
        model_dir = resolve_model_dir(flags.model_name, flags.revision)
    except ModelNotFoundError as e:
        raise ConfigError(str(e)) from None
    if not flags.model_name and not (model_dir / "config.json").is_file():
        raise ConfigError(f"the embedded model is missing from {model_dir} (no config.json)")
    model_config = read_model_config(model_dir)
    max_sequence_length = resolve_max_sequence_length(flags.max_sequence_length, model_config, log)
    validate_batching(flags, max_sequence_length=max_sequence_length)
    return ResolvedConfig(
        flags=flags,
        model_dir=model_dir,
        served_model_name=flags.model_name or EMBEDDED_MODEL_NAME,
        deployment_framework=framework,
        dtype=dtype,
        num_shard=num_shard,
        max_sequence_length=max_sequence_length,
        hf_hub_cache=hf_hub_cache,
        load_format=load_format,
    )
