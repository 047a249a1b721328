"""On a CUDA device (skipped elsewhere; ``benchmarks/gpu_check.sh`` runs the tests marked
``gpu``): the fused Triton experts (``linear/moe_triton.py``) equal the grouped path at real
sizes and inside a CUDA graph; the mixture-of-experts families give transformers' greedy
tokens eagerly, and a runner started with the defaults compiles the step and captures CUDA
graphs (no fallback to the eager step) and gives the same tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.shard.cuda import cuda_runner, no_tf32  # noqa: F401 - the fixture
from tests.shard.driving import Router, prefill_then_decode
from tests.shard.families import FAMILIES, NEW_TOKENS, PROMPTS
from tests.shard.models import TinyModel
from tgis.shard.config import ShardConfig
from tgis.shard.loader import load_runner
from tgis.shard.native.graphs.compiled import CompiledForward
from tgis.shard.native.linear.moe import Experts
from tgis.shard.native.runtime.model_runner import ModelRunner
from tgis.shard.parallel.group import SINGLE

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def generate(runner: object) -> Router:
    return prefill_then_decode(runner, PROMPTS, NEW_TOKENS)


@pytest.mark.parametrize("name", ["mixtral", "qwen3-moe", "qwen2-moe", "granite-moe", "gpt-oss"])
def test_moe_families_match_hf_on_cuda(name: str, tmp_path: Path) -> None:
    model = TinyModel(tmp_path, FAMILIES[name].build(tmp_path))
    eager = generate(cuda_runner(tmp_path, graphs="0"))
    config = ShardConfig(model_name=str(tmp_path), dtype="float32", kv_cache_blocks=96)
    runner = load_runner(config)  # TGIS_COMPILE and TGIS_CUDA_GRAPHS auto
    assert isinstance(runner, ModelRunner)
    assert isinstance(runner.forward, CompiledForward)  # compiled, not fallen back
    assert runner.graph_sets  # decode graphs captured
    defaults = generate(runner)
    for rid, prompt in PROMPTS.items():
        expected = model.greedy(prompt, NEW_TOKENS)[0]
        assert eager.generated[rid] == expected, (name, rid)
        assert defaults.generated[rid] == expected, (name, rid)


HIDDEN, INTER, EXPERTS, TOP_K = 512, 384, 8, 2


def _experts(kernel: str, dtype: torch.dtype) -> Experts:
    g = torch.Generator().manual_seed(0)
    w13 = (torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=g) / HIDDEN**0.5).to("cuda", dtype)
    w2 = (torch.randn(EXPERTS, HIDDEN, INTER, generator=g) / INTER**0.5).to("cuda", dtype)

    def read(e: int, cols: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        a, b = cols
        return w13[e, a:b], w13[e, INTER + a : INTER + b], w2[e, :, a:b]

    return Experts(read, EXPERTS, INTER, SINGLE, "silu", kernel)


def _routing(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=g)
    logits = torch.randn(tokens, EXPERTS, generator=g)
    weights, ids = torch.topk(torch.softmax(logits, dim=-1), TOP_K, dim=-1)
    return x.cuda(), weights.cuda(), ids.cuda()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 37, 700])  # 1,400 pairs: the large row blocks
def test_fused_experts_equal_the_grouped_path(dtype: torch.dtype, tokens: int) -> None:
    fused, grouped = _experts("triton", dtype), _experts("grouped", dtype)
    x, weights, ids = _routing(tokens, seed=tokens)
    x = x.to(dtype)
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(
        fused(x, weights, ids).float(),
        grouped(x, weights, ids).float(),
        rtol=tolerance,
        atol=tolerance,
    )


def test_fused_experts_replay_in_a_cuda_graph() -> None:
    """Captured once, replayed on other routings: no host reads, no shapes from the data."""
    fused, grouped = _experts("triton", torch.bfloat16), _experts("grouped", torch.bfloat16)
    x, weights, ids = _routing(16, seed=1)
    x = x.bfloat16()
    fused(x, weights, ids)  # compiles the kernels before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused(x, weights, ids)
    for seed in (2, 3):
        new_x, new_weights, new_ids = _routing(16, seed)
        new_ids[0] = new_ids[0, 0]  # one token routed to one expert twice
        x.copy_(new_x.bfloat16())
        weights.copy_(new_weights)
        ids.copy_(new_ids)
        graph.replay()
        expected = grouped(x, weights, ids)
        torch.testing.assert_close(out.float(), expected.float(), rtol=3e-2, atol=3e-2)
