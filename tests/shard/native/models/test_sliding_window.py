"""Sliding-window families against transformers, with windows of 8 keys (``families.py``)
and prompts longer than the window: Mistral, Mixtral, Phi-3 and Starcoder2 (every layer
slides), Qwen2 and Qwen3 (the layers from ``max_window_layers`` on; layer 0 attends to
everything).

The family tests (``test_families.py``) already run them batched, with chunked prefill
joining a decode and with a prompt-tuning prefix; here: the window changes transformers'
tokens (so the oracle checks it), chunks and prefix-cache hits cut across the window's
edge, speculative decoding verifies drafts inside it, and every CPU-runnable backend
(Triton's in its interpreter) gives the same tokens.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import transformers

from tests.shard.driving import Router
from tests.shard.families import FAMILIES, NEW_TOKENS, PROMPTS, assert_matches_hf, prompt_of
from tests.shard.models import TinyModel
from tests.shard.native.models.test_families import generate_batch, make_runner
from tgis.shard.config import EngineSettings
from tgis.shard_api.messages import DetailOptions

WINDOWED = (
    "mistral-window",
    "qwen2-window",
    "qwen3-window",
    "phi3-window",
    "mixtral-window",
    "starcoder2-window",
)
LONG = prompt_of(40, 14)  # five windows, two and a half blocks


@pytest.fixture(scope="module", params=WINDOWED)
def windowed(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp(request.param)
    return TinyModel(path, FAMILIES[request.param].build(path))


def test_the_window_changes_transformers_tokens(windowed: TinyModel) -> None:
    """Without its window the same checkpoint generates other tokens for the prompts
    longer than the window, so matching transformers checks the window."""
    config: Any = transformers.AutoConfig.from_pretrained(windowed.path)
    config.sliding_window = None
    if getattr(config, "layer_types", None):
        config.layer_types = ["full_attention"] * len(config.layer_types)
    full: Any = transformers.AutoModelForCausalLM.from_pretrained(windowed.path, config=config)
    full.eval()
    full.generation_config.eos_token_id = None
    unwindowed = TinyModel(windowed.path, full)
    for prompt in (PROMPTS[2], PROMPTS[3], LONG):
        assert windowed.greedy(prompt, NEW_TOKENS)[0] != unwindowed.greedy(prompt, NEW_TOKENS)[0]


def test_a_long_prompt_matches_hf(windowed: TinyModel) -> None:
    prompts = {1: LONG, 2: PROMPTS[1]}
    assert_matches_hf(generate_batch(windowed.path, prompts), windowed, prompts)


@pytest.mark.parametrize("chunks", [(7, 1, 8, 24), (8, 8, 8, 16), (17, 23), (1,) * 9 + (31,)])
def test_chunks_across_the_window_match_hf(windowed: TinyModel, chunks: tuple[int, ...]) -> None:
    """The long prompt in chunks ending before, at and after the window's and the blocks'
    edges (single tokens among them), next to a decoding sequence."""
    router = Router(make_runner(windowed.path), seed=2)
    router.add(2, PROMPTS[2])
    router.step({2: len(PROMPTS[2])})
    router.add(1, LONG)
    for chunk in chunks:
        router.step({1: chunk, 2: 1})
    for _ in range(NEW_TOKENS - 1):
        router.decode([1, 2])
    assert router.generated[1] == windowed.greedy(LONG, NEW_TOKENS)[0]
    assert router.generated[2] == windowed.greedy(PROMPTS[2], NEW_TOKENS + len(chunks))[0]


@pytest.mark.parametrize("blocks", [1, 2])
def test_prefix_cache_hits_match_hf(windowed: TinyModel, blocks: int) -> None:
    """A second prompt sharing the first one's leading blocks starts after them: its first
    chunk's queries see cached keys inside their window, and none before it."""
    router = Router(make_runner(windowed.path))
    router.add(1, LONG)
    router.step({1: len(LONG)})
    other = LONG[: blocks * router.block_size] + prompt_of(11, 15)
    router.add(2, other)
    router.share(2, 1, blocks)
    router.step({2: len(other) - blocks * router.block_size, 1: 1})
    for _ in range(NEW_TOKENS - 1):
        router.decode([1, 2])
    assert router.generated[2] == windowed.greedy(other, NEW_TOKENS)[0]
    assert router.generated[1] == windowed.greedy(LONG, NEW_TOKENS + 1)[0]


def test_speculative_decoding_matches_hf(windowed: TinyModel) -> None:
    """Drafts of 3 and 9 tokens (more than the window), right and wrong, are verified in
    one multi-token step each: the accepted tokens are transformers' greedy ones."""
    expected = windowed.greedy(LONG, 32)[0]
    router = Router(make_runner(windowed.path))
    router.add(1, LONG)
    router.step({1: len(LONG)})
    accepted, steps = 0, 0
    while (done := len(router.generated[1])) < 20:
        drafts = list(expected[done : done + (9 if steps % 2 else 3)])
        if steps % 3 == 2:
            drafts[-1] = (drafts[-1] + 1) % 256  # the last draft is wrong
        router.speculate({1: drafts})
        accepted += len(router.generated[1]) - done - 1
        steps += 1
    assert router.generated[1] == expected[: len(router.generated[1])]
    assert accepted > steps  # most drafts were accepted


@pytest.mark.parametrize("backend", ["torch_paged", "sdpa_varlen", "triton_paged"])
def test_other_backends_match_hf(
    windowed: TinyModel, backend: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The default CPU backend runs above; the others give the same tokens, prompts and
    decodes (Triton under TRITON_INTERPRET=1, which tests/conftest.py sets without a GPU)."""
    if backend == "triton_paged":
        pytest.importorskip("triton")
    engine = EngineSettings(attention_backend=backend)
    router = Router(make_runner(windowed.path, engine=engine))
    assert router.runner.info.attention_backend == backend
    prompts = {1: LONG, 2: PROMPTS[2]}
    for rid, prompt in prompts.items():
        router.add(rid, prompt)
    router.step({1: 19, 2: len(PROMPTS[2])})
    router.step({1: len(LONG) - 19, 2: 1})
    for _ in range(5):
        router.decode(list(prompts))
    assert router.generated[1] == windowed.greedy(LONG, 6)[0]
    assert router.generated[2] == windowed.greedy(PROMPTS[2], 7)[0]


@pytest.mark.slow
def test_the_compiled_step_equals_transformers(tmp_path: Path) -> None:
    """The compiled forward passes each layer's window and soft-cap to its attention op
    (Gemma 2: a sliding layer and a global one, both soft-capped, and Gemma's norms, GeGLU
    and final logit cap inside the compiled graph)."""
    from tests.shard.native.graphs.test_compiled import runner_for

    model = TinyModel(tmp_path, FAMILIES["gemma2"].build(tmp_path))
    router = Router(runner_for(tmp_path, compiled=True))
    prompts = {1: LONG, 2: PROMPTS[2]}
    for rid, prompt in prompts.items():
        router.add(rid, prompt)
    router.step({1: 13, 2: len(PROMPTS[2])})
    router.step({1: len(LONG) - 13, 2: 1})
    for _ in range(5):
        router.decode(list(prompts))
    assert router.generated[1] == model.greedy(LONG, 6)[0]
    assert router.generated[2] == model.greedy(PROMPTS[2], 7)[0]


@pytest.mark.slow  # starts tensor-parallel rank processes
def test_two_ranks_match_one(tmp_path: Path) -> None:
    """Each rank attends through the window over its own KV heads: TP=2 equals TP=1, a
    chunk of 12 crossing the window included."""
    from tests.shard.tp_utils import Request, assert_same_outputs, make_plans, run_plans

    FAMILIES["mistral-window"].build(tmp_path)
    details = DetailOptions(logprobs=True, ranks=True, top_n=2, generated_tokens=True)
    plans = make_plans(
        [
            Request(1, tuple(LONG), 5, details=details, chunk=12),
            Request(2, tuple(PROMPTS[2]), 4, details=details, arrives=1),
        ]
    )
    single = run_plans(tmp_path, plans, world_size=1, max_sequence_length=256)[0]
    reports = run_plans(tmp_path, plans, world_size=2, max_sequence_length=256)
    assert not any(isinstance(o, str) for o in single.outputs), single.outputs
    assert sum(len(o.tokens) for o in reports[0].outputs if not isinstance(o, str)) == 9
    assert_same_outputs(single.outputs, reports[0].outputs)
    assert reports[1].worker_error is None
