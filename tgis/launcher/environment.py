"""What the launcher reads from its environment besides the flags' own variables: the shard
count (NUM_GPUS, the visible devices), the Hugging Face hub cache, variables TGIS removed,
and variables this server does not read that a user of TGI or vLLM, or a typo, would set.
"""

from __future__ import annotations

import difflib
import logging
from collections.abc import Mapping
from pathlib import Path

from tgis.launcher.config import ConfigError, blank
from tgis.settings.catalogue import SETTINGS, read_by
from tgis.settings.declaration import Process

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


_MODEL = "MODEL_NAME (or --model-name)"

# Variables of other servers (HF TGI, vLLM and its charts, SageMaker's TGI) that this server
# does not read, with what to use instead. Their own names that it reads (MODEL_ID,
# MAX_TOTAL_TOKENS, LORA_ADAPTERS, ...) are aliases in the settings table.
FOREIGN_ENV_VARS: dict[str, str] = {
    "MODEL": _MODEL,
    "MODEL_PATH": _MODEL,
    "MODEL_NAME_OR_PATH": _MODEL,
    "HF_MODEL_ID": _MODEL,
    "MODEL_DIR": _MODEL + "; the launcher gives the router MODEL_DIR itself",
    "TOKENIZER_NAME": "the model's own tokenizer (tokenizer.json in its directory)",
    "TOKENIZER_CONFIG_PATH": "CHAT_TEMPLATE for the chat template (tokenizer_config.json is "
    "read from the model's directory)",
    "VALIDATION_WORKERS": "TOKENIZATION_WORKERS",
    "WEIGHTS_CACHE_OVERRIDE": "HF_HUB_CACHE",
    "ROPE_SCALING": "the rope scaling of the model's config.json",
    "ROPE_FACTOR": "the rope scaling of the model's config.json",
    "CUDA_GRAPHS": "TGIS_CUDA_GRAPHS (auto, 1 or 0)",
    "ATTENTION": "TGIS_ATTENTION_BACKEND",
    "PREFIX_CACHING": "DISABLE_PREFIX_CACHING (prefix caching is on by default)",
    "MAX_MODEL_LEN": "MAX_SEQUENCE_LENGTH",
    "TENSOR_PARALLEL_SIZE": "NUM_SHARD",
    "GPU_MEMORY_UTILIZATION": "CUDA_PROCESS_MEMORY_FRACTION",
    "VLLM_API_KEY": "API_KEY",
}

# Read by the server outside the settings table: never taken for a misspelling.
_READ_ELSEWHERE = frozenset(
    {
        "NUM_GPUS",
        "CUDA_VISIBLE_DEVICES",
        "NVIDIA_VISIBLE_DEVICES",
        *_HF_CACHE_VARS,
        "HF_HOME",
        "HF_HUB_OFFLINE",
        "LOG_LEVEL",
        "GIT_COMMIT_HASH",
        "PYTORCH_CUDA_ALLOC_CONF",
        "PAGED_ATTENTION",
        "TGIS_TERMINATION_LOG",
        *IGNORED_ENV_VARS,
    }
)
_NEAR_MISS_CUTOFF = 0.9
"""How alike a variable's name must be to a setting's (difflib's ratio) to be taken for a
misspelling of it: MODEL_NAMES and MODELNAME are, PORTS (0.89 to PORT) is not."""


def log_ignored_env(environ: Mapping[str, str], log: logging.Logger) -> None:
    """TGIS removed MAX_BATCH_WEIGHT / MAX_PREFILL_WEIGHT; say so when they are still set.
    A variable of another server, or a misspelling of one of this server's, is named in a
    warning with what to use instead (it changes nothing: the server does not read it)."""
    for var in IGNORED_ENV_VARS:
        value = environ.get(var)
        if not blank(value):
            log.info("%s is set to %s but this parameter will be ignored.", var, value)
    for var, instead in unread_env(environ).items():
        log.warning("%s is set, but this server does not read it: use %s", var, instead)
    for names in alias_conflicts(environ):
        given = " and ".join(f"{name}={environ[name].strip()}" for name in names)
        log.warning(
            "%s name one setting, with different values: %s is read (a flag on the command "
            "line beats both)",
            given,
            names[0],
        )


def alias_conflicts(environ: Mapping[str, str]) -> list[tuple[str, ...]]:
    """The variables of one setting the launcher reads that are set (not blank) to
    different values, for each such setting, in the order the launcher reads them (the
    first is the one read: MODEL_NAME, which the image sets, before TGI's MODEL_ID)."""
    conflicts = []
    for setting in read_by(Process.LAUNCHER):
        given = [name for name in setting.env if not blank(environ.get(name))]
        if len({environ[name].strip() for name in given}) > 1:
            conflicts.append(tuple(given))
    return conflicts


def unread_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables set (not blank) in ``environ`` that this server does not read but a
    user meant for it, each with what to use instead, in ``environ``'s order."""
    known = {name for setting in SETTINGS for name in setting.env}
    unread: dict[str, str] = {}
    for var, value in environ.items():
        if blank(value):
            continue
        if var in FOREIGN_ENV_VARS:
            unread[var] = FOREIGN_ENV_VARS[var]
        elif var in known or var in _READ_ELSEWHERE:
            continue
        elif var.upper() in known:
            unread[var] = f"{var.upper()} (variable names are upper case)"
        elif var.isupper() and (
            close := difflib.get_close_matches(var, known, 1, _NEAR_MISS_CUTOFF)
        ):
            unread[var] = f"{close[0]} (a misspelling?)"
    return unread
