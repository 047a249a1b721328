"""On a CUDA device (skipped elsewhere; ``benchmarks/gpu_check.sh`` runs the tests marked
``gpu``): Qwen3, OLMo 2, Phi-3 (LongRoPE, partial rotary) and Qwen2 with YaRN give
transformers' greedy tokens with the default CUDA backend, eagerly and compiled (the step
as ``torch.compile`` captures it, with CUDA graphs for the decodes)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.shard.cuda import cuda_runner, no_tf32  # noqa: F401 - the fixture
from tests.shard.driving import Router, prefill_then_decode
from tests.shard.families import FAMILIES, NEW_TOKENS, PROMPTS
from tests.shard.models import TinyModel

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def generate(runner: object) -> Router:
    return prefill_then_decode(runner, PROMPTS, NEW_TOKENS)


@pytest.mark.parametrize("name", ["qwen3", "olmo2", "phi3-longrope", "phi3-partial", "qwen2-yarn"])
def test_variant_families_match_hf_on_cuda(name: str, tmp_path: Path) -> None:
    model = TinyModel(tmp_path, FAMILIES[name].build(tmp_path))
    eager = generate(cuda_runner(tmp_path))
    compiled = generate(cuda_runner(tmp_path, compiled=True))
    for rid, prompt in PROMPTS.items():
        expected = model.greedy(prompt, NEW_TOKENS)[0]
        assert eager.generated[rid] == expected, (name, rid)
        assert compiled.generated[rid] == expected, (name, rid)
