"""MXFP4 (OCP microscaling FP4), as gpt-oss's published checkpoints store their experts'
matrices (``quantization_config.quant_method == "mxfp4"``; every other tensor is dense).

A matrix ``<name>`` [experts, rows, cols] is stored as two uint8 tensors:
``<name>_blocks`` [experts, rows, cols / 32, 16], two FP4 (E2M1) values a byte, the even
column in the low nibble and the odd one in the high nibble, and ``<name>_scales``
[experts, rows, cols / 32], one E8M0 exponent per block of 32 values (biased by 127). A
value is ``E2M1[nibble] * 2 ** (scale - 127)``, with E2M1's sixteen codes: sign bit 3,
magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6.

tgis dequantizes these matrices at load, into the model's dtype (every E2M1 value times a
power of two is exact in bfloat16 and float32), so the experts run as dense ones: the
checkpoint's values, without MXFP4's memory saving (about 3.8 x the checkpoint's expert
bytes in bfloat16: 16 bits a value instead of 4 + 8/32).
"""

from __future__ import annotations

import torch

BLOCK = 32  # values sharing one scale
SCALE_BIAS = 127
# The value of each 4-bit E2M1 code: the magnitudes, then the same negated (sign bit 3).
_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_VALUES = _MAGNITUDES + tuple(-m for m in _MAGNITUDES)


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``blocks`` [..., n, 16] uint8 and ``scales`` [..., n] uint8 → [..., n * 32] in
    ``dtype`` (computed in float32, exact)."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != BLOCK // 2:
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)}"
        )
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    codes = blocks.to(torch.int64)
    values = torch.stack([table[codes & 0x0F], table[codes >> 4]], dim=-1)  # low, high
    values = values.flatten(-2)  # [..., n, 32]
    exponents = scales.to(torch.int32) - SCALE_BIAS
    values = torch.ldexp(values, exponents.unsqueeze(-1).to(torch.float32))
    return values.flatten(-2).to(dtype)
