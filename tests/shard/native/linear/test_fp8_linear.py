"""FP8 layers kept in FP8 (``Fp8Matrix``) and multiplied by ``torch._scaled_mm``
(``native/linear/fp8_linear.py``), against float64 arithmetic on the same values."""

from __future__ import annotations

import pytest
import torch

from tgis.shard.checkpoints.quantized.fp8_matrix import (
    Fp8Matrix,
    channel_scales,
    concat_fp8,
    fp8_rows,
    quantize_fp8,
)
from tgis.shard.checkpoints.quantized.matrix import fuse_rows
from tgis.shard.native.linear import fp8_linear
from tgis.shard.native.linear.fp8_linear import Fp8ScaledWeight, fp8_supported
from tgis.shard.native.linear.quantized_linear import StackedWeight, runtime_weight


def matrix(out: int, in_: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> Fp8Matrix:
    gen = torch.Generator().manual_seed(seed)
    return quantize_fp8(torch.randn(out, in_, generator=gen) * 0.05, dtype)


def expected_product(m: Fp8Matrix, x: torch.Tensor) -> torch.Tensor:
    """float64: each row of ``x`` rounded to e4m3 with its own scale (max|x| / 448), times
    the weight's e4m3 values and channel scales."""
    x64 = x.double()
    s = (x64.abs().amax(dim=-1, keepdim=True) / 448).clamp_min(1e-30)  # a zero row stays 0
    xq = (x64 / s).float().to(torch.float8_e4m3fn).double() * s
    return xq @ (m.weight.double() * m.scale.double()).t()


def test_quantize_fp8_keeps_e4m3_values_and_channel_scales() -> None:
    w = torch.randn(32, 48, generator=torch.Generator().manual_seed(1))
    w[5] = 0.0
    m = quantize_fp8(w, torch.bfloat16)
    assert m.weight.dtype == torch.float8_e4m3fn and m.scale.shape == (32, 1)
    assert float(m.weight.float().abs().amax(dim=1)[0]) == 448.0  # each row's max is 448
    assert m.dequantize().dtype == torch.bfloat16
    dense = m.dequantize(torch.float32)
    assert bool((dense[5] == 0).all())
    relative = ((dense - w).abs() / w.abs().amax(dim=1, keepdim=True).clamp_min(1e-12)).max()
    assert 0 < relative < 2**-4


def test_slices_and_fusion_equal_the_dense_weight_sliced() -> None:
    a, b = matrix(48, 64, 1), matrix(16, 64, 2)
    fused = fuse_rows([a, b])
    assert isinstance(fused, Fp8Matrix)
    dense = torch.cat([a.dequantize(), b.dequantize()])
    assert torch.equal(fused.dequantize(), dense)
    assert torch.equal(
        fused.rows([(0, 16), (48, 64)]).dequantize(), dense[[*range(16), *range(48, 64)]]
    )
    assert torch.equal(fused.cols(32, 64).dequantize(), dense[:, 32:64])
    assert torch.equal(concat_fp8([a]).weight, a.weight)


def test_channel_scales_take_a_tensor_or_a_channel_scale_only() -> None:
    assert torch.equal(channel_scales(torch.tensor(0.5), 3), torch.full((3, 1), 0.5))
    assert torch.equal(channel_scales(torch.tensor([0.5]), 2), torch.full((2, 1), 0.5))
    per_channel = torch.rand(4, 1, dtype=torch.bfloat16)
    assert torch.equal(channel_scales(per_channel, 4), per_channel.float())
    assert channel_scales(torch.rand(4, 2), 4) is None  # groups of columns
    assert channel_scales(torch.rand(2, 2), 4) is None  # blocks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scaled_product_equals_float64_on_the_rounded_values(dtype: torch.dtype) -> None:
    m = matrix(64, 96, 3, dtype)
    weight, kernel = runtime_weight(m, "torch")
    assert isinstance(weight, Fp8ScaledWeight) and kernel == Fp8ScaledWeight.kernel
    x = torch.randn(2, 5, 96, generator=torch.Generator().manual_seed(4)).to(dtype)
    x[0, 1] = 0.0  # a zero row keeps a finite scale
    bias = torch.randn(64).to(dtype)
    y = weight.matmul(x, bias)
    assert y.shape == (2, 5, 64) and y.dtype == dtype
    expected = expected_product(m, x.reshape(10, 96)).reshape(2, 5, 64) + bias.double()
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(y.double(), expected, rtol=tolerance, atol=tolerance)
    assert bool((y[0, 1] == bias).all())


def test_activation_rounding_moves_the_output_a_few_percent() -> None:
    """The cost of the FP8 activations: against the weight-only product on the same
    weight, a few percent of the output's norm, not more."""
    m = matrix(256, 512, 5)
    x = torch.randn(8, 512, generator=torch.Generator().manual_seed(6))
    weight, _ = runtime_weight(m, "torch")
    assert isinstance(weight, Fp8ScaledWeight)
    exact = x @ m.dequantize().t()
    drift = float((weight.matmul(x, None) - exact).norm() / exact.norm())
    assert 0.005 < drift < 0.05, drift


def test_fp8_rows_scales_each_row_to_448() -> None:
    x = torch.tensor([[1.0, -2.0, 0.5], [0.0, 0.0, 0.0]])
    xq, scale = fp8_rows(x)
    assert xq.dtype == torch.float8_e4m3fn
    assert xq.float()[0].tolist() == [224.0, -448.0, 112.0]
    assert scale[0, 0] == pytest.approx(2 / 448) and bool((xq.float()[1] == 0).all())


def test_kernel_choice_on_the_cpu() -> None:
    """auto: dequantized on the CPU (its _scaled_mm is a slow reference), float32 for its
    own reason; torch: _scaled_mm; Triton's and tgis's kernels have no FP8 form; a shape
    _scaled_mm does not take is dequantized."""
    bf16 = matrix(32, 64, 7, torch.bfloat16)
    choices = {
        mode: runtime_weight(bf16, mode)[1] for mode in ("auto", "dequant", "tgis", "triton")
    }
    assert choices == {
        "auto": "dequantized (no fast FP8 product on the CPU)",
        "dequant": "dequantized (TGIS_QUANT_KERNEL=dequant)",
        "tgis": "dequantized (TGIS_QUANT_KERNEL=tgis has no FP8 kernel)",
        "triton": "dequantized (TGIS_QUANT_KERNEL=triton has no FP8 kernel)",
    }
    dense, _ = runtime_weight(bf16, "auto")
    assert isinstance(dense, torch.Tensor) and torch.equal(dense, bf16.dequantize())
    assert runtime_weight(matrix(32, 64, 7), "auto")[1] == "dequantized (float32 activations)"
    odd = runtime_weight(matrix(24, 64, 8, torch.bfloat16), "torch")[1]
    assert odd == "dequantized ([24, 64] is not a multiple of 16 in both dimensions)"


def test_fused_parts_of_fp8_and_dense_run_side_by_side() -> None:
    fp8, dense = matrix(32, 64, 9), torch.randn(16, 64)
    weight, kernel = runtime_weight([fp8, dense], "torch")
    assert isinstance(weight, StackedWeight), kernel
    x = torch.randn(3, 64)
    y = weight.matmul(x, None)
    assert torch.allclose(y[:, :32].double(), expected_product(fp8, x), rtol=1e-5, atol=1e-5)
    assert torch.allclose(y[:, 32:], x @ dense.t(), atol=1e-5)


def test_fp8_support_needs_compute_capability_8_9(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not fp8_supported(torch.device("cpu"))
    for capability, supported in (((8, 0), False), ((8, 6), False), ((8, 9), True), ((9, 0), True)):
        monkeypatch.setattr(
            fp8_linear.torch.cuda, "get_device_capability", lambda _d, c=capability: c
        )
        assert fp8_supported(torch.device("cuda", 0)) is supported
