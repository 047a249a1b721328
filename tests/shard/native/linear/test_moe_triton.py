"""The fused mixture-of-experts kernels (``moe_triton``) give what the grouped path
(``moe.grouped``) and a per-token reference give: every activation, float32/16-bit, a token
routed to one expert twice, experts without tokens, one token, tensor-parallel slices.

Without a GPU the kernels run on CPU tensors in Triton's interpreter (``TRITON_INTERPRET=1``,
set by tests/conftest.py), so the shapes are tiny; with one they are compiled and run on CUDA
(against the grouped path on CUDA too).
"""

from __future__ import annotations

import os

import pytest
import torch

from tgis.shard.native.linear.moe import ClampedSwiGLU, Experts
from tgis.shard.native.linear.moe_grouped import EXPERT_ACTIVATIONS
from tgis.shard.parallel.group import SINGLE, TensorParallel

pytest.importorskip("triton")

ON_GPU = torch.cuda.is_available()
# On a GPU machine these run on CUDA too (benchmarks/gpu_check.sh: pytest -m gpu).
pytestmark = pytest.mark.gpu
DEVICE = torch.device("cuda" if ON_GPU else "cpu")

# Without a GPU, tests/conftest.py sets TRITON_INTERPRET=1 before anything imports triton.
from tgis.shard.native.linear.moe_triton import (  # noqa: E402
    Gating,
    Tiles,
    align,
    capacity,
    fused_moe_with,
)

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
HIDDEN, INTER, EXPERTS, TOP_K = 24, 20, 6, 2  # not multiples of the tiles
SMALL = Tiles(16, 16, 16)
# Token 0 goes to expert 1 twice; experts 2 and 5 get nothing.
IDS = [[1, 1], [3, 0], [3, 1], [0, 3], [4, 1]]


@pytest.fixture(autouse=True)
def _runnable() -> None:
    if not ON_GPU and not INTERPRETED:
        pytest.fail("no GPU and TRITON_INTERPRET is not 1 (tests/conftest.py sets it)")


def _problem(
    tokens: int, dtype: torch.dtype, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x, routing weights and ids (``IDS``' first rows), w13 and w2, of order one."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=g)
    weights = torch.rand(tokens, TOP_K, generator=g)
    ids = torch.tensor(IDS[:tokens])
    w13 = torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=g) / HIDDEN**0.5
    w2 = torch.randn(EXPERTS, HIDDEN, INTER, generator=g) / INTER**0.5
    return (
        x.to(DEVICE, dtype),
        weights.to(DEVICE),
        ids.to(DEVICE),
        w13.to(DEVICE, dtype),
        w2.to(DEVICE, dtype),
    )


def _reference(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    activation: str,
) -> torch.Tensor:
    """Token by token, expert by expert, in float32."""
    act = EXPERT_ACTIVATIONS[activation]
    x, w13, w2 = x.float().cpu(), w13.float().cpu(), w2.float().cpu()
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for w, e in zip(weights[t].tolist(), ids[t].tolist(), strict=True):
            h = act(w13[e, :INTER] @ x[t]) * (w13[e, INTER:] @ x[t])
            out[t] += w * (w2[e] @ h)
    return out


def _experts(
    w13: torch.Tensor, w2: torch.Tensor, kernel: str, activation: str, tp: TensorParallel = SINGLE
) -> Experts:
    def read(e: int, cols: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        a, b = cols
        return w13[e, a:b], w13[e, INTER + a : INTER + b], w2[e, :, a:b]

    return Experts(read, EXPERTS, INTER, tp, activation, kernel)


@pytest.mark.parametrize(
    "routing",
    [IDS, [[0, 1], [2, 3], [4, 5]]],  # the second: every expert one pair, the most padding
)
def test_align_puts_every_pair_once_in_blocks_of_one_expert(routing: list[list[int]]) -> None:
    ids = torch.tensor(routing, device=DEVICE)
    block_m = 4
    layout = align(ids, EXPERTS, block_m)
    total = ids.numel()
    assert layout.pairs.numel() == capacity(total, EXPERTS, block_m)
    pairs = layout.pairs.cpu().view(-1, block_m)
    experts = layout.block_experts.cpu().tolist()
    flat = ids.reshape(-1).cpu()
    seen: list[int] = []
    for block, expert in zip(pairs.tolist(), experts, strict=True):
        real = [p for p in block if p < total]
        if expert == EXPERTS:  # past the last expert's blocks: padding only
            assert not real
            continue
        assert real == sorted(real) and real, (block, expert)  # stable: in token order
        assert all(int(flat[p]) == expert for p in real)
        seen += real
    assert sorted(seen) == list(range(total))
    assert experts == sorted(experts)  # expert order


@pytest.mark.parametrize("activation", ["silu", "gelu", "gelu_tanh"])
def test_fused_equals_the_grouped_path_and_the_reference(activation: str) -> None:
    x, weights, ids, w13, w2 = _problem(len(IDS), torch.float32)
    fused = fused_moe_with(x, weights, ids, w13, w2, Gating(activation), SMALL)
    grouped = _experts(w13, w2, "grouped", activation)(x, weights, ids)
    torch.testing.assert_close(fused, grouped, rtol=1e-5, atol=1e-5)
    expected = _reference(x, weights, ids, w13, w2, activation)
    torch.testing.assert_close(fused.cpu(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16_bit_weights_and_a_batch_of_one(dtype: torch.dtype) -> None:
    """The default tiles (through ``Experts``' ``triton`` kernel and the operator), one token
    and all tokens, within the dtype's rounding of the float32 reference."""
    x, weights, ids, w13, w2 = _problem(len(IDS), dtype, seed=1)
    fused = _experts(w13, w2, "triton", "silu")
    grouped = _experts(w13, w2, "grouped", "silu")
    for rows in (slice(0, 1), slice(None)):
        got = fused(x[rows], weights[rows], ids[rows])
        assert got.dtype == dtype and got.shape == x[rows].shape
        expected = _reference(x[rows], weights[rows], ids[rows], w13, w2, "silu")
        torch.testing.assert_close(got.float().cpu(), expected, rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(
            got.float(), grouped(x[rows], weights[rows], ids[rows]).float(), rtol=2e-2, atol=2e-2
        )


def test_tensor_parallel_slices_add_up() -> None:
    x, weights, ids, w13, w2 = _problem(len(IDS), torch.float32, seed=2)
    whole = _experts(w13, w2, "triton", "silu")(x, weights, ids)
    parts = [
        _experts(w13, w2, "triton", "silu", TensorParallel(rank, world_size=2)) for rank in (0, 1)
    ]
    assert [part.w13.shape[1] for part in parts] == [INTER, INTER]  # type: ignore[union-attr]
    total = parts[0](x, weights, ids) + parts[1](x, weights, ids)
    torch.testing.assert_close(total, whole, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(whole.cpu(), _reference(x, weights, ids, w13, w2, "silu"))


def test_clamped_swiglu_with_biases() -> None:
    """gpt-oss's experts: biases on gate/up and down, gate clamped above, up both sides
    (a limit small enough to clamp), ``(up + 1) * gate * sigmoid(alpha * gate)``."""
    x, weights, ids, w13, w2 = _problem(len(IDS), torch.float32, seed=3)
    g = torch.Generator().manual_seed(4)
    b13 = torch.randn(EXPERTS, 2 * INTER, generator=g).to(DEVICE)
    b2 = torch.randn(EXPERTS, HIDDEN, generator=g).to(DEVICE)
    alpha, limit = 1.702, 0.5
    got = torch.ops.tgis.fused_moe(
        x, weights, ids, w13, w2, "clamped_swiglu", b13, b2, alpha, limit
    )
    expected = torch.zeros(x.shape)
    cpu = [t.cpu() for t in (x, w13, w2, b13, b2)]
    for t in range(x.shape[0]):
        for w, e in zip(weights[t].tolist(), ids[t].tolist(), strict=True):
            xt, w13e, w2e, b13e, b2e = cpu[0][t], cpu[1][e], cpu[2][e], cpu[3][e], cpu[4][e]
            gate = (w13e[:INTER] @ xt + b13e[:INTER]).clamp(max=limit)
            up = (w13e[INTER:] @ xt + b13e[INTER:]).clamp(-limit, limit)
            h = gate * torch.sigmoid(alpha * gate) * (up + 1)
            expected[t] += w * (w2e @ h + b2e)
    assert (w13[:, :INTER] @ x[0].view(-1, 1)).abs().max() > limit  # the clamp bites
    torch.testing.assert_close(got.cpu(), expected, rtol=1e-5, atol=1e-5)


def test_gpt_oss_experts_equal_the_grouped_path() -> None:
    """``Experts`` with biases and a ``ClampedSwiGLU`` on the fused kernels (TP=1, and TP=2
    whose partial sums, the down bias on rank 0 alone, add up) and through the compiled
    step's operator = the grouped path's."""
    x, weights, ids, w13, w2 = _problem(len(IDS), torch.float32, seed=5)
    g = torch.Generator().manual_seed(6)
    b13 = torch.randn(EXPERTS, 2 * INTER, generator=g).to(DEVICE)
    b2 = torch.randn(EXPERTS, HIDDEN, generator=g).to(DEVICE)

    def read(e: int, cols: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        a, b = cols
        return w13[e, a:b], w13[e, INTER + a : INTER + b], w2[e, :, a:b]

    def biases(e: int, cols: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        a, b = cols
        return b13[e, a:b], b13[e, INTER + a : INTER + b], b2[e]

    glu = ClampedSwiGLU(alpha=1.702, limit=0.5)

    def experts(kernel: str, tp: TensorParallel = SINGLE) -> Experts:
        return Experts(read, EXPERTS, INTER, tp, "silu", kernel, biases=biases, glu=glu)

    grouped = experts("grouped")
    expected = grouped(x, weights, ids)
    torch.testing.assert_close(experts("triton")(x, weights, ids), expected, rtol=1e-5, atol=1e-5)
    # the compiled step's form of the grouped path: the operator tgis::grouped_moe
    torch.testing.assert_close(grouped._grouped_operator(x, weights, ids), expected)
    ranks = [experts("triton", TensorParallel(rank, world_size=2)) for rank in (0, 1)]
    assert ranks[0].b2 is not None and ranks[1].b2 is None
    total = ranks[0](x, weights, ids) + ranks[1](x, weights, ids)
    torch.testing.assert_close(total, expected, rtol=1e-5, atol=1e-5)
