"""The shard's start-up configuration (command line plus environment)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any

from tgis.settings.catalogue import default
from tgis.settings.declaration import Process
from tgis.settings.serving import LOAD_FORMATS
from tgis.shard.errors import StartupError

__all__ = [
    "DTYPE_NAMES",
    "LOAD_FORMATS",
    "EngineSettings",
    "ShardConfig",
    "canonical_dtype",
    "default_max_prefix_length",
    "env_int",
    "max_prefix_length",
    "prompt_cache_bytes",
    "switch",
]

DTYPE_NAMES = ("float32", "float16", "bfloat16")
# The launcher's aliases (tgis/launcher/config.py), accepted by `serve --dtype` too.
DTYPE_ALIASES = {
    "fp32": "float32",
    "float": "float32",
    "fp16": "float16",
    "half": "float16",
    "bf16": "bfloat16",
}


def _d(name: str) -> Any:
    return default(name, Process.SHARD)


def default_max_prefix_length(max_sequence_length: int) -> int:
    """TGIS's MAX_PROMPT_PREFIX_LENGTH default: half of ``max_sequence_length``, rounded up."""
    return math.ceil(0.5 * max_sequence_length)


def max_prefix_length(value: int | None, max_sequence_length: int) -> int:
    """``--max-prompt-prefix-length`` (MAX_PROMPT_PREFIX_LENGTH), else half of
    ``max_sequence_length`` rounded up; StartupError when it leaves no room for output."""
    if value is None:
        return default_max_prefix_length(max_sequence_length)
    if not 0 < value <= max_sequence_length - 1:
        raise StartupError(
            f"MAX_PROMPT_PREFIX_LENGTH ({value}) must be between 1 and "
            f"max_sequence_length - 1 ({max_sequence_length - 1})"
        )
    return value


def prompt_cache_bytes(megabytes: int) -> int:
    """``--prompt-cache-size-mb`` (PROMPT_CACHE_SIZE_MB) in bytes."""
    if megabytes < 0:
        raise StartupError(f"PROMPT_CACHE_SIZE_MB must not be negative, got {megabytes}")
    return megabytes * 1024 * 1024


@dataclass(frozen=True)
class EngineSettings:
    """How the shard computes (``tgis/settings/engine.py``: TGIS_ENGINE,
    TGIS_ATTENTION_BACKEND, ...), read once at start like every other setting."""

    engine: str = _d("engine")
    attention_backend: str | None = _d("attention_backend")
    flash_attention: bool = _d("flash_attention")
    lora_kernel: str = _d("lora_kernel")
    quant_kernel: str = _d("quant_kernel")
    compile: str = _d("compile")
    cuda_graphs: str = _d("cuda_graphs")
    trust_remote_code: bool = _d("trust_remote_code")
    transformers_attn_impl: str | None = _d("transformers_attn_impl")

    @property
    def compile_switch(self) -> str:
        """``compile`` as ``auto``, ``on`` or ``off`` (ValueError for other words)."""
        return switch(self.compile, "TGIS_COMPILE")

    @property
    def graphs_switch(self) -> str:
        """``cuda_graphs`` as ``auto``, ``on`` or ``off`` (ValueError for other words)."""
        return switch(self.cuda_graphs, "TGIS_CUDA_GRAPHS")


@dataclass(frozen=True)
class ShardConfig:
    """Everything the shard needs to load its model and serve (one per process); the
    defaults are those of ``tgis/settings``."""

    model_name: str = _d("model_name")
    revision: str | None = _d("revision")
    deployment_framework: str | None = _d("deployment_framework")  # for TGIS; unused
    dtype: str | None = _d("dtype")  # None (auto): device.select_dtype's rule
    quantize: str | None = _d("quantize")  # --quantize, checked against the checkpoint's
    max_sequence_length: int = _d("max_sequence_length")
    max_new_tokens: int = _d("max_new_tokens")  # the router enforces it; validated only
    max_batch_size: int | None = _d("max_batch_size")  # None: by capacity (capacity.py)
    batch_safety_margin: int = _d("batch_safety_margin")  # percent of free GPU memory kept
    sharded: bool = _d("sharded")
    cuda_process_memory_fraction: float = _d("cuda_process_memory_fraction")
    shard_uds_path: str = _d("shard_uds_path")
    json_output: bool = _d("json_output")
    rank: int = 0
    world_size: int = 1
    distributed_timeout: float = _d("distributed_timeout")  # joining the group, a collective
    kv_cache_blocks: int | None = _d("kv_cache_blocks")  # overrides the sizing
    # The largest step's prompt tokens: the GPU warm-up prefill runs this many.
    max_batch_prefill_tokens: int = _d("max_batch_prefill_tokens")
    # KV tokens of the whole running batch: the CPU budget, a cap on the GPU measurement.
    max_batch_total_tokens: int | None = _d("max_batch_total_tokens")
    load_format: str = _d("load_format")  # LOAD_FORMATS: "dummy" creates random weights
    # Prompt-tuning prefixes (TGIS's PREFIX_STORE_PATH, PROMPT_CACHE_SIZE_MB,
    # MAX_PROMPT_PREFIX_LENGTH): no store disables them (every prefix id is not found);
    # no maximum means half of max_sequence_length (``prefix_length_limit``).
    prefix_store_path: str | None = _d("prefix_store_path")
    prompt_cache_bytes: int = prompt_cache_bytes(_d("prompt_cache_size_mb"))
    max_prefix_length: int | None = _d("max_prompt_prefix_length")
    # PEFT adapters (vllm-tgis-adapter's ADAPTER_CACHE / --adapter-cache, `adapter_id`):
    # LoRA and prompt-tuning directories; no path refuses every adapter_id.
    adapter_cache: str | None = _d("adapter_cache")
    lora_adapters: str | None = _d("lora_adapters")  # loaded at start (comma-separated ids)
    max_loras: int = _d("max_loras")
    max_lora_rank: int = _d("max_lora_rank")
    # The router may reuse cached KV blocks (--disable-prefix-caching turns it off): the
    # native engine says so in Info, and commits its CPU KV cache at start, since cached
    # blocks fill all of it.
    prefix_caching: bool = not _d("disable_prefix_caching")
    # Speculative decoding's draft model (--speculator-name / SPECULATOR_NAME; None: none).
    speculator_name: str | None = _d("speculator_name")
    # The router's drafts per sequence and step (--speculate; 0: none) and the largest
    # batch it speculates in: the verify steps' CUDA graphs are captured for those.
    speculate: int = _d("speculate")
    speculator_max_batch_size: int = _d("speculator_max_batch_size")
    engine: EngineSettings = field(default_factory=EngineSettings)

    @property
    def prefix_length_limit(self) -> int:
        """The longest prompt prefix accepted."""
        if self.max_prefix_length is not None:
            return self.max_prefix_length
        return default_max_prefix_length(self.max_sequence_length)

    @property
    def socket_path(self) -> str:
        """The Unix socket this rank listens on."""
        return f"{self.shard_uds_path}-{self.rank}"

    def validate(self) -> None:
        """Raise StartupError for values no model could be served with."""
        self._validate_options()
        self._validate_ranks()
        self._validate_kv_budget()

    def _validate_options(self) -> None:
        if self.dtype is not None and self.dtype not in DTYPE_NAMES:
            raise StartupError(
                f"unsupported --dtype '{self.dtype}' (expected one of {', '.join(DTYPE_NAMES)})"
            )
        if not 0 <= self.batch_safety_margin < 100:
            raise StartupError("--batch-safety-margin must be between 0 and 99")
        if not 0.0 < self.cuda_process_memory_fraction <= 1.0:
            raise StartupError("--cuda-process-memory-fraction must be in (0, 1]")
        for name, value in (
            ("--max-sequence-length", self.max_sequence_length),
            ("--max-batch-size", self.max_batch_size),
            ("--max-new-tokens", self.max_new_tokens),
            ("--max-loras", self.max_loras),
            ("--max-lora-rank", self.max_lora_rank),
        ):
            if value is not None and value < 1:
                raise StartupError(f"{name} must be at least 1")
        if self.lora_adapters and self.lora_adapters.strip(" ,") and not self.adapter_cache:
            raise StartupError("--lora-adapters needs --adapter-cache (ADAPTER_CACHE)")
        if self.load_format not in LOAD_FORMATS:
            raise StartupError(
                f"unknown --load-format '{self.load_format}' "
                f"(expected one of {', '.join(LOAD_FORMATS)})"
            )

    def _validate_ranks(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise StartupError(f"invalid RANK={self.rank} for WORLD_SIZE={self.world_size}")
        if self.sharded != (self.world_size > 1):
            raise StartupError(
                f"--sharded needs WORLD_SIZE > 1 (got WORLD_SIZE={self.world_size})"
                if self.sharded
                else f"WORLD_SIZE={self.world_size} needs --sharded"
            )

    def _validate_kv_budget(self) -> None:
        if self.kv_cache_blocks is not None and self.kv_cache_blocks < 1:
            raise StartupError("TGIS_KV_CACHE_BLOCKS must be a positive integer")
        if self.max_batch_prefill_tokens < 1:
            raise StartupError("--max-batch-prefill-tokens must be at least 1")
        if (
            self.max_batch_total_tokens is not None
            and self.max_batch_total_tokens < self.max_sequence_length
        ):
            raise StartupError(
                f"--max-batch-total-tokens ({self.max_batch_total_tokens}) must be at least "
                f"--max-sequence-length ({self.max_sequence_length})"
            )


def canonical_dtype(value: str | None) -> str | None:
    """``fp16`` → ``float16``; canonical names pass; ``auto`` is None (the device's rule);
    unknown values are left for validate()."""
    if value is None:
        return None
    name = value.strip().lower()
    if name == "auto":
        return None
    return DTYPE_ALIASES.get(name, name if name in DTYPE_NAMES else value)


def switch(value: str, name: str) -> str:
    """A three-way switch (``TGIS_COMPILE``, ``TGIS_CUDA_GRAPHS``): ``auto`` (empty or
    "auto"), ``on`` (1/true/yes/on) or ``off`` (0/false/no/off); ValueError naming the
    variable for other values."""
    word = value.strip().lower()
    if word in ("", "auto"):
        return "auto"
    if word in ("1", "true", "yes", "on"):
        return "on"
    if word in ("0", "false", "no", "off"):
        return "off"
    raise ValueError(f"{name}={word!r} is not one of auto, 1, 0")


def env_int(name: str, default: int) -> int:
    """An integer environment variable; StartupError if it is set but not an integer."""
    value = env_optional_int(name)
    return default if value is None else value


def env_optional_int(name: str) -> int | None:
    """An integer environment variable, None when unset or empty."""
    value = os.environ.get(name, "").strip()
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise StartupError(
            f"environment variable {name} must be an integer, got '{value}'"
        ) from None
