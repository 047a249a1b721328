"""Choose the attention backend once at start-up, and probe it on CUDA.

Only this module imports the implementations (``torch_paged``, ``cpu_paged``, ``varlen``,
``triton_paged``); they import the interface alone.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from types import ModuleType

import torch

from tgis.shard.errors import StartupError
from tgis.shard.native.attention.cpu_paged import CpuPagedAttention, load_kernel
from tgis.shard.native.attention.interface import AttentionBackend
from tgis.shard.native.attention.torch_paged import TorchPagedAttention
from tgis.shard.native.attention.varlen import FlashVarlenAttention, SdpaVarlenAttention

log = logging.getLogger(__name__)


BACKENDS = ("torch_paged", "cpu_paged", "sdpa_varlen", "flash_varlen", "triton_paged")


def _has_triton() -> bool:
    """Whether Triton imports (checked only when a CUDA backend is chosen)."""
    try:
        import triton  # noqa: F401
    except Exception:  # ImportError, or a broken install failing at import
        return False
    return True


def select_attention_backend(
    device: torch.device, block_size: int, forced: str | None = None, flash: bool = False
) -> AttentionBackend:
    """The attention implementation for this device, chosen once at start-up.

    ``forced`` (``TGIS_ATTENTION_BACKEND``, one of ``BACKENDS``) forces a choice; ``flash``
    is TGIS's ``FLASH_ATTENTION``. Otherwise: on CUDA,
    ``triton_paged`` (``triton_paged.py``: Triton kernels reading the paged cache in
    place) when Triton imports, unless TGIS's ``FLASH_ATTENTION=true`` asks for flash-attn
    and it is installed; without Triton, flash-attn's varlen kernel when installed, else the
    reference (whose prefills use PyTorch's causal SDPA kernels and whose decodes share one
    SDPA call). On CPU ``cpu_paged`` (the reference with its decodes in a C kernel that
    reads the paged cache in place, BENCHMARKS.md) when the extension was built, else the
    reference. ``FLASH_ATTENTION=true`` without flash-attn only warns; ``PAGED_ATTENTION``
    needs nothing: the KV cache is always paged. Triton is imported only here, when
    chosen, never by importing this module.
    """
    choice = (forced or "").strip().lower()
    if choice and choice not in BACKENDS:
        raise ValueError(f"TGIS_ATTENTION_BACKEND={choice!r} is not one of {', '.join(BACKENDS)}")
    if not choice and device.type == "cuda":
        choice = _cuda_default(flash)
    kernel = load_kernel() if device.type == "cpu" else None
    if not choice:
        choice = "cpu_paged" if kernel is not None else "torch_paged"
    return _backend(choice, device, block_size, kernel)


def _cuda_default(wants_flash: bool) -> str:
    """The CUDA backend nobody forced: ``flash_varlen`` when flash-attn is installed and
    ``FLASH_ATTENTION=true`` asks for it (or Triton is missing), else ``triton_paged`` when
    Triton imports, else the reference."""
    has_flash = importlib.util.find_spec("flash_attn") is not None
    if wants_flash and not has_flash:
        log.warning("FLASH_ATTENTION=true but flash-attn is not installed")
    if has_flash and (wants_flash or not _has_triton()):
        return "flash_varlen"
    return "triton_paged" if _has_triton() else "torch_paged"


def _backend(
    choice: str, device: torch.device, block_size: int, kernel: ModuleType | None
) -> AttentionBackend:
    """The backend named ``choice`` (``kernel``: the CPU extension, when loaded)."""
    if choice == "cpu_paged":
        if kernel is None:
            raise ValueError(
                "TGIS_ATTENTION_BACKEND=cpu_paged needs the CPU kernel (built by pip install "
                "with a C compiler) and a CPU device"
            )
        return CpuPagedAttention(block_size, kernel)
    if choice == "triton_paged":
        return _triton_backend(device, block_size)
    if choice == "flash_varlen":
        return FlashVarlenAttention(block_size)
    if choice == "sdpa_varlen":
        return SdpaVarlenAttention(block_size)
    return TorchPagedAttention(block_size)


def start_attention_backend(
    device: torch.device,
    block_size: int,
    dtype: torch.dtype,
    forced: str | None = None,
    flash: bool = False,
) -> AttentionBackend:
    """``select_attention_backend``, then on CUDA one real call of the chosen kernels in the
    model's dtype (``probe``): an install that cannot run them (a flash-attn wheel built for
    another torch, a Triton that cannot compile for this GPU, a dtype the kernel lacks)
    fails here, not in the first request's step. A backend forced by
    ``TGIS_ATTENTION_BACKEND`` that fails is a StartupError; a default one falls back to
    the reference with a warning."""
    backend = select_attention_backend(device, block_size, forced, flash)
    probe = getattr(backend, "probe", None)
    if device.type != "cuda" or probe is None:
        return backend
    try:
        probe(device, dtype)
    except Exception as e:
        reason = " ".join(str(e).split())[:300] or type(e).__name__
        if forced:
            raise StartupError(
                f"attention backend {backend.name} failed its start-up probe: {reason}"
            ) from None
        log.warning(
            "attention backend %s failed its start-up probe (%s); using torch_paged",
            backend.name,
            reason,
        )
        return TorchPagedAttention(block_size)
    log.info("attention backend %s passed its start-up probe", backend.name)
    return backend


def _triton_backend(device: torch.device, block_size: int) -> AttentionBackend:
    """``triton_paged``: CUDA, or CPU tensors under Triton's interpreter (tests)."""
    interpreted = os.environ.get("TRITON_INTERPRET", "").strip() == "1"
    if device.type != "cuda" and not interpreted:
        raise ValueError(
            "TGIS_ATTENTION_BACKEND=triton_paged needs a CUDA device (or TRITON_INTERPRET=1)"
        )
    if not _has_triton():
        raise ValueError("TGIS_ATTENTION_BACKEND=triton_paged needs the triton package")
    from tgis.shard.native.attention.triton_paged import TritonPagedAttention

    return TritonPagedAttention(block_size)
