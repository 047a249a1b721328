"""Checks on the flags themselves, before the model is looked at: the words each accepts, the
ranges of numbers, the batching flags against each other, TLS files, the socket path.

Each raises `ConfigError` on the first bad value; where several checks run in a row, their
order decides which of several bad values is reported.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from tgis.launcher.config import (
    DEPLOYMENT_FRAMEWORKS,
    DTYPE_ALIASES,
    LEGACY_DEPLOYMENT_FRAMEWORKS,
    QUANTIZE_METHODS,
    ConfigError,
    LauncherConfig,
    blank,
)
from tgis.router.config import TlsConfig, check_batching
from tgis.router.edge.tls import TlsError, load_material
from tgis.router.errors import ValidationError
from tgis.router.intake.validation import check_adapter_id
from tgis.settings.features import adapter_ids
from tgis.settings.serving import LOAD_FORMATS

# Linux limit on the path of a Unix socket (sizeof(sun_path) - 1).
MAX_UDS_PATH_BYTES = 107


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
    """The canonical torch dtype name from --dtype / --dtype-str (aliases allowed), or None
    (unset, or ``auto``: the shard's rule, bfloat16 on a CPU with native bfloat16)."""
    canonical: list[str] = []
    for value in (dtype, dtype_str):
        if blank(value) or (value or "").strip().lower() == "auto":
            continue
        assert value is not None
        name = DTYPE_ALIASES.get(value.strip().lower())
        if name is None:
            raise ConfigError(
                f"unknown dtype '{value}': expected auto or one of " + ", ".join(DTYPE_ALIASES)
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
    """Only the quantization methods the shard knows (whether it serves them is the shard's
    to say, with the model in hand)."""
    if not blank(quantize) and quantize not in QUANTIZE_METHODS:
        raise ConfigError(
            f"unknown quantize '{quantize}': expected one of " + ", ".join(QUANTIZE_METHODS)
        )


def validate_limits(flags: LauncherConfig) -> None:
    """Numeric flags, in this order: sizes, adapter limits, batch margins, the batching flags,
    the GPU memory fraction, ports, timeouts."""
    _validate_sizes(flags)
    _validate_request_limits(flags)
    _validate_adapter_limits(flags)
    _validate_speculation(flags)
    _validate_batch_margins(flags)
    validate_batching(flags, max_sequence_length=flags.max_sequence_length)
    if not 0.0 < flags.cuda_process_memory_fraction <= 1.0:
        raise ConfigError("cuda_process_memory_fraction must be in range 0 < x <= 1")
    _validate_ports(flags)
    _validate_timeouts(flags)


def _validate_sizes(flags: LauncherConfig) -> None:
    """Concurrent requests, new tokens, sequence length, batch size: each at least its minimum."""
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


def _validate_request_limits(flags: LauncherConfig) -> None:
    """TGI's limits on what one request asks for: stop sequences and top-n tokens not
    negative, best_of at least 1."""
    if flags.max_stop_sequences < 0:
        raise ConfigError(f"max_stop_sequences ({flags.max_stop_sequences}) must not be negative")
    if flags.max_top_n_tokens is not None and flags.max_top_n_tokens < 0:
        raise ConfigError(f"max_top_n_tokens ({flags.max_top_n_tokens}) must not be negative")
    if flags.max_best_of < 1:
        raise ConfigError(f"max_best_of ({flags.max_best_of}) must be at least 1")


def _validate_adapter_limits(flags: LauncherConfig) -> None:
    """LoRA count and rank at least 1; the adapter cache, when given, a directory; the
    adapters to load at start valid ids of adapters in it."""
    if flags.max_loras < 1:
        raise ConfigError(f"max_loras ({flags.max_loras}) must be at least 1")
    if flags.max_lora_rank < 1:
        raise ConfigError(f"max_lora_rank ({flags.max_lora_rank}) must be at least 1")
    if flags.adapter_cache and not Path(flags.adapter_cache).is_dir():
        raise ConfigError(f"adapter_cache {flags.adapter_cache} is not a directory")
    _validate_lora_adapters(flags.lora_adapters, flags.adapter_cache)


def _validate_lora_adapters(value: str | None, adapter_cache: str | None) -> None:
    """Each id of ``--lora-adapters`` a valid id with an ``adapter_config.json`` in the
    adapter cache (the shard loads them and says why one cannot be used)."""
    ids = adapter_ids(value)
    if not ids:
        return
    if not adapter_cache:
        raise ConfigError(
            "lora_adapters needs adapter_cache: the adapters are read from --adapter-cache "
            "(ADAPTER_CACHE), each id a directory there"
        )
    for adapter_id in ids:
        try:
            check_adapter_id(adapter_id)
        except ValidationError as e:
            raise ConfigError(f"lora_adapters: {e}") from None
        config = Path(adapter_cache) / adapter_id / "adapter_config.json"
        if not config.is_file():
            raise ConfigError(
                f"lora_adapters: no adapter '{adapter_id}' in adapter_cache {adapter_cache} "
                f"({config} not found)"
            )


def _validate_speculation(flags: LauncherConfig) -> None:
    """Drafted tokens not negative; the batch limit and lookup sizes at least 1, min <= max."""
    if flags.speculate < 0:
        raise ConfigError(f"speculate ({flags.speculate}) must not be negative")
    if flags.speculator_max_batch_size < 1:
        raise ConfigError(
            f"speculator_max_batch_size ({flags.speculator_max_batch_size}) must be at least 1"
        )
    if not 1 <= flags.prompt_lookup_min <= flags.prompt_lookup_max:
        raise ConfigError(
            f"prompt_lookup_min ({flags.prompt_lookup_min}) and prompt_lookup_max "
            f"({flags.prompt_lookup_max}) must satisfy 1 <= min <= max"
        )


def _validate_batch_margins(flags: LauncherConfig) -> None:
    """Prefill padding a fraction, the memory safety margin a percentage."""
    if not 0.0 <= flags.max_prefill_padding <= 1.0:
        raise ConfigError(
            f"max_prefill_padding ({flags.max_prefill_padding}) must be in range 0 <= x <= 1"
        )
    if not 0 <= flags.batch_safety_margin <= 100:
        raise ConfigError(
            f"batch_safety_margin ({flags.batch_safety_margin}) must be in range 0 <= x <= 100"
        )


def _validate_ports(flags: LauncherConfig) -> None:
    """Every port in 1..65535; the HTTP and gRPC ports different."""
    for name in ("port", "grpc_port", "master_port"):
        value = getattr(flags, name)
        if not 1 <= value <= 65535:
            raise ConfigError(f"{name} ({value}) must be in range 1..65535")
    if flags.port == flags.grpc_port:
        raise ConfigError(f"port and grpc_port must differ (both {flags.port})")


def _validate_timeouts(flags: LauncherConfig) -> None:
    """The shutdown grace period under a day, the shard start-up timeout positive."""
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


def validate_tls(flags: LauncherConfig) -> None:
    """Both or neither of cert/key; a client CA needs the key pair; every named file exists."""
    cert, key, ca = flags.tls_cert_path, flags.tls_key_path, flags.tls_client_ca_cert_path
    if (cert is None) != (key is None):
        raise ConfigError("tls: must provide both cert and key")
    if ca is not None and cert is None:
        raise ConfigError("tls: cannot provide client ca cert without keypair")
    if flags.http_tls and cert is None:
        raise ConfigError("http_tls: the HTTP port's TLS needs --tls-cert-path and --tls-key-path")
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
