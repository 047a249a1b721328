"""On a CUDA device (skipped elsewhere; ``benchmarks/gpu_check.sh`` runs the tests marked
``gpu``): the mixture-of-experts families give transformers' greedy tokens eagerly, and a
runner started with the defaults (compiled step, CUDA graphs, each falling back to the
eager step where the experts' grouping cannot be captured) gives the same tokens."""

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

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def generate(runner: object) -> Router:
    return prefill_then_decode(runner, PROMPTS, NEW_TOKENS)


@pytest.mark.parametrize("name", ["mixtral", "qwen3-moe", "qwen2-moe", "granite-moe"])
def test_moe_families_match_hf_on_cuda(name: str, tmp_path: Path) -> None:
    model = TinyModel(tmp_path, FAMILIES[name].build(tmp_path))
    eager = generate(cuda_runner(tmp_path))
    config = ShardConfig(model_name=str(tmp_path), dtype="float32", kv_cache_blocks=96)
    defaults = generate(load_runner(config))  # TGIS_COMPILE and TGIS_CUDA_GRAPHS auto
    for rid, prompt in PROMPTS.items():
        expected = model.greedy(prompt, NEW_TOKENS)[0]
        assert eager.generated[rid] == expected, (name, rid)
        assert defaults.generated[rid] == expected, (name, rid)
