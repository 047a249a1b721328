"""What the launcher reads from its environment besides the flags' own variables: the shard
count (NUM_GPUS, the visible devices), the Hugging Face hub cache, and variables TGIS removed.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path

from tgis.launcher.config import ConfigError, blank

# Deprecated env vars that name the hub cache, checked against HF_HUB_CACHE and each other.
_HF_CACHE_VARS = ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "TRANSFORMERS_CACHE")

# Env vars of flags TGIS removed: only a log line says they are ignored.
IGNORED_ENV_VARS = ("MAX_BATCH_WEIGHT", "MAX_PREFILL_WEIGHT")


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
    given = [(var, environ[var]) for var in _HF_CACHE_VARS if not blank(environ.get(var))]
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
    if not blank(hf_home):
        assert hf_home is not None
        return Path(hf_home) / "hub"
    return Path(environ.get("HOME") or Path.home()) / ".cache" / "huggingface" / "hub"


def log_ignored_env(environ: Mapping[str, str], log: logging.Logger) -> None:
    """TGIS removed MAX_BATCH_WEIGHT / MAX_PREFILL_WEIGHT; say so when they are still set."""
    for var in IGNORED_ENV_VARS:
        value = environ.get(var)
        if not blank(value):
            log.info("%s is set to %s but this parameter will be ignored.", var, value)
