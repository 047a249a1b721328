"""``linear/moe.py`` against a per-token reference: routing (softmax, top-k, renormalised or
not), the grouped experts (sorted by expert, one GEMM each, index_add back), the shared
expert, and each tensor-parallel rank's partial sum adding up to the whole."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tgis.shard.native.linear.moe import Experts, Routing
from tgis.shard.parallel.group import SINGLE, TensorParallel

HIDDEN, INTER, EXPERTS = 16, 12, 5


def _matrices(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    gate = torch.randn(EXPERTS, INTER, HIDDEN, generator=g)
    up = torch.randn(EXPERTS, INTER, HIDDEN, generator=g)
    down = torch.randn(EXPERTS, HIDDEN, INTER, generator=g)
    return gate, up, down


def _experts(tp: TensorParallel = SINGLE) -> Experts:
    gate, up, down = _matrices()

    def read(e: int, cols: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        a, b = cols
        return gate[e, a:b], up[e, a:b], down[e, :, a:b]

    return Experts(read, EXPERTS, INTER, tp, "silu")


def _reference(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Token by token, expert by expert."""
    gate, up, down = _matrices()
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for w, e in zip(weights[t].tolist(), ids[t].tolist(), strict=True):
            h = F.silu(gate[e] @ x[t]) * (up[e] @ x[t])
            out[t] += w * (down[e] @ h)
    return out


def test_routing_normalisations() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 3.0]])
    probs = torch.softmax(logits, dim=-1)
    weights, ids = Routing(EXPERTS, 2, renormalize=False)(logits)
    assert ids.tolist() == [[4, 0]]
    torch.testing.assert_close(weights, probs[:, [4, 0]])
    weights, _ = Routing(EXPERTS, 2, renormalize=True)(logits)
    # renormalised top-k softmax = softmax over the top-k logits (Granite-MoE's form)
    torch.testing.assert_close(weights, torch.softmax(logits[:, [4, 0]], dim=-1))


def test_grouped_experts_equal_the_per_token_reference() -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(9, HIDDEN, generator=g)
    weights, ids = Routing(EXPERTS, 2, renormalize=False)(torch.randn(9, EXPERTS, generator=g))
    ids[0] = torch.tensor([3, 3 - 1])  # an expert with one token; expert 4 perhaps none
    got = _experts()(x, weights, ids)
    torch.testing.assert_close(got, _reference(x, weights, ids), rtol=1e-5, atol=1e-4)


def test_unrouted_experts_do_not_run() -> None:
    experts = _experts()
    calls: list[int] = []
    experts.gate_up = [_Calls(linear, e, calls) for e, linear in enumerate(experts.gate_up)]  # type: ignore[misc]
    ids = torch.tensor([[1, 3], [3, 1], [1, 3], [3, 1]])
    experts(torch.randn(4, HIDDEN), torch.full((4, 2), 0.5), ids)
    assert sorted(calls) == [1, 3]


class _Calls:
    def __init__(self, linear: object, expert: int, calls: list[int]) -> None:
        self.linear, self.expert, self.calls = linear, expert, calls

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append(self.expert)
        assert x.shape[0] == 4  # every token routed to it, in one GEMM
        return self.linear(x)  # type: ignore[operator]


def test_tensor_parallel_partial_sums_add_up() -> None:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(6, HIDDEN, generator=g)
    weights, ids = Routing(EXPERTS, 2, renormalize=True)(torch.randn(6, EXPERTS, generator=g))
    whole = _experts()(x, weights, ids)
    parts = [_experts(TensorParallel(rank, world_size=2))(x, weights, ids) for rank in (0, 1)]
    torch.testing.assert_close(parts[0] + parts[1], whole, rtol=1e-5, atol=1e-4)
