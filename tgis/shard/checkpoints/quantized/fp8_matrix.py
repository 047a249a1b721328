"""One linear layer's weight kept in FP8: float8 e4m3 values and one float32 scale per
output channel, ``W[o, i] = scale[o] * weight[o, i]``.

FP8 checkpoints whose scales are per tensor or per output channel (compressed-tensors'
``tensor`` and ``channel`` strategies, native ``quant_method: fp8`` without blocks) and
``--quantize fp8`` at load arrive in this form, a per-tensor scale repeated for every
channel. Slicing for tensor parallelism (``rows``, ``cols``) and fusing q/k/v or gate/up
(``concat_fp8``) keep the values in FP8, so a GPU with FP8 matrix units multiplies them as
they are (``native/linear/fp8_linear.py``); elsewhere they are dequantized at load.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448


@dataclass(frozen=True)
class Fp8Matrix:
    """A [out, in] weight as ``scale * weight`` per output channel."""

    weight: torch.Tensor  # float8 e4m3 [out, in]
    scale: torch.Tensor  # float32 [out, 1]
    compute_dtype: torch.dtype  # the model's activations

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.weight.shape[0]), int(self.weight.shape[1])

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The dense weight [out, in], computed in float32, in ``dtype`` (default: the
        compute dtype)."""
        return (self.weight.float() * self.scale).to(dtype or self.compute_dtype)

    def rows(self, ranges: Sequence[tuple[int, int]]) -> Fp8Matrix:
        """The output rows of every [start, stop) in ``ranges``, in that order."""
        index = torch.cat([torch.arange(a, b) for a, b in ranges]).to(self.weight.device)
        weight, scale = self.weight.index_select(0, index), self.scale.index_select(0, index)
        return Fp8Matrix(weight, scale, self.compute_dtype)

    def cols(self, start: int, stop: int) -> Fp8Matrix:
        """Input columns [start, stop) (the channel scales are the same for every column)."""
        return Fp8Matrix(self.weight[:, start:stop].contiguous(), self.scale, self.compute_dtype)


def channel_scales(scale: torch.Tensor, out_features: int) -> torch.Tensor | None:
    """``scale`` as float32 [out, 1] when it is per tensor or per output channel; None for
    any other shape (groups, blocks: those layers are read dense)."""
    if scale.numel() == 1:
        return scale.float().reshape(1, 1).expand(out_features, 1).contiguous()
    if scale.dim() == 2 and tuple(scale.shape) == (out_features, 1):
        return scale.float().contiguous()
    return None


def fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of ``x`` [rows, n] in float8 e4m3 with its own float32 scale ([rows, 1]):
    ``scale = max|row| / 448``, ``row / scale`` rounded to the nearest FP8 value (a row whose
    scale is 0, all zeros or too small for float32, gets scale 1). Weights are quantized
    this way per output channel at load, activations per token at every FP8 step."""
    x32 = x.float()
    scale = x32.abs().amax(dim=-1, keepdim=True) / FP8_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return (x32 / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def quantize_fp8(weight: torch.Tensor, compute_dtype: torch.dtype) -> Fp8Matrix:
    """``weight`` [out, in] in float8 e4m3 per output channel (``fp8_rows``)."""
    values, scale = fp8_rows(weight)
    return Fp8Matrix(values, scale, compute_dtype)


def concat_fp8(parts: Sequence[Fp8Matrix]) -> Fp8Matrix:
    """The parts stacked along the output rows (fused q/k/v or gate/up)."""
    return Fp8Matrix(
        torch.cat([p.weight for p in parts]),
        torch.cat([p.scale for p in parts]),
        parts[0].compute_dtype,
    )
