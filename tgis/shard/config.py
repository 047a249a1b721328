"""The shard's start-up configuration (command line plus environment)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from tgis.shard.errors import StartupError

DTYPE_NAMES = ("float32", "float16", "bfloat16")
# The launcher's aliases (tgis/launcher/config.py), accepted by `serve --dtype` too.
DTYPE_ALIASES = {
    "fp32": "float32",
    "float": "float32",
    "fp16": "float16",
    "half": "float16",
    "bf16": "bfloat16",
}
DEFAULT_UDS_PATH = "/tmp/text-generation-server"
# How the weights are obtained: read from the model's safetensors files, or created at
# random from config.json alone (vLLM's name; for benchmarks without the real weights).
LOAD_FORMATS = ("auto", "dummy")


DEFAULT_PROMPT_CACHE_MB = 512  # TGIS's PROMPT_CACHE_SIZE_MB default
DEFAULT_MAX_LORAS = 8  # different LoRA adapters one step may hold (--max-loras)
DEFAULT_MAX_LORA_RANK = 64  # the largest LoRA rank accepted (--max-lora-rank)
DEFAULT_SPECULATOR_MAX_BATCH_SIZE = 16  # TGIS's SPECULATOR_MAX_BATCH_SIZE default


def default_max_prefix_length(max_sequence_length: int) -> int:
    """TGIS's MAX_PROMPT_PREFIX_LENGTH default: half of ``max_sequence_length``, rounded up."""
    return math.ceil(0.5 * max_sequence_length)


@dataclass(frozen=True)
class ShardConfig:
    """Everything the shard needs to load its model and serve (one per process)."""

    model_name: str = ""
    revision: str | None = None
    deployment_framework: str | None = None  # accepted for TGIS compatibility; unused
    dtype: str | None = None  # None (auto): device.select_dtype's rule
    quantize: str | None = None  # --quantize, checked against the checkpoint's
    max_sequence_length: int = 2048
    max_new_tokens: int = 1024  # the router enforces it; validated only
    max_batch_size: int | None = None  # None: by capacity (capacity.py)
    batch_safety_margin: int = 20  # percent of free GPU memory kept back
    sharded: bool = False
    cuda_process_memory_fraction: float = 1.0
    uds_path: str = DEFAULT_UDS_PATH
    rank: int = 0
    world_size: int = 1
    kv_cache_blocks: int | None = None  # TGIS_KV_CACHE_BLOCKS overrides the sizing
    # The largest step's prompt tokens: the GPU warm-up prefill runs this many.
    max_batch_prefill_tokens: int = 4096
    # KV tokens of the whole running batch: the CPU budget, a cap on the GPU measurement.
    max_batch_total_tokens: int | None = None
    load_format: str = "auto"  # LOAD_FORMATS: "dummy" creates random weights
    # Prompt-tuning prefixes (TGIS's PREFIX_STORE_PATH, PROMPT_CACHE_SIZE_MB,
    # MAX_PROMPT_PREFIX_LENGTH): no store disables them (every prefix id is not found);
    # no maximum means half of max_sequence_length (``prefix_length_limit``).
    prefix_store_path: str | None = None
    prompt_cache_bytes: int = DEFAULT_PROMPT_CACHE_MB * 1024 * 1024
    max_prefix_length: int | None = None
    # PEFT adapters (vllm-tgis-adapter's ADAPTER_CACHE / --adapter-cache, `adapter_id`):
    # LoRA and prompt-tuning directories; no path refuses every adapter_id.
    adapter_cache: str | None = None
    max_loras: int = DEFAULT_MAX_LORAS
    max_lora_rank: int = DEFAULT_MAX_LORA_RANK
    # The router may reuse cached KV blocks (--disable-prefix-caching turns it off): the
    # native engine says so in Info, and commits its CPU KV cache at start, since cached
    # blocks fill all of it.
    prefix_caching: bool = True
    # Speculative decoding's draft model (--speculator-name / SPECULATOR_NAME; None: none).
    speculator_name: str | None = None
    # The router's drafts per sequence and step (--speculate; 0: none) and the largest
    # batch it speculates in: the verify steps' CUDA graphs are captured for those.
    speculate: int = 0
    speculator_max_batch_size: int = DEFAULT_SPECULATOR_MAX_BATCH_SIZE

    @property
    def prefix_length_limit(self) -> int:
        """The longest prompt prefix accepted."""
        if self.max_prefix_length is not None:
            return self.max_prefix_length
        return default_max_prefix_length(self.max_sequence_length)

    @property
    def socket_path(self) -> str:
        """The Unix socket this rank listens on."""
        return f"{self.uds_path}-{self.rank}"

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


def env_mode(name: str) -> str:
    """A three-way switch from the environment: ``auto`` (unset, empty or "auto"), ``on``
    (1/true/yes/on) or ``off`` (0/false/no/off); ValueError for other values."""
    value = os.environ.get(name, "auto").strip().lower()
    if value in ("", "auto"):
        return "auto"
    if value in ("1", "true", "yes", "on"):
        return "on"
    if value in ("0", "false", "no", "off"):
        return "off"
    raise ValueError(f"{name}={value!r} is not one of auto, 1, 0")


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
