"""FP8 linear layers multiplied in FP8 (``torch._scaled_mm``) on GPUs that have FP8
matrix units (compute capability 8.9 and later: Ada, Hopper, Blackwell).

The weight stays float8 e4m3 with one float32 scale per output channel
(``checkpoints/quantized/fp8_matrix.py``). Each step quantizes its activations the same
way, per token (``fp8_rows``): ``s[t] = max|x[t, :]| / 448`` and ``x[t] / s[t]`` rounded
to e4m3, so ``y[t, o] = s[t] * scale[o] * sum_i xq[t, i] * weight[o, i]``, which
``_scaled_mm`` computes with FP8 products, float32 accumulation and both scales applied to
its output ("row-wise" scaling). This is the dynamic W8A8 scheme vLLM applies to FP8
checkpoints; the activations' rounding (3 mantissa bits) moves a layer's output by about
3 % (relative norm) from the weight-only product.

Where this kernel is not chosen (a GPU without FP8, the CPU, where ``_scaled_mm`` is a
reference loop 35-160x slower than oneDNN's bfloat16 GEMM (BENCHMARKS.md), shapes it does
not take), the layer is dequantized at load (``native/linear/quantized_linear.py``).
``TGIS_QUANT_KERNEL=torch`` forces it on the CPU, which is how the tests run it there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tgis.shard.checkpoints.quantized.fp8_matrix import Fp8Matrix, fp8_rows

MIN_CAPABILITY = (8, 9)  # the first CUDA architecture with FP8 tensor cores (Ada)
SHAPE_MULTIPLE = 16  # _scaled_mm's rule for both dimensions of the weight


@dataclass(frozen=True)
class Fp8ScaledWeight:
    """The weight as ``_scaled_mm``'s second operand: ``weight_t`` float8 [in, out] in
    column-major order (the transpose of the row-major [out, in]) and ``scale`` float32
    [1, out]."""

    weight_t: torch.Tensor
    scale: torch.Tensor
    kernel = "fp8 (torch._scaled_mm, per-token activation scales)"

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if torch.compiler.is_compiling():  # a compiled step sees one opaque operator
            y = torch.ops.tgis.fp8_scaled_linear(rows, self.weight_t, self.scale)
        else:
            y = fp8_scaled_linear(rows, self.weight_t, self.scale)
        y = y.reshape(*x.shape[:-1], -1)
        return y if bias is None else y + bias


def fp8_scaled_linear(x: torch.Tensor, weight_t: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x [rows, in] @ W.T`` in ``x``'s dtype: the rows quantized per token, the product by
    ``_scaled_mm``. Also an operator (``tgis::fp8_scaled_linear``): the compiled step holds
    it whole, as ``_scaled_mm``'s own shape rules cannot be traced over a step's symbolic
    token count."""
    xq, x_scale = fp8_rows(x)
    # CUDA's row-wise scaling writes bfloat16 only; the CPU's writes any float type
    out_dtype = torch.bfloat16 if x.is_cuda else x.dtype
    y = torch._scaled_mm(xq, weight_t, scale_a=x_scale, scale_b=scale, out_dtype=out_dtype)
    return y.to(x.dtype)


_OPERATOR = torch.library.custom_op("tgis::fp8_scaled_linear", fp8_scaled_linear, mutates_args=())


@_OPERATOR.register_fake
def _fp8_scaled_linear_shape(
    x: torch.Tensor, weight_t: torch.Tensor, scale: torch.Tensor
) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight_t.shape[1])


def fp8_supported(device: torch.device) -> bool:
    """Whether ``device`` multiplies FP8 in hardware (a CUDA GPU of capability >= 8.9)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= MIN_CAPABILITY


def scaled_weight(matrix: Fp8Matrix) -> Fp8ScaledWeight | str:
    """``matrix`` for ``_scaled_mm``, or why it does not fit."""
    out, in_ = matrix.shape
    if out % SHAPE_MULTIPLE or in_ % SHAPE_MULTIPLE:
        return f"[{out}, {in_}] is not a multiple of {SHAPE_MULTIPLE} in both dimensions"
    weight_t = matrix.weight.contiguous().t()
    return Fp8ScaledWeight(weight_t, matrix.scale.reshape(1, out).contiguous())
