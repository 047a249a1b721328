"""FP8 weights: the native ``quant_method: fp8`` layout and compressed-tensors'
``float-quantized`` one.

Per linear layer ``<m>``: ``<m>.weight`` float8 (e4m3) [out, in] and a float32 scale:

- ``<m>.weight_scale``: one per tensor ([] or [1]), per output channel ([out, 1]), or per
  block ([ceil(out / b0), ceil(in / b1)], compressed-tensors' ``block`` strategy);
- ``<m>.weight_scale_inv`` (native fp8 with ``weight_block_size: [b0, b1]``, as DeepSeek
  and Qwen write it): per block, a multiplier despite its name.

``W = float(weight) * scale`` (the scale broadcast over its tensor, row or block). A layer
scaled per tensor or per channel stays in FP8 (``fp8_matrix.py: Fp8Matrix``); one scaled
per group of columns or per block is read dense, in float32. An ``input_scale`` (static
activation quantization) is not used: where the layer runs in FP8, the activations get
their own scales per token (``native/linear/fp8_linear.py``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from tgis.shard.checkpoints.quantized.fp8_matrix import FP8_DTYPE, Fp8Matrix, channel_scales
from tgis.shard.checkpoints.quantized.matrix import expect_dtype
from tgis.shard.checkpoints.quantized.source import LinearMatrix, TensorSource, quantized_weight
from tgis.shard.errors import StartupError

FP8_DTYPES = (FP8_DTYPE,)
SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Fp8Reader:
    """FP8 linear layers; ``block`` is the block size of a block-scaled checkpoint (as
    config.json says it: ``weight_block_size`` or compressed-tensors' ``block_structure``),
    needed only to check the scales' shape."""

    block: tuple[int, int] | None = None

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> Fp8Reader:
        block = config.get("weight_block_size")
        if block is None:
            return cls(None)
        if not (isinstance(block, list | tuple) and len(block) == 2):
            raise StartupError(f"fp8 weight_block_size {block!r}: expected [rows, columns]")
        return cls((int(block[0]), int(block[1])))

    def holds(self, source: TensorSource, module: str) -> bool:
        return quantized_weight(source, module, "weight_scale", "weight_scale_inv")

    def shape(self, source: TensorSource, module: str) -> tuple[int, int]:
        out, in_ = source.shape(f"{module}.weight")[:2]
        return out, in_

    def read(self, source: TensorSource, module: str, compute_dtype: torch.dtype) -> LinearMatrix:
        weight = source.raw(f"{module}.weight")
        expect_dtype(f"{module}.weight", weight, FP8_DTYPES)
        name = f"{module}.weight_scale"
        if name not in source:
            name = f"{module}.weight_scale_inv"
        scale = source.raw(name)
        expect_dtype(name, scale, SCALE_DTYPES)
        channels = None if self.block else channel_scales(scale, int(weight.shape[0]))
        if channels is not None:
            return Fp8Matrix(weight, channels, compute_dtype)
        return weight.float() * expand_scale(name, scale.float(), weight.shape, self.block)


def expand_scale(
    name: str,
    scale: torch.Tensor,
    shape: tuple[int, ...] | torch.Size,
    block: tuple[int, int] | None,
) -> torch.Tensor:
    """``scale`` (per tensor, per row, per group of columns, or per block) broadcast to
    ``shape`` [out, in]; StartupError naming ``name`` when it fits none of them."""
    out, in_ = int(shape[0]), int(shape[1])
    if scale.numel() == 1:
        return scale.reshape(1, 1)
    if scale.dim() == 2 and tuple(scale.shape) == (out, 1):
        return scale
    if scale.dim() == 2 and scale.shape[0] == out and in_ % scale.shape[1] == 0:
        # per group of columns (compressed-tensors' group strategy)
        return scale.repeat_interleave(in_ // scale.shape[1], dim=1)
    if scale.dim() == 2:
        rows, cols = scale.shape
        b0 = block[0] if block else math.ceil(out / rows)
        b1 = block[1] if block else math.ceil(in_ / cols)
        if (math.ceil(out / b0), math.ceil(in_ / b1)) == (rows, cols):
            full = scale.repeat_interleave(b0, dim=0).repeat_interleave(b1, dim=1)
            return full[:out, :in_]
    expected = f"[1], [{out}, 1] or blocks of {list(block)}" if block else f"[1] or [{out}, 1]"
    raise StartupError(
        f"{name} has shape {list(scale.shape)}; expected {expected} for a weight of [{out}, {in_}]"
    )
