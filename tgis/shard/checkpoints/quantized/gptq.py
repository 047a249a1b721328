"""GPTQ checkpoints (``quant_method: gptq``, or a ``quantize_config.json`` as TGIS reads).

Per linear layer ``<m>``:

- ``<m>.qweight`` int32 [in * bits / 32, out]: the integers packed along the input
  dimension, low bits first;
- ``<m>.qzeros`` int32 [groups, out * bits / 32]: the zero points packed along the output
  dimension; GPTQ's original format (v1, auto-gptq) stores zero - 1 and every v1 reader
  adds the 1 back after unpacking (so a stored 15 of 4 bits reads 16);
  ``checkpoint_format: gptq_v2`` (GPTQModel) stores the zero point as it is;
- ``<m>.scales`` float16 [groups, out];
- ``<m>.g_idx`` int32 [in]: each input column's group; ``i // group_size`` unless the
  checkpoint was quantized in activation order (``desc_act``); absent in some checkpoints.

``W[o, i] = scales[g, o] * (q[i, o] - zero[g, o])`` with ``g = g_idx[i]``. 4 and 8 bits;
``group_size`` -1 is one group per output channel.
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

SUPPORTED_BITS = (4, 8)
FLOAT_SCALES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class GptqReader:
    """GPTQ's layers, from its ``quantization_config``."""

    bits: int
    group_size: int  # <= 0: per output channel
    zero_offset: int  # added to the unpacked zero points: 1 for v1, 0 for v2

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> GptqReader:
        bits = config.get("bits", 4)
        if bits not in SUPPORTED_BITS:
            raise StartupError(
                f"gptq with {bits}-bit weights is not supported; tgis reads 4- and 8-bit GPTQ"
            )
        group_size = config.get("group_size", 128)
        if not isinstance(group_size, int) or group_size == 0 or group_size < -1:
            raise StartupError(f"gptq group_size {group_size!r}: expected -1 or a positive size")
        checkpoint_format = str(config.get("checkpoint_format") or "gptq").lower()
        if checkpoint_format not in ("gptq", "gptq_v2"):
            raise StartupError(
                f"gptq checkpoint_format '{checkpoint_format}' is not supported (a Marlin or "
                "other repacked layout); tgis reads gptq and gptq_v2"
            )
        return cls(bits, group_size, 1 if checkpoint_format == "gptq" else 0)

    def holds(self, source: TensorSource, module: str) -> bool:
        return f"{module}.qweight" in source

    def shape(self, source: TensorSource, module: str) -> tuple[int, int]:
        packed_in, out = source.shape(f"{module}.qweight")[:2]
        return out, packed_in * 32 // self.bits

    def read(self, source: TensorSource, module: str, compute_dtype: torch.dtype) -> GroupQuantized:
        out, in_ = self.shape(source, module)
        qweight = source.raw(f"{module}.qweight")
        expect_dtype(f"{module}.qweight", qweight, (torch.int32,))
        groups = 1 if self.group_size <= 0 else math.ceil(in_ / self.group_size)
        why = f"{in_} inputs, {out} outputs, group size {self.group_size}, {self.bits} bits"
        if out * self.bits % 32:
            raise StartupError(
                f"{module}.qweight has {out} output columns, which {self.bits}-bit zero points "
                "cannot be packed for"
            )
        qzeros = source.raw(f"{module}.qzeros")
        expect_dtype(f"{module}.qzeros", qzeros, (torch.int32,))
        expect_shape(f"{module}.qzeros", qzeros, (groups, out * self.bits // 32), why)
        scales = source.raw(f"{module}.scales")
        expect_dtype(f"{module}.scales", scales, FLOAT_SCALES)
        expect_shape(f"{module}.scales", scales, (groups, out), why)
        g_idx = self._g_idx(source, module, in_, groups, qweight.device)
        q = unpack_int32(qweight, self.bits, dim=0).t().contiguous()
        zeros = unpack_int32(qzeros, self.bits, dim=1).float() + self.zero_offset
        return GroupQuantized(
            q,
            scales.float().t().contiguous(),
            zeros.t().contiguous(),
            g_idx,
            self.bits,
            compute_dtype,
        )

    def _g_idx(
        self, source: TensorSource, module: str, in_: int, groups: int, device: torch.device
    ) -> torch.Tensor:
        name = f"{module}.g_idx"
        if name not in source:
            return groups_in_order(in_, self.group_size, device)
        g_idx = source.raw(name)
        expect_dtype(name, g_idx, (torch.int32, torch.int64))
        expect_shape(name, g_idx, (in_,), f"one group index per input column of {module}")
        g_idx = g_idx.long()
        if in_ and (int(g_idx.min()) < 0 or int(g_idx.max()) >= groups):
            raise StartupError(f"{name} has group indices outside [0, {groups})")
        return g_idx
