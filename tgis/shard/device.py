"""Choose the device and dtype of this rank (CUDA when available, else CPU)."""

from __future__ import annotations

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
    """``cuda:{rank % count}`` when CUDA is available, else the CPU."""
    if not torch.cuda.is_available():
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
