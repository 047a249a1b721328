"""AWQ checkpoints in AutoAWQ's GEMM layout (``quant_method: awq``, ``version: gemm``).

Per linear layer ``<m>``:

- ``<m>.qweight`` int32 [in, out / 8]: 4-bit integers packed along the output dimension,
  eight to a word, in AWQ's interleaved order: the word's nibble k (bits 4k..4k+3) holds
  output column ``8 * word + ORDER[k]`` with ``ORDER = [0, 2, 4, 6, 1, 3, 5, 7]``;
- ``<m>.qzeros`` int32 [groups, out / 8]: the zero points, packed the same way, stored as
  they are;
- ``<m>.scales`` float16 [groups, out].

``W[o, i] = scales[i // group, o] * (q[i, o] - zero[i // group, o])``; no activation order.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from tgis.shard.checkpoints.quantized.matrix import (
    GroupQuantized,
    expect_dtype,
    expect_shape,
    groups_in_order,
    unpack_int32,
)
from tgis.shard.checkpoints.quantized.source import TensorSource
from tgis.shard.errors import StartupError

BITS = 4
PER_WORD = 32 // BITS
# For each output column of a word (0..7), the nibble that holds it.
NIBBLE_OF_COLUMN = (0, 4, 1, 5, 2, 6, 3, 7)
FLOAT_SCALES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class AwqReader:
    """AWQ GEMM layers, from its ``quantization_config``."""

    group_size: int  # <= 0: per output channel

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> AwqReader:
        bits = config.get("bits", config.get("w_bit", BITS))
        if bits != BITS:
            raise StartupError(f"awq with {bits}-bit weights is not supported; AWQ is 4-bit")
        version = str(config.get("version", "gemm")).lower()
        if version != "gemm":
            raise StartupError(
                f"awq version '{version}' is not supported; tgis reads AutoAWQ's gemm layout"
            )
        if config.get("zero_point", True) is False:
            raise StartupError(
                "awq without zero points (zero_point: false) is not supported; tgis reads "
                "AutoAWQ's gemm layout with zero points"
            )
        group_size = config.get("group_size", config.get("q_group_size", 128))
        if not isinstance(group_size, int) or group_size == 0 or group_size < -1:
            raise StartupError(f"awq group_size {group_size!r}: expected -1 or a positive size")
        return cls(group_size)

    def holds(self, source: TensorSource, module: str) -> bool:
        return f"{module}.qweight" in source

    def shape(self, source: TensorSource, module: str) -> tuple[int, int]:
        in_, packed_out = source.shape(f"{module}.qweight")[:2]
        return packed_out * PER_WORD, in_

    def read(self, source: TensorSource, module: str, compute_dtype: torch.dtype) -> GroupQuantized:
        out, in_ = self.shape(source, module)
        qweight = source.raw(f"{module}.qweight")
        expect_dtype(f"{module}.qweight", qweight, (torch.int32,))
        groups = 1 if self.group_size <= 0 else math.ceil(in_ / self.group_size)
        why = f"{in_} inputs, {out} outputs, group size {self.group_size}, 4 bits"
        qzeros = source.raw(f"{module}.qzeros")
        expect_dtype(f"{module}.qzeros", qzeros, (torch.int32,))
        expect_shape(f"{module}.qzeros", qzeros, (groups, out // PER_WORD), why)
        scales = source.raw(f"{module}.scales")
        expect_dtype(f"{module}.scales", scales, FLOAT_SCALES)
        expect_shape(f"{module}.scales", scales, (groups, out), why)
        q = _in_column_order(unpack_int32(qweight, BITS, dim=1))
        zeros = _in_column_order(unpack_int32(qzeros, BITS, dim=1))
        return GroupQuantized(
            q.t().contiguous(),
            scales.float().t().contiguous(),
            zeros.float().t().contiguous(),
            groups_in_order(in_, self.group_size, qweight.device),
            BITS,
            compute_dtype,
        )


def _in_column_order(unpacked: torch.Tensor) -> torch.Tensor:
    """AWQ's interleaved nibbles [rows, out] (per word in nibble order) in column order."""
    rows, out = unpacked.shape
    order = torch.tensor(NIBBLE_OF_COLUMN, device=unpacked.device)
    return unpacked.view(rows, out // PER_WORD, PER_WORD).index_select(2, order).reshape(rows, out)
