"""The Triton kernels for 4- and 8-bit weights (``native/linear/quant_triton.py``) against the
dense weight the integers stand for.

Without a GPU the kernels run on CPU tensors in Triton's interpreter (``TRITON_INTERPRET=1``,
set by tests/conftest.py), with float32 products, so the shapes are small; with one
(``benchmarks/gpu_check.sh``: ``pytest -m gpu``) they are compiled and run on CUDA in
bfloat16. Shapes are not multiples of the tiles; groups are smaller and larger than a tile
of the input dimension; activation order gathers the input's columns.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.shard.native.linear.matrices import random_matrix, reference
from tgis.shard.checkpoints.quantized.matrix import GroupQuantized

pytest.importorskip("triton")

ON_GPU = torch.cuda.is_available()
pytestmark = pytest.mark.gpu
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

from tgis.shard.native.linear.quant_triton import (  # noqa: E402
    DEQUANTIZE_ROWS,
    TritonQuantWeight,
    triton_quant_weight,
)


@pytest.fixture(autouse=True)
def _runnable() -> None:
    if not ON_GPU and not INTERPRETED:
        pytest.fail("no GPU and TRITON_INTERPRET is not 1 (tests/conftest.py sets it)")


def on_device(m: GroupQuantized, dtype: torch.dtype) -> GroupQuantized:
    return GroupQuantized(
        m.q.to(DEVICE), m.scales.to(DEVICE), m.zeros.to(DEVICE), m.g_idx.to(DEVICE), m.bits, dtype
    )


DTYPE = torch.bfloat16 if ON_GPU else torch.float32
TOLERANCE = 2e-2 if ON_GPU else 1e-5


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group,act_order", [(32, False), (96, False), (32, True), (-1, False)])
def test_products_and_dequantized_steps_equal_the_dense_weight(
    bits: int, group: int, act_order: bool
) -> None:
    """Decode steps of 1 and 17 rows (the products) and one of ``DEQUANTIZE_ROWS`` + 3 rows
    (dequantized, then ``torch.matmul``), with a bias."""
    m = random_matrix(80, 192, bits, group, act_order, dtype=torch.float32)
    weight = triton_quant_weight(on_device(m, DTYPE))
    assert isinstance(weight, TritonQuantWeight), weight
    assert (weight.order is not None) == act_order
    dense = reference(m)
    in_group_order = dense if weight.order is None else dense[:, weight.order.cpu()]
    dequantized = weight.dequantize().double().cpu().t()  # input columns in group order
    assert float((dequantized - in_group_order).abs().max() / dense.abs().max()) < TOLERANCE
    gen = torch.Generator().manual_seed(bits + group)
    bias = torch.randn(80, generator=gen)
    for rows in (1, 17, DEQUANTIZE_ROWS + 3):
        x = torch.randn(rows, 192, generator=gen)
        got = weight.matmul(x.to(DEVICE, DTYPE), bias.to(DEVICE, DTYPE)).double().cpu()
        expected = x.to(DTYPE).double() @ dense.t() + bias.to(DTYPE).double()
        error = float((got - expected).abs().max() / expected.abs().max())
        assert error < TOLERANCE, (rows, error)


def test_layers_the_kernels_cannot_take_say_why() -> None:
    split = random_matrix(32, 128, 4, 32, act_order=True).cols(0, 64)
    counts = torch.bincount(split.g_idx)
    assert not bool((counts == counts[0]).all())
    assert triton_quant_weight(on_device(split, DTYPE)) == "groups of unequal size"
    odd = random_matrix(32, 36, 4, -1)
    assert triton_quant_weight(on_device(odd, DTYPE)) == "36 input features do not fill 4-bit words"


def test_the_operator_is_what_a_compiled_step_traces() -> None:
    """``tgis::triton_quant_linear`` has a shape function: tracing it makes no call."""
    m = random_matrix(48, 64, 4, 32)
    weight = triton_quant_weight(on_device(m, DTYPE))
    assert isinstance(weight, TritonQuantWeight)
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        x = mode.from_tensor(torch.randn(5, 64, dtype=DTYPE, device=DEVICE))
        args = (weight.qweight, weight.scales, weight.szeros)
        y = torch.ops.tgis.triton_quant_linear(
            x, *(mode.from_tensor(a) for a in args), 48, weight.group_size, 4
        )
    assert tuple(y.shape) == (5, 48) and y.dtype == DTYPE
