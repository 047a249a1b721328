"""4- and 8-bit weights on CUDA: Triton kernels for the products of a decode step, and a
dequantization into a bfloat16/float16 buffer for cuBLAS on large steps.

The layout (written by ``triton_quant_weight`` from a ``GroupQuantized``): ``qweight``
int32 [in * bits / 32, out], the integers packed along the input dimension, low bits first
(GPTQ's own orientation, so a tile of input rows is a tile of words, each thread reading
consecutive output columns); ``scales`` and ``szeros`` [groups, out] in the activations'
dtype with ``W[n, k] = scales[g, n] * q[k, n] - szeros[g, n]``, ``g = k // group_size``;
the input columns in group order (``order`` gathers an activation-ordered layer's inputs,
as on the CPU).

- ``_gemm_kernel``: program (row block, column block) walks the input dimension in tiles of
  ``BLOCK_K`` rows of words, unpacks them, scales them by their group and multiplies with
  ``tl.dot`` (float32 accumulation). Weight-only kernels win while a step is memory-bound:
  the anchors measured 3x at 1-16 tokens and a loss past ~128 (wave-3-features.md A.6).
- ``_dequantize_kernel``: the whole weight, [in, out], into a scratch buffer (allocated at
  load, as large as the largest layer, so that CUDA graph capture allocates nothing); the
  step then multiplies with ``torch.matmul`` (cuBLAS). From ``DEQUANTIZE_ROWS`` rows.

Both are reached through the operator ``tgis::triton_quant_linear`` (a compiled step holds
it as one call; CUDA graphs capture its launches). On CPU tensors the kernels run only
under ``TRITON_INTERPRET=1`` (the tests), with float32 products, as the interpreter's
``tl.dot`` is wrong on 16-bit operands (see ``attention/triton_paged.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tgis.shard.checkpoints.quantized.matrix import GroupQuantized

DEQUANTIZE_ROWS = 64
BLOCK_M = 16
BLOCK_N = 64
BLOCK_K = 64  # input rows per tile: a multiple of the values in a word (8 or 4)
_scratch: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


@triton.jit
def _weight_tile(  # noqa: PLR0913 - a Triton function takes every pointer and size
    qweight_ptr,
    scales_ptr,
    szeros_ptr,
    k,
    n,
    ok,
    out_features,
    group_size,
    BITS: tl.constexpr,
):
    """``W[n, k]`` transposed as a float32 [len(k), len(n)] tile: the packed words unpacked,
    scaled by their group (zero where ``ok`` is false)."""
    PER_WORD: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    words = tl.load(
        qweight_ptr + (k // PER_WORD)[:, None] * out_features + n[None, :], mask=ok, other=0
    )
    q = (words >> ((k % PER_WORD) * BITS)[:, None]) & MASK
    group = k // group_size
    scale = tl.load(scales_ptr + group[:, None] * out_features + n[None, :], mask=ok, other=0.0)
    szero = tl.load(szeros_ptr + group[:, None] * out_features + n[None, :], mask=ok, other=0.0)
    return q.to(tl.float32) * scale.to(tl.float32) - szero.to(tl.float32)


@triton.jit
def _gemm_kernel(  # noqa: PLR0913 - a Triton function takes every pointer, size and tile
    x_ptr,
    qweight_ptr,
    scales_ptr,
    szeros_ptr,
    y_ptr,
    rows,
    out_features,
    in_features,
    group_size,
    BITS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    """``y[m, n] = sum_k x[m, k] * W[n, k]`` for a ``BLOCK_M`` x ``BLOCK_N`` tile."""
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = m < rows
    n_ok = n < out_features
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, in_features, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < in_features
        x = tl.load(
            x_ptr + m[:, None] * in_features + k[None, :],
            mask=m_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        ok = k_ok[:, None] & n_ok[None, :]
        w = _weight_tile(
            qweight_ptr, scales_ptr, szeros_ptr, k, n, ok, out_features, group_size, BITS
        )
        if DOT_FP32:
            acc += tl.dot(x.to(tl.float32), w, input_precision="ieee")
        else:
            acc += tl.dot(x, w.to(x.dtype))
    tl.store(
        y_ptr + m[:, None] * out_features + n[None, :],
        acc.to(y_ptr.dtype.element_ty),
        mask=m_ok[:, None] & n_ok[None, :],
    )


@triton.jit
def _dequantize_kernel(  # noqa: PLR0913 - a Triton function takes every pointer and size
    qweight_ptr,
    scales_ptr,
    szeros_ptr,
    w_ptr,
    out_features,
    in_features,
    group_size,
    BITS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """``W`` transposed, [in, out], for a ``BLOCK_K`` x ``BLOCK_N`` tile."""
    k = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = (k < in_features)[:, None] & (n < out_features)[None, :]
    w = _weight_tile(qweight_ptr, scales_ptr, szeros_ptr, k, n, ok, out_features, group_size, BITS)
    tl.store(
        w_ptr + k[:, None] * out_features + n[None, :],
        w.to(w_ptr.dtype.element_ty),
        mask=ok,
    )


@dataclass(frozen=True)
class TritonQuantWeight:
    """A 4- or 8-bit layer in the Triton kernels' layout (see the module docstring)."""

    qweight: torch.Tensor
    scales: torch.Tensor
    szeros: torch.Tensor
    out_features: int
    in_features: int
    group_size: int
    bits: int
    order: torch.Tensor | None

    @property
    def kernel(self) -> str:
        return f"int{self.bits} (Triton; cuBLAS from {DEQUANTIZE_ROWS} rows)"

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.order is not None:
            x = x.index_select(-1, self.order)
        y: torch.Tensor = torch.ops.tgis.triton_quant_linear(
            x.contiguous(),
            self.qweight,
            self.scales,
            self.szeros,
            self.out_features,
            self.group_size,
            self.bits,
        )
        return y if bias is None else y + bias

    def dequantize(self) -> torch.Tensor:
        """The dense weight transposed, [in, out], a new tensor (the tests' reference)."""
        out = torch.empty(
            self.in_features, self.out_features, dtype=self.scales.dtype, device=self.scales.device
        )
        _launch_dequantize(self.qweight, self.scales, self.szeros, self.group_size, self.bits, out)
        return out


def triton_quant_weight(matrix: GroupQuantized) -> TritonQuantWeight | str:
    """``matrix`` in the Triton kernels' layout (on its device), or why it does not fit."""
    out, in_ = matrix.shape
    ordered = matrix.in_group_order()
    if isinstance(ordered, str):
        return ordered
    q, order, size = ordered.q, ordered.order, ordered.group_size
    per_word = 32 // matrix.bits
    if in_ % per_word:
        return f"{in_} input features do not fill {matrix.bits}-bit words"
    words = q.t().to(torch.int64).reshape(in_ // per_word, per_word, out)
    shifts = torch.arange(per_word, device=q.device) * matrix.bits
    packed = (words << shifts.view(1, -1, 1)).sum(dim=1)  # disjoint bits: a sum is an or
    qweight = (packed - (packed >= 2**31).to(torch.int64) * 2**32).to(torch.int32)
    dtype = matrix.compute_dtype
    weight = TritonQuantWeight(
        qweight.contiguous(),
        matrix.scales.t().to(dtype).contiguous(),
        (matrix.scales * matrix.zeros).t().to(dtype).contiguous(),
        out,
        in_,
        size,
        matrix.bits,
        order,
    )
    reserve_scratch(q.device, dtype, out * in_)
    return weight


def reserve_scratch(device: torch.device, dtype: torch.dtype, size: int) -> None:
    """Grow the device's dequantization buffer to ``size`` elements now (at load), so that a
    step never allocates it (CUDA graph capture must not)."""
    key = (device, dtype)
    scratch = _scratch.get(key)
    if scratch is None or scratch.numel() < size:
        _scratch[key] = torch.empty(size, dtype=dtype, device=device)


def _launch_dequantize(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    szeros: torch.Tensor,
    group_size: int,
    bits: int,
    out: torch.Tensor,
) -> None:
    in_features, out_features = out.shape
    grid = (triton.cdiv(in_features, BLOCK_K), triton.cdiv(out_features, BLOCK_N))
    _dequantize_kernel[grid](
        qweight,
        scales,
        szeros,
        out,
        out_features,
        in_features,
        group_size,
        BITS=bits,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
    )


def quant_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    szeros: torch.Tensor,
    out_features: int,
    group_size: int,
    bits: int,
) -> torch.Tensor:
    """``x [rows, in] @ W.T`` in ``x``'s dtype: the Triton products below
    ``DEQUANTIZE_ROWS`` rows, the layer dequantized for ``torch.matmul`` from there."""
    call = dequantized_product if x.shape[0] >= DEQUANTIZE_ROWS else kernel_product
    return call(x, qweight, scales, szeros, out_features, group_size, bits)


def kernel_product(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    szeros: torch.Tensor,
    out_features: int,
    group_size: int,
    bits: int,
) -> torch.Tensor:
    """``x @ W.T`` by ``_gemm_kernel``."""
    rows, in_features = x.shape
    y = torch.empty(rows, out_features, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(rows, BLOCK_M), triton.cdiv(out_features, BLOCK_N))
    _gemm_kernel[grid](
        x,
        qweight,
        scales,
        szeros,
        y,
        rows,
        out_features,
        in_features,
        group_size,
        BITS=bits,
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
        DOT_FP32=x.device.type == "cpu" or x.dtype == torch.float32,
    )
    return y


def dequantized_product(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    szeros: torch.Tensor,
    out_features: int,
    group_size: int,
    bits: int,
) -> torch.Tensor:
    """``x @ W.T`` with ``W`` dequantized into the scratch buffer, then ``torch.matmul``."""
    in_features = x.shape[1]
    size = in_features * out_features
    reserve_scratch(x.device, x.dtype, size)
    weight = _scratch[(x.device, x.dtype)][:size].view(in_features, out_features)
    _launch_dequantize(qweight, scales, szeros, group_size, bits, weight)
    return torch.matmul(x, weight)


_OPERATOR = torch.library.custom_op("tgis::triton_quant_linear", quant_linear, mutates_args=())


@_OPERATOR.register_fake
def _quant_linear_shape(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    szeros: torch.Tensor,
    out_features: int,
    group_size: int,
    bits: int,
) -> torch.Tensor:
    return x.new_empty(x.shape[0], out_features)
