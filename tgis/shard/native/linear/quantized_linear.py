"""The kernel each quantized linear layer runs, chosen once at load.

A layer's weight arrives as a dense tensor or a ``GroupQuantized`` (``checkpoints/
quantized/matrix.py``). ``runtime_weight`` turns it into what the step multiplies with:

- CPU, bfloat16 activations, AVX-512: tgis's own kernel (``cpu_quant.py``): 4- and 8-bit
  weights in groups of 32 or more; float32 products for a single row, bfloat16 pairs for
  several (AVX512-BF16), dequantized for oneDNN in large steps (prefill chunks);
- CPU, bfloat16 without it, or float16: PyTorch's ``_weight_int4pack_mm_for_cpu`` (groups
  of 32-256 columns) and, for 8 bits with one scale per output channel,
  ``_weight_int8pack_mm`` (an asymmetric zero point adds a rank-one correction);
  activation order in every kernel by gathering the input's columns in group order;
- CPU, float32 activations: dequantized once, here (the weight-only kernels are built for
  16-bit activations: PyTorch's int4 kernel runs float32 10-20x slower than a dense
  GEMM), so the model computes exactly what the dequantized checkpoint does and memory is
  not saved;
- CUDA: 4- and 8-bit weights through the Triton kernels (``quant_triton.py``: products
  for decode steps, dequantized for cuBLAS from 64 rows);
- FP8 with channel scales (``Fp8Matrix``): ``torch._scaled_mm`` with per-token activation
  scales (``fp8_linear.py``) on a GPU with FP8 units (capability 8.9+); dequantized on
  other GPUs and on the CPU;
- fused layers (q/k/v, gate/up) that cannot be one matrix (quantized in different
  activation orders): each part with its own kernel, outputs concatenated;
- any layer the kernels' layout limits exclude (e.g. output features not a multiple of 16
  for PyTorch's int4 kernel, groups of unequal size after a tensor-parallel split of an
  activation-ordered layer): dequantized.

``TGIS_QUANT_KERNEL`` forces a path: ``auto`` (the rules above), ``triton`` (CUDA),
``tgis`` (tgis's CPU kernel wherever it fits, float32 activations too), ``torch``
(PyTorch's CPU kernels wherever they fit, and ``_scaled_mm`` for FP8 on the CPU too),
``dequant`` (always dense). A layer a forced kernel cannot take, or one forced onto the
other device's kernel, is dequantized.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from tgis.shard.checkpoints.quantized.fp8_matrix import Fp8Matrix
from tgis.shard.checkpoints.quantized.matrix import GroupQuantized, fuse_rows
from tgis.shard.checkpoints.quantized.source import LinearMatrix
from tgis.shard.errors import StartupError
from tgis.shard.native.linear.cpu_quant import quant_cpu_weight
from tgis.shard.native.linear.fp8_linear import fp8_supported, scaled_weight

KERNEL_VARIABLE = "TGIS_QUANT_KERNEL"
KERNEL_MODES = ("auto", "triton", "tgis", "torch", "dequant")
INT4_GROUP_SIZES = (256, 128, 64, 32)  # what _weight_int4pack_mm_for_cpu accepts
INT4_ROWS_MULTIPLE = 16  # output features, for _convert_weight_to_int4pack_for_cpu
INT4_INNER_K_TILES = 2
DENSE = "dense"


_MODE: ContextVar[str] = ContextVar("quant_kernel", default="auto")
"""The kernel mode of the layers being built (set by ``quant_kernel`` around the build)."""


def checked_mode(mode: str) -> str:
    """``TGIS_QUANT_KERNEL``'s word (empty: ``auto``); StartupError for another value."""
    word = mode.strip().lower() or "auto"
    if word not in KERNEL_MODES:
        raise StartupError(f"{KERNEL_VARIABLE}={word}: expected one of {', '.join(KERNEL_MODES)}")
    return word


@contextmanager
def quant_kernel(mode: str) -> Iterator[None]:
    """Layers built inside the block run ``mode``'s kernels (``TGIS_QUANT_KERNEL`` from the
    shard's configuration: the loader builds the models inside it)."""
    token = _MODE.set(checked_mode(mode))
    try:
        yield
    finally:
        _MODE.reset(token)


def kernel_mode() -> str:
    """The kernel mode of the layers being built (``auto`` outside ``quant_kernel``)."""
    return _MODE.get()


@dataclass(frozen=True)
class Int4CpuWeight:
    """4-bit weight for ``_weight_int4pack_mm_for_cpu``: ``packed`` [out, in / 2] uint8,
    ``scales_zeros`` [in / group, out, 2] in the activations' dtype (the kernel computes
    ``(q - 8) * scale + zero``), and ``order``, the input columns in group order when the
    checkpoint was quantized in activation order."""

    packed: torch.Tensor
    scales_zeros: torch.Tensor
    group_size: int
    order: torch.Tensor | None
    kernel = "int4 (_weight_int4pack_mm_for_cpu)"

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.order is not None:
            x = x.index_select(-1, self.order)
        y: torch.Tensor = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.contiguous(), self.packed, self.group_size, self.scales_zeros
        )
        return y if bias is None else y + bias


@dataclass(frozen=True)
class Int8CpuWeight:
    """8-bit weight for ``_weight_int8pack_mm``: ``q - 128`` as int8 [out, in], one scale
    per output channel in the activations' dtype, and for asymmetric weights (zero point
    z != 128) ``offset = scale * (128 - z)`` per output channel: since
    ``scale * (q - z) = scale * (q - 128) + offset``, the layer adds
    ``sum(x) * offset`` to the kernel's product."""

    q: torch.Tensor
    scales: torch.Tensor
    offset: torch.Tensor | None
    kernel = "int8 (_weight_int8pack_mm)"

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = torch._weight_int8pack_mm(x.contiguous(), self.q, self.scales)
        if self.offset is not None:
            y = y + x.sum(dim=-1, keepdim=True) * self.offset
        return y if bias is None else y + bias


@dataclass(frozen=True)
class StackedWeight:
    """Fused layers (q/k/v, gate/up) whose weights cannot be one matrix (quantized in
    different activation orders, or dense beside quantized): each part runs its own kernel
    and the outputs are concatenated."""

    parts: tuple[torch.Tensor | QuantizedWeight, ...]

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        outputs = [
            F.linear(x, part) if isinstance(part, torch.Tensor) else part.matmul(x, None)
            for part in self.parts
        ]
        y = torch.cat(outputs, dim=-1)
        return y if bias is None else y + bias


class QuantizedWeight(Protocol):
    """What a layer multiplies with when its weight is quantized."""

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor: ...


class KernelWeight(QuantizedWeight, Protocol):
    """One kernel's weight: also the kernel's name for the start-up log."""

    @property
    def kernel(self) -> str: ...


LinearWeight = torch.Tensor | QuantizedWeight
"""What a linear layer multiplies with."""


def runtime_weight(
    matrix: LinearMatrix | Sequence[LinearMatrix], mode: str | None = None
) -> tuple[LinearWeight, str]:
    """The weight a layer runs with and a description of its kernel (for the start-up
    log): dense tensors as they are, quantized ones by the rules of this module. A
    sequence is fused layers, stacked along the output rows."""
    if not isinstance(matrix, torch.Tensor | GroupQuantized | Fp8Matrix):
        fused = fuse_rows(matrix)
        if fused is None:
            return _stacked(matrix, mode)
        matrix = fused
    if isinstance(matrix, torch.Tensor):
        return matrix, DENSE
    mode = mode or kernel_mode()
    reason = _dequantize_reason(matrix, mode)
    if reason is None:
        weight = (
            _fp8_weight(matrix, mode)
            if isinstance(matrix, Fp8Matrix)
            else _kernel_weight(matrix, mode)
        )
        if isinstance(weight, str):
            reason = weight
        else:
            return weight, weight.kernel
    return matrix.dequantize(), f"dequantized ({reason})"


def _kernel_weight(matrix: GroupQuantized, mode: str) -> KernelWeight | str:
    """``matrix`` for the kernel of its device and ``mode``, or why none takes it: on CUDA
    the Triton kernels; on the CPU tgis's kernel (bfloat16 activations, or forced) where it
    fits, else PyTorch's."""
    if matrix.q.device.type == "cuda":
        if mode not in ("auto", "triton"):
            return f"{KERNEL_VARIABLE}={mode} names a CPU kernel"
        from tgis.shard.native.linear.quant_triton import triton_quant_weight  # CUDA builds only

        return triton_quant_weight(matrix)
    if mode == "triton":
        return "the Triton kernels run on CUDA"
    if mode == "tgis" or (mode == "auto" and matrix.compute_dtype == torch.bfloat16):
        weight = quant_cpu_weight(matrix)
        if not isinstance(weight, str) or mode == "tgis":
            return weight
    return _int4(matrix) if matrix.bits == 4 else _int8(matrix)


def _fp8_weight(matrix: Fp8Matrix, mode: str) -> KernelWeight | str:
    """``matrix`` for ``_scaled_mm`` where the device multiplies FP8 (and on the CPU when
    forced), or why it is dequantized instead."""
    if mode not in ("auto", "torch"):
        return f"{KERNEL_VARIABLE}={mode} has no FP8 kernel"
    device = matrix.weight.device
    if device.type == "cuda" and not fp8_supported(device):  # _scaled_mm would fail there
        return "this GPU has no FP8 matrix units (compute capability 8.9 or later)"
    if device.type != "cuda" and mode == "auto":
        return "no fast FP8 product on the CPU"
    return scaled_weight(matrix)


def _stacked(
    parts: Sequence[LinearMatrix], mode: str | None
) -> tuple[torch.Tensor | StackedWeight, str]:
    """Each part's own kernel; one dense matrix when every part came out dense."""
    chosen = [runtime_weight(part, mode) for part in parts]
    kernels = "; ".join(sorted({kernel for _, kernel in chosen}))
    dense = [w for w, _ in chosen if isinstance(w, torch.Tensor)]
    if len(dense) == len(chosen):
        return torch.cat(dense), kernels
    return StackedWeight(tuple(w for w, _ in chosen)), f"stacked parts ({kernels})"


def _dequantize_reason(matrix: GroupQuantized | Fp8Matrix, mode: str) -> str | None:
    """Why ``matrix`` must be dequantized before any kernel is tried, or None."""
    if mode == "dequant":
        return f"{KERNEL_VARIABLE}=dequant"
    if matrix.compute_dtype == torch.float32 and mode == "auto":
        return "float32 activations"
    if isinstance(matrix, Fp8Matrix):
        return None
    if matrix.bits not in (4, 8):
        return f"no kernel for {matrix.bits}-bit weights"
    return None


def _int4(matrix: GroupQuantized) -> Int4CpuWeight | str:
    """``matrix`` in ``_weight_int4pack_mm_for_cpu``'s layout, or why it does not fit."""
    out = matrix.shape[0]
    if out % INT4_ROWS_MULTIPLE:
        return f"{out} output features, not a multiple of {INT4_ROWS_MULTIPLE}"
    ordered = matrix.in_group_order()
    if isinstance(ordered, str):
        return ordered
    q, order, size = ordered.q, ordered.order, ordered.group_size
    kernel_group = next((g for g in INT4_GROUP_SIZES if size % g == 0), None)
    if kernel_group is None:
        return f"groups of {size} columns (the kernel takes multiples of 32)"
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
        q.to(torch.int32).contiguous(), INT4_INNER_K_TILES
    )
    repeat = size // kernel_group
    scales = matrix.scales.repeat_interleave(repeat, dim=1)
    zeros = matrix.zeros.repeat_interleave(repeat, dim=1)
    scales_zeros = torch.stack([scales.t(), (scales * (8 - zeros)).t()], dim=-1)
    return Int4CpuWeight(
        packed, scales_zeros.to(matrix.compute_dtype).contiguous(), kernel_group, order
    )


def _int8(matrix: GroupQuantized) -> Int8CpuWeight | str:
    """``matrix`` in ``_weight_int8pack_mm``'s layout, or why it does not fit."""
    if matrix.num_groups != 1:
        return "8-bit weights with groups (the kernel takes one scale per output channel)"
    scales = matrix.scales[:, 0]
    offset = scales * (128 - matrix.zeros[:, 0])
    return Int8CpuWeight(
        (matrix.q.to(torch.int16) - 128).to(torch.int8).contiguous(),
        scales.to(matrix.compute_dtype).contiguous(),
        offset.to(matrix.compute_dtype) if bool(offset.any()) else None,
    )
