"""MXFP4 dequantization (gpt-oss's expert matrices) against a table of known values and
against transformers' own dequantization of the same blocks and scales."""

from __future__ import annotations

import pytest
import torch

from tgis.shard.checkpoints.quantized.mxfp4 import dequantize


def test_known_codes_and_exponents() -> None:
    """One block of 32 values, written by hand: byte 0x21 holds code 1 (0.5) in its low
    nibble, the even value, and code 2 (1.0) in its high nibble; code 0xF is -6 and 0x8 is
    -0; a scale of 127 multiplies by 1, 129 by 4, 120 by 2**-7."""
    blocks = torch.zeros(3, 1, 16, dtype=torch.uint8)
    blocks[:, 0, 0] = 0x21
    blocks[:, 0, 1] = 0x8F  # -6.0, then -0.0
    blocks[:, 0, 15] = 0x7A  # code 0xA (-1.0), then 0x7 (6.0)
    scales = torch.tensor([[127], [129], [120]], dtype=torch.uint8)
    got = dequantize(blocks, scales, torch.float32)
    assert got.shape == (3, 32)
    one = torch.zeros(32)
    one[:4] = torch.tensor([0.5, 1.0, -6.0, -0.0])
    one[30:] = torch.tensor([-1.0, 6.0])
    for row, factor in enumerate((1.0, 4.0, 2.0**-7)):
        assert torch.equal(got[row], one * factor), row
    assert torch.signbit(got[0, 3])  # -0.0 stays negative zero


def test_equals_transformers_dequantization() -> None:
    """Random blocks and scales of a [experts, rows, cols] matrix: transformers' helper
    (which also transposes to its experts' [experts, cols, rows]) gives the same values,
    in bfloat16 too (exact: every value is a small integer times a power of two)."""
    mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")
    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 5, 4, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(110, 140, (3, 5, 4), generator=gen, dtype=torch.uint8)
    for dtype in (torch.float32, torch.bfloat16):
        expected = mxfp4.convert_moe_packed_tensors(blocks, scales, dtype=dtype)
        got = dequantize(blocks, scales, dtype)
        assert got.shape == (3, 5, 128) and got.dtype == dtype
        assert torch.equal(got.transpose(1, 2), expected)


def test_mismatched_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match="do not match"):
        dequantize(torch.zeros(2, 4, 16, dtype=torch.uint8), torch.zeros(2, 3), torch.float32)
