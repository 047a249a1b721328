"""Choose the device and dtype of this rank (CUDA when available, else CPU)."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from tgis.shard.cpu_threads import cpu_threads
from tgis.shard.errors import StartupError

_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
log = logging.getLogger(__name__)

# /proc/cpuinfo flags of processors that compute bfloat16 natively (dot products of
# bfloat16 pairs into float32: AVX512-BF16, AMX), where oneDNN runs bfloat16 GEMMs at 2-3x
# the float32 rate (BENCHMARKS.md); without them bfloat16 is emulated, slower than float32.
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
_CPUINFO = Path("/proc/cpuinfo")
_CONFIG_DTYPE_ALIASES = {
    "fp32": "float32",
    "fp16": "float16",
    "half": "float16",
    "bf16": "bfloat16",
}


def select_device(rank: int, world_size: int, memory_fraction: float = 1.0) -> torch.device:
    """``cuda:{rank % count}`` when CUDA is available, else the CPU (whose intra-op threads
    are then set by ``cpu_threads.py``)."""
    if not torch.cuda.is_available():
        torch.set_num_threads(cpu_threads(world_size).small)
        return torch.device("cpu")
    count = torch.cuda.device_count()
    if world_size > count:
        raise StartupError(f"{world_size} shards configured but only {count} GPUs detected")
    device = torch.device("cuda", rank % count)
    torch.cuda.set_device(device)
    if memory_fraction < 1.0:
        torch.cuda.set_per_process_memory_fraction(memory_fraction, device)
    return device


def cpu_bf16_flags(cpuinfo: Path = _CPUINFO) -> tuple[str, ...]:
    """The native-bfloat16 flags (``NATIVE_BF16_FLAGS``) this processor reports; empty
    where it reports none or ``/proc/cpuinfo`` cannot be read (not Linux)."""
    try:
        text = cpuinfo.read_text(errors="ignore")
    except OSError:
        return ()
    for line in text.splitlines():
        if line.startswith("flags"):
            flags = set(line.partition(":")[2].split())
            return tuple(flag for flag in NATIVE_BF16_FLAGS if flag in flags)
    return ()


def select_dtype(
    requested: str | None, config_dtype: str | None, device: torch.device
) -> torch.dtype:
    """The requested dtype, else (``--dtype auto``): on GPU the checkpoint's dtype (float16
    when it names none); on CPU bfloat16 where the processor computes it natively
    (``cpu_bf16_flags``), else float32, whatever the checkpoint's dtype (vLLM's CPU rule)."""
    if requested is not None:
        if requested not in _DTYPES:
            raise StartupError(f"unsupported dtype '{requested}'")
        return _DTYPES[requested]
    if device.type == "cpu":
        flags = cpu_bf16_flags()
        if flags:
            log.info("dtype auto on CPU: bfloat16 (native: %s)", ", ".join(flags))
            return torch.bfloat16
        log.info(
            "dtype auto on CPU: float32 (the processor has no native bfloat16: none of %s)",
            ", ".join(NATIVE_BF16_FLAGS),
        )
        return torch.float32
    name = _CONFIG_DTYPE_ALIASES.get(config_dtype or "", config_dtype or "float16")
    return _DTYPES.get(name, torch.float16)


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float16`` → ``"float16"``."""
    return str(dtype).removeprefix("torch.")
