"""The common quantized form (``checkpoints/quantized/matrix.py``) and the CPU kernels each
layer is given (``native/linear/quantized_linear.py``), against the dense weight the integers
stand for: ``scales[o, g_idx[i]] * (q[o, i] - zeros[o, g_idx[i]])`` computed here, in
float64, by indexing alone."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.shard.models import build_tiny_llama
from tests.shard.native.linear.matrices import random_matrix, reference
from tgis.shard.checkpoints.quantized.at_load import quantize_int8
from tgis.shard.checkpoints.quantized.fp8_matrix import quantize_fp8
from tgis.shard.checkpoints.quantized.matrix import (
    GroupQuantized,
    concat,
    fuse_rows,
    unpack_int32,
)
from tgis.shard.checkpoints.weights import check_group_split
from tgis.shard.config import ShardConfig
from tgis.shard.errors import StartupError
from tgis.shard.loader import load_runner
from tgis.shard.native.linear import cpu_quant
from tgis.shard.native.linear.cpu_quant import QuantCpuWeight
from tgis.shard.native.linear.quantized_linear import (
    KERNEL_VARIABLE,
    Int4CpuWeight,
    Int8CpuWeight,
    StackedWeight,
    checked_mode,
    quant_kernel,
    runtime_weight,
)
from tgis.shard.native.linear.sharded import apply


def test_dequantize_follows_each_columns_group() -> None:
    m = random_matrix(32, 96, 4, 32, act_order=True, dtype=torch.float32)
    torch.testing.assert_close(m.dequantize().double(), reference(m), atol=1e-7, rtol=1e-6)


def test_unpack_int32_low_bits_first_along_either_dimension() -> None:
    words = torch.tensor([[0x76543210, -1], [0x0000FEDC, 0x12345678]], dtype=torch.int32)
    along_1 = unpack_int32(words, 4, dim=1)
    assert along_1[0, :8].tolist() == [0, 1, 2, 3, 4, 5, 6, 7]
    assert along_1[0, 8:].tolist() == [15] * 8  # a negative word unpacks as unsigned
    assert along_1[1, :8].tolist() == [12, 13, 14, 15, 0, 0, 0, 0]
    along_0 = unpack_int32(words, 8, dim=0)
    assert along_0[:4, 0].tolist() == [0x10, 0x32, 0x54, 0x76]
    assert along_0[4:, 1].tolist() == [0x78, 0x56, 0x34, 0x12]


def test_rows_cols_and_concat_slice_the_dense_weight() -> None:
    m = random_matrix(48, 128, 4, 32, act_order=True, dtype=torch.float32)
    dense = reference(m)
    ranges = [(0, 8), (24, 40)]
    expected = torch.cat([dense[a:b] for a, b in ranges])
    torch.testing.assert_close(reference(m.rows(ranges)), expected)
    part = m.cols(40, 104)  # cuts groups: act order keeps every group it uses
    torch.testing.assert_close(reference(part), dense[:, 40:104])
    assert part.num_groups <= m.num_groups and int(part.g_idx.max()) < part.num_groups
    fused = concat([m.rows([(0, 16)]), m.rows([(16, 48)])])
    assert fused is not None
    torch.testing.assert_close(reference(fused), dense)
    other = random_matrix(16, 128, 4, 32, act_order=True, dtype=torch.float32, seed=1)
    assert concat([m, other]) is None  # different activation orders
    assert fuse_rows([m, other]) is None and fuse_rows([m, dense.float()]) is None
    both = fuse_rows([dense.float(), dense.float()])
    assert isinstance(both, torch.Tensor) and both.shape == (96, 128)


needs_tgis_kernel = pytest.mark.skipif(
    cpu_quant.KERNEL is None, reason="the cpu_quant extension is not built or no AVX-512"
)
# tgis's kernel where it runs here, and PyTorch's
MODES = [pytest.param("tgis", marks=needs_tgis_kernel), "torch"]
KERNEL_CLASS = {"tgis": QuantCpuWeight, "torch": (Int4CpuWeight, Int8CpuWeight)}


def relative_error(weight: object, m: GroupQuantized, x: torch.Tensor, bias=None) -> float:
    got = apply(x, weight, bias).double()  # type: ignore[arg-type]
    expected = x.double() @ reference(m).t()
    if bias is not None:
        expected = expected + bias.double()
    return float((got - expected).abs().max() / expected.abs().max())


@pytest.mark.parametrize("mode", MODES)
def test_fused_parts_in_different_orders_each_run_their_kernel(mode: str) -> None:
    """q/k/v quantized in different activation orders cannot be one int4 matrix: each part
    keeps its own (a dense part beside them too), and the outputs are concatenated."""
    parts = [random_matrix(32, 128, 4, 32, act_order=True, seed=s) for s in (1, 2)]
    dense = torch.randn(16, 128, generator=torch.Generator().manual_seed(4)) * 0.01
    weight, kernel = runtime_weight([*parts, dense.to(torch.bfloat16)], mode)
    assert isinstance(weight, StackedWeight), kernel
    part_kernel = runtime_weight(parts[0], mode)[1]
    assert part_kernel.startswith("int4 (") and kernel == f"stacked parts (dense; {part_kernel})"
    x = torch.randn(4, 128, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    expected = x.double() @ torch.cat([*map(reference, parts), dense.double()]).t()
    got = apply(x, weight, None).double()
    assert (got - expected).abs().max() / expected.abs().max() < 3e-2
    float32 = [random_matrix(32, 128, 4, 32, True, torch.float32, seed=s) for s in (1, 2)]
    fused, kernel = runtime_weight(float32, "auto")  # all dequantized: one dense matrix
    assert isinstance(fused, torch.Tensor) and kernel == "dequantized (float32 activations)"


LAYOUTS = [(32, False), (128, False), (32, True), (-1, False), (512, False)]


@pytest.mark.parametrize(
    "mode,bits,group,act_order",
    [
        pytest.param(*case, marks=mode.marks)
        for mode in (pytest.param(m) if isinstance(m, str) else m for m in MODES)
        for case in [(mode.values[0], bits, *layout) for bits in (4, 8) for layout in LAYOUTS]
        # PyTorch's int8 kernel takes one scale per output channel only
        if not (case[0] == "torch" and case[1] == 8 and case[2] != -1)
    ],
)
def test_kernels_equal_the_dense_weight(mode: str, bits: int, group: int, act_order: bool) -> None:
    """Groups of 32 and 128, activation order, per channel and a group larger than
    PyTorch's int4 kernel takes (it repeats the scale in groups of 256); every row count
    of a step: a decode of 1-9 rows (tgis's kernel: 8 rows per pass; one row in float32,
    more in bfloat16 pairs where the processor has them), a large step (tgis's kernel
    dequantizes it for oneDNN)."""
    m = random_matrix(128, 1536, bits, group, act_order)
    weight, kernel = runtime_weight(m, mode)
    assert isinstance(weight, KERNEL_CLASS[mode]), kernel
    assert (getattr(weight, "order", None) is not None) == act_order
    gen = torch.Generator().manual_seed(3)
    bias = torch.randn(128, generator=gen).to(torch.bfloat16)
    for rows in (1, 2, 7, 9, cpu_quant.DEQUANTIZE_ROWS + 3):
        x = torch.randn(rows, 1536, generator=gen).to(torch.bfloat16)
        assert relative_error(weight, m, x, bias) < 2e-2, rows


@needs_tgis_kernel
@pytest.mark.parametrize("bits", [4, 8])
def test_tgis_kernel_in_float32_is_exact_to_rounding(bits: int) -> None:
    """Forced on float32 activations, tgis's kernel (products and dequantized path) agrees
    with the dense weight to float32 rounding: its layout and tiles lose nothing."""
    m = random_matrix(40, 544, bits, 32, act_order=True, dtype=torch.float32)  # ragged tiles
    weight, _ = runtime_weight(m, "tgis")
    assert isinstance(weight, QuantCpuWeight)
    for rows in (1, 8, 11, cpu_quant.DEQUANTIZE_ROWS):
        x = torch.randn(rows, 544, generator=torch.Generator().manual_seed(rows))
        assert relative_error(weight, m, x) < 2e-6, rows


@pytest.mark.parametrize("symmetric", [True, False])
def test_torch_int8_kernel_takes_asymmetric_zero_points(symmetric: bool) -> None:
    """Symmetric (zero point 128) and asymmetric zero points (the edges 0 and 255 too):
    the latter adds ``sum(x) * scale * (128 - z)``."""
    m = random_matrix(48, 96, 8, -1)
    if symmetric:
        m = GroupQuantized(
            m.q, m.scales, torch.full_like(m.zeros, 128.0), m.g_idx, 8, m.compute_dtype
        )
    weight, kernel = runtime_weight(m, "torch")
    assert isinstance(weight, Int8CpuWeight) and kernel.startswith("int8"), kernel
    assert (weight.offset is None) == symmetric
    assert relative_error(weight, m, torch.randn(5, 96).to(torch.bfloat16)) < 2e-2


@pytest.mark.parametrize(
    "mode,matrix,why",
    [
        ("torch", random_matrix(40, 64, 4, 32), "40 output features, not a multiple of 16"),
        ("torch", random_matrix(32, 96, 4, 48), "groups of 48 columns"),
        ("torch", random_matrix(32, 96, 8, 32), "8-bit weights with groups"),
        pytest.param(
            "tgis", random_matrix(32, 96, 4, 48), "groups of 48 columns", marks=needs_tgis_kernel
        ),
        ("auto", random_matrix(32, 64, 4, 32, dtype=torch.float32), "float32 activations"),
    ],
)
def test_layers_the_kernels_cannot_take_are_dequantized_saying_why(
    mode: str, matrix: GroupQuantized, why: str
) -> None:
    weight, kernel = runtime_weight(matrix, mode)
    assert isinstance(weight, torch.Tensor) and weight.dtype == matrix.compute_dtype
    assert kernel.startswith("dequantized (") and why in kernel, kernel
    torch.testing.assert_close(weight.double(), reference(matrix).to(weight.dtype).double())


@pytest.mark.parametrize("mode", MODES)
def test_unequal_groups_after_a_split_of_an_act_order_layer_are_dequantized(mode: str) -> None:
    m = random_matrix(32, 128, 4, 32, act_order=True).cols(0, 64)
    weight, kernel = runtime_weight(m, mode)
    counts = torch.bincount(m.g_idx)
    assert not bool((counts == counts[0]).all()), "this seed split the groups evenly"
    assert isinstance(weight, torch.Tensor) and "groups of unequal size" in kernel


def test_auto_prefers_tgis_kernel_for_bfloat16_and_pytorchs_for_float16() -> None:
    expected = (Int4CpuWeight, Int8CpuWeight) if cpu_quant.KERNEL is None else QuantCpuWeight
    for bits, group in ((4, 32), (8, -1)):
        bf16, kernel = runtime_weight(random_matrix(32, 64, bits, group), "auto")
        assert isinstance(bf16, expected), kernel
    fp16, kernel = runtime_weight(random_matrix(32, 64, 4, 32, dtype=torch.float16), "auto")
    assert isinstance(fp16, Int4CpuWeight), kernel


def test_the_kernel_variable_forces_a_path() -> None:
    """The layers built inside ``quant_kernel(mode)`` (the loader's TGIS_QUANT_KERNEL) run
    that mode's kernel."""
    m = random_matrix(32, 64, 4, 32, dtype=torch.float32)
    with quant_kernel("torch"):
        weight, _ = runtime_weight(m)
    assert isinstance(weight, Int4CpuWeight)  # float32 activations through the int4 kernel
    assert relative_error(weight, m, torch.randn(3, 64)) < 1e-5
    with quant_kernel("dequant"):
        weight, kernel = runtime_weight(random_matrix(32, 64, 4, 32))
    assert isinstance(weight, torch.Tensor) and kernel == f"dequantized ({KERNEL_VARIABLE}=dequant)"
    with pytest.raises(StartupError, match="TGIS_QUANT_KERNEL=marlin: expected one of auto"):
        checked_mode("marlin")


def test_int8_and_fp8_at_load_are_per_output_channel() -> None:
    w = torch.randn(24, 80, generator=torch.Generator().manual_seed(5)) * 0.1
    w[3] = 0.0  # an all-zero row keeps a usable scale
    m = quantize_int8(w, torch.float32)
    dense = reference(m)
    step = w.abs().amax(dim=1, keepdim=True).double() / 127
    assert bool(((dense - w.double()).abs() <= step / 2 + 1e-9).all())
    assert bool((dense[3] == 0).all())
    fp8 = quantize_fp8(w, torch.float32).dequantize()
    relative = ((fp8 - w).abs() / w.abs().amax(dim=1, keepdim=True).clamp_min(1e-12)).max()
    assert 0 < relative < 2**-4  # e4m3 keeps 3 mantissa bits


def test_a_tensor_parallel_split_may_not_cut_a_group_in_column_order() -> None:
    """A row-parallel slice of a layer in column order must hold whole groups; the error
    names the shard counts that work. In activation order every rank keeps the scales of
    the groups its columns use, so any split is allowed."""
    in_order = random_matrix(16, 256, 4, 64)
    check_group_split("m", in_order, (0, 128), 2)  # two ranks: 128 columns, 2 groups each
    with pytest.raises(StartupError) as failure:
        check_group_split("model.layers.0.mlp.down_proj", in_order, (0, 32), 8)
    assert str(failure.value) == (
        "model.layers.0.mlp.down_proj: 256 input features in groups of 64 cannot be split "
        "between 8 shards (each would cut a group); --num-shard values that work: 1, 2, 4"
    )
    check_group_split("m", random_matrix(16, 256, 4, 64, act_order=True), (0, 32), 8)


def test_fp8_tensors_outside_the_linear_layers_are_refused(tmp_path: Path) -> None:
    """An FP8 LM head (a layout tgis does not read) fails naming it instead of being cast."""
    build_tiny_llama(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["lm_head.weight"] = tensors["lm_head.weight"].to(torch.float8_e4m3fn)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(StartupError, match=r"^lm_head.weight is stored as float8_e4m3fn, which"):
        load_runner(ShardConfig(model_name=str(tmp_path)))
