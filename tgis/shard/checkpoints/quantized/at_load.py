"""Quantization of a dense checkpoint's linear layers at load (``--quantize int8|fp8``).

- ``int8`` (TGIS's ``bitsandbytes``, TGI's ``eetq``): weight-only, symmetric, per output
  channel: ``scale = max|W[o, :]| / 127``, ``q = round(W / scale)`` in [-127, 127];
- ``fp8``: per output channel, ``scale = max|W[o, :]| / 448``, ``W / scale`` rounded to
  float8 e4m3.

Each layer is quantized whole, from the checkpoint's own values in float32, before any
tensor-parallel slicing, so every rank holds the slices one rank would.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tgis.shard.checkpoints.quantized.fp8_matrix import quantize_fp8
from tgis.shard.checkpoints.quantized.matrix import GroupQuantized
from tgis.shard.checkpoints.quantized.source import LinearMatrix, TensorSource

INT8_MAX = 127


def quantize_int8(weight: torch.Tensor, compute_dtype: torch.dtype) -> GroupQuantized:
    """``weight`` [out, in] as int8 per output channel (unsigned with zero point 128)."""
    w = weight.float()
    scale = w.abs().amax(dim=1, keepdim=True) / INT8_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / scale).clamp(-INT8_MAX, INT8_MAX)
    return GroupQuantized(
        (q + 128).to(torch.uint8),
        scale,
        torch.full_like(scale, 128.0),
        torch.zeros(w.shape[1], dtype=torch.long, device=w.device),
        8,
        compute_dtype,
    )


@dataclass(frozen=True)
class AtLoadReader:
    """Every dense linear layer, quantized as it is read (``method``: int8 or fp8)."""

    method: str

    def holds(self, source: TensorSource, module: str) -> bool:
        return f"{module}.weight" in source

    def shape(self, source: TensorSource, module: str) -> tuple[int, int]:
        out, in_ = source.shape(f"{module}.weight")[:2]
        return out, in_

    def read(self, source: TensorSource, module: str, compute_dtype: torch.dtype) -> LinearMatrix:
        weight = source.raw(f"{module}.weight")
        if self.method == "int8":
            return quantize_int8(weight, compute_dtype)
        return quantize_fp8(weight, compute_dtype)
