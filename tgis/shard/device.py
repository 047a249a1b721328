"""Choose the device and dtype of this rank (CUDA when available, else CPU)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from tgis.shard.errors import StartupError

_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
_CONFIG_DTYPE_ALIASES = {
    "fp32": "float32",
    "fp16": "float16",
    "half": "float16",
    "bf16": "bfloat16",
}


def select_device(rank: int, world_size: int, memory_fraction: float = 1.0) -> torch.device:
    """``cuda:{rank % count}`` when CUDA is available, else the CPU (whose intra-op threads
    are then set by ``cpu_threads``)."""
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


def select_dtype(
    requested: str | None, config_dtype: str | None, device: torch.device
) -> torch.dtype:
    """The requested dtype; by default float32 on CPU and the checkpoint's dtype on GPU."""
    if requested is not None:
        if requested not in _DTYPES:
            raise StartupError(f"unsupported dtype '{requested}'")
        return _DTYPES[requested]
    if device.type == "cpu":
        return torch.float32
    name = _CONFIG_DTYPE_ALIASES.get(config_dtype or "", config_dtype or "float16")
    return _DTYPES.get(name, torch.float16)


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float16`` → ``"float16"``."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class CpuThreads:
    """Intra-op threads of a CPU shard, by step size.

    The router works while the shard computes (steps overlap), so a small step (decodes)
    leaves it a core: one intra-op thread per spare core, as a second thread that the
    router preempts holds every GEMM back. A large step (a prefill of ``large_from_tokens``
    tokens or more) is long enough to use every core. ``OMP_NUM_THREADS`` fixes both.
    """

    small: int
    large: int
    large_from_tokens: int = 512

    def for_step(self, tokens: int) -> int:
        return self.large if tokens >= self.large_from_tokens else self.small


def cpu_threads(world_size: int, env: Mapping[str, str] | None = None) -> CpuThreads:
    """The CPU thread policy of one of ``world_size`` ranks (BENCHMARKS.md measures one
    thread per decode step 1.15-1.25x faster end to end on 2 cores than two)."""
    environ = os.environ if env is None else env
    configured = environ.get("OMP_NUM_THREADS", "").strip()
    if configured.isdigit() and int(configured) > 0:
        return CpuThreads(int(configured), int(configured))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    ranks = max(world_size, 1)
    return CpuThreads(
        small=max(1, ((cores or 1) - 1) // ranks),
        large=max(1, (cores or 1) // ranks),
    )
