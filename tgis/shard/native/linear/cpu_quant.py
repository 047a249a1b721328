"""tgis's own CPU kernel for 4- and 8-bit weights on AVX-512 processors
(``csrc/cpu_quant.c``), and the layout it reads.

A decode step multiplies a few rows by every weight once: the kernel reads each weight
byte once per 8 rows and widens it in registers, so a 4-bit layer moves a quarter of the
bytes of its bfloat16 twin. One row is limited by that decoding and runs float32 fused
multiply-adds; several rows are limited by the products, which run as bfloat16 pairs
(``vdpbf16ps``, twice the products per instruction) where the processor has AVX512-BF16
and the activations are bfloat16 (``BF16_ROWS``). A large step (a prefill chunk, a big
batch) is compute-bound: the layer is dequantized into a bfloat16 scratch buffer
(``dequantize``: a few milliseconds for a 16M-weight layer) and multiplied by oneDNN at
the processor's bfloat16 rate; the buffer is one per process, as large as the largest
layer, reused by every layer in turn. ``quant_linear`` chooses by the step's rows
(``DEQUANTIZE_ROWS``); it is also the operator ``tgis::cpu_quant_linear``, which a compiled
step (``TGIS_COMPILE=1``) holds as one opaque call.

The layout: ``packed`` uint8, one value per byte (8 bits), or two (4 bits: in blocks of 32
values, value ``j`` of a block in the low nibble of its byte ``j`` and value ``16 + j`` in
the high nibble), rows in tiles of 16 and each tile's spans of 512 values contiguous
(``tiled``); ``scales`` and ``szeros`` float32 [out, groups] with
``W[n, k] = scales[n, g] * q[n, k] - szeros[n, g]``; input columns in group order (``order``
gathers an activation-ordered layer's inputs). Where the extension was not built or the
processor lacks AVX-512, ``native/linear/quantized_linear.py`` uses PyTorch's int4/int8 kernels.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F

from tgis.shard.checkpoints.quantized.matrix import GroupQuantized

# Rows from which a step dequantizes the layer for oneDNN instead of the kernel's products
# (BENCHMARKS.md: the crossovers on a 2-core AVX-512 host, with and without AVX512-BF16).
DEQUANTIZE_ROWS_BF16 = 48
DEQUANTIZE_ROWS_FP32 = 32
BLOCK = 32  # values per block of the layout: groups are multiples of it

_scratch: dict[torch.dtype, torch.Tensor] = {}


def load_kernel() -> ModuleType | None:
    """The compiled extension, or None when it was not built or this processor lacks
    AVX-512."""
    try:
        module = importlib.import_module("tgis.shard.native.linear._cpu_quant")
    except ImportError:
        return None
    return module if module.available() else None


KERNEL = load_kernel()
HAS_BF16 = KERNEL is not None and bool(KERNEL.has_bf16())
DEQUANTIZE_ROWS = DEQUANTIZE_ROWS_BF16 if HAS_BF16 else DEQUANTIZE_ROWS_FP32
# Rows from which bfloat16 steps multiply in bfloat16 pairs (vdpbf16ps) where the processor
# has them: one row is limited by decoding the weights, more by the products.
BF16_ROWS = 2


@dataclass(frozen=True)
class QuantCpuWeight:
    """A 4- or 8-bit layer in the kernel's layout (see the module docstring)."""

    packed: torch.Tensor
    scales: torch.Tensor
    szeros: torch.Tensor
    out_features: int
    in_features: int
    group_size: int
    bits: int
    order: torch.Tensor | None
    compute_dtype: torch.dtype

    @property
    def kernel(self) -> str:
        return f"int{self.bits} (tgis cpu_quant)"

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.order is not None:
            x = x.index_select(-1, self.order)
        args = (self.packed, self.scales, self.szeros, self.out_features, self.group_size)
        if torch.compiler.is_compiling():  # a compiled step sees one opaque operator
            y = torch.ops.tgis.cpu_quant_linear(x, *args, self.bits)
        else:
            y = quant_linear(x, *args, self.bits)
        return y if bias is None else y + bias

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The dense weight [out, in] (inputs in group order), a new tensor of ``dtype``
        (bfloat16 or float32)."""
        return _dequantize(
            self.packed,
            self.scales,
            self.szeros,
            self.out_features,
            self.group_size,
            self.bits,
            torch.empty(self.out_features * self.in_features, dtype=dtype),
        )


def quant_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    szeros: torch.Tensor,
    out_features: int,
    group_size: int,
    bits: int,
) -> torch.Tensor:
    """``x [rows, in] @ W.T`` in ``x``'s dtype for a layer in the kernel's layout: the
    kernel's products for a decode step, the layer dequantized for oneDNN from
    ``DEQUANTIZE_ROWS`` rows. Also an operator (``tgis::cpu_quant_linear``) so that a
    compiled step can hold it; eager steps call the function itself, without the
    dispatcher."""
    assert KERNEL is not None
    rows, in_features = x.shape
    threads = torch.get_num_threads()
    if rows >= DEQUANTIZE_ROWS and x.dtype in (torch.bfloat16, torch.float32):
        size = out_features * in_features
        scratch = _scratch.get(x.dtype)
        if scratch is None or scratch.numel() < size:
            scratch = _scratch[x.dtype] = torch.empty(size, dtype=x.dtype)
        weight = _dequantize(packed, scales, szeros, out_features, group_size, bits, scratch)
        return F.linear(x, weight)
    y = torch.empty(rows, out_features, dtype=torch.float32)
    bf16 = rows >= BF16_ROWS and x.dtype == torch.bfloat16 and HAS_BF16
    xk = x.contiguous() if bf16 else x.float().contiguous()
    (KERNEL.matmul_bf16 if bf16 else KERNEL.matmul)(
        packed.data_ptr(),
        scales.data_ptr(),
        szeros.data_ptr(),
        xk.data_ptr(),
        y.data_ptr(),
        out_features,
        in_features,
        group_size,
        bits,
        rows,
        threads,
    )
    return y.to(x.dtype)


_OPERATOR = torch.library.custom_op("tgis::cpu_quant_linear", quant_linear, mutates_args=())


@_OPERATOR.register_fake
def _quant_linear_shape(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    szeros: torch.Tensor,
    out_features: int,
    group_size: int,
    bits: int,
) -> torch.Tensor:
    return x.new_empty(x.shape[0], out_features)


def _dequantize(
    packed: torch.Tensor,
    scales: torch.Tensor,
    szeros: torch.Tensor,
    out_features: int,
    group_size: int,
    bits: int,
    out: torch.Tensor,
) -> torch.Tensor:
    """The dense weight written into ``out`` (at least out x in elements of bfloat16 or
    float32), viewed [out, in]."""
    assert KERNEL is not None
    in_features = scales.shape[1] * group_size
    size = out_features * in_features
    KERNEL.dequantize(
        packed.data_ptr(),
        scales.data_ptr(),
        szeros.data_ptr(),
        out.data_ptr(),
        out_features,
        in_features,
        group_size,
        bits,
        int(out.dtype == torch.bfloat16),
        torch.get_num_threads(),
    )
    return out[:size].view(out_features, in_features)


def quant_cpu_weight(matrix: GroupQuantized) -> QuantCpuWeight | str:
    """``matrix`` in the kernel's layout, or why it does not fit (or why the kernel is
    not there)."""
    if KERNEL is None:
        return "the cpu_quant extension is not built or the processor lacks AVX-512"
    out, in_ = matrix.shape
    ordered = matrix.in_group_order()
    if isinstance(ordered, str):
        return ordered
    q, order, size = ordered.q, ordered.order, ordered.group_size
    if size % BLOCK:
        return f"groups of {size} columns (the kernel takes multiples of 32)"
    return QuantCpuWeight(
        tiled(packed_rows(q, matrix.bits), KERNEL.ROW_TILE, KERNEL.K_TILE_BLOCKS, matrix.bits),
        matrix.scales.float().contiguous(),
        (matrix.scales * matrix.zeros).float().contiguous(),
        out,
        in_,
        size,
        matrix.bits,
        order,
        matrix.compute_dtype,
    )


def packed_rows(q: torch.Tensor, bits: int) -> torch.Tensor:
    """The integers q [out, in] as bytes, row by row: one per value (8 bits) or two (4 bits:
    in each block of 32, value ``j`` in the low nibble of byte ``j``, ``16 + j`` in its high
    nibble)."""
    if bits == 8:
        return q.contiguous()
    out, in_ = q.shape
    blocks = q.reshape(out, in_ // BLOCK, 2, BLOCK // 2)
    return (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(out, in_ // 2)


def tiled(rows: torch.Tensor, row_tile: int, span_blocks: int, bits: int) -> torch.Tensor:
    """Row bytes in the kernel's reading order: tiles of ``row_tile`` rows (the last padded
    with zeros), each as its spans of ``span_blocks`` blocks, a span's rows one after the
    other."""
    out, row_bytes = rows.shape
    tiles = -(-out // row_tile)
    padded = torch.zeros(tiles * row_tile, row_bytes, dtype=torch.uint8)
    padded[:out] = rows
    per_block = BLOCK if bits == 8 else BLOCK // 2
    span = span_blocks * per_block
    grouped = padded.view(tiles, row_tile, row_bytes)
    spans = [grouped[:, :, a : a + span].reshape(tiles, -1) for a in range(0, row_bytes, span)]
    return torch.cat(spans, dim=1).contiguous()
