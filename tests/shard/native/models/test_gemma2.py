"""Gemma 2 beyond the shared family checks (test_families.py runs its ``gemma2`` variant on
the default CPU backend, cpu_paged, whose C kernel soft-caps the decode scores): the torch
reference backend, the refusal of a backend that cannot soft-cap, that the tiny model's
tokens depend on what the oracle is meant to check, and the config's defaults."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from tests.shard.driving import Router
from tests.shard.families import FAMILIES, NEW_TOKENS, PROMPTS, Family
from tests.shard.models import TinyModel
from tests.shard.native.models.test_families import MAX_SEQUENCE_LENGTH, make_runner
from tgis.shard.checkpoints.model_config import ModelConfig
from tgis.shard.config import EngineSettings
from tgis.shard.errors import StartupError
from tgis.shard.native.models.gemma2 import Gemma2ForCausalLM

GEMMA2 = FAMILIES["gemma2"]


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    path = tmp_path_factory.mktemp("gemma2")
    return TinyModel(path, GEMMA2.build(path))


def test_torch_paged_matches_hf(gemma2: TinyModel) -> None:
    """The reference backend soft-caps prompts and decodes alike (an explicit softmax)."""
    router = Router(
        make_runner(gemma2.path, engine=EngineSettings(attention_backend="torch_paged"))
    )
    assert router.runner.info.attention_backend == "torch_paged"
    for rid, prompt in PROMPTS.items():
        router.add(rid, prompt)
    router.step({rid: len(p) for rid, p in PROMPTS.items()})
    for _ in range(NEW_TOKENS - 1):
        router.decode(PROMPTS)
    for rid, prompt in PROMPTS.items():
        assert router.generated[rid] == gemma2.greedy(prompt, NEW_TOKENS)[0], rid


def test_a_backend_that_cannot_soft_cap_is_refused_at_start_up(gemma2: TinyModel) -> None:
    with pytest.raises(StartupError, match="sdpa_varlen attention backend cannot do"):
        make_runner(gemma2.path, engine=EngineSettings(attention_backend="sdpa_varlen"))


@pytest.mark.parametrize(
    "change",
    [dict(attn_logit_softcapping=None), dict(sliding_window=1000)],
    ids=["no-attention-softcap", "no-window"],
)
def test_the_oracle_tokens_depend_on_the_option(
    gemma2: TinyModel, change: dict[str, object], tmp_path: Path
) -> None:
    """Without the attention soft-cap, or without the window, transformers' greedy tokens
    for the family's prompts differ: test_families.py's oracle checks both. (The final
    logit soft-cap is monotonic, so it never changes greedy tokens: the oracle's logprobs,
    within 1e-4, check it.)"""
    other = Family(GEMMA2.config_class, GEMMA2.model_class, {**GEMMA2.params, **change})
    changed = TinyModel(tmp_path, other.build(tmp_path))
    prompt = PROMPTS[3]  # longer than the window
    assert changed.greedy(prompt, NEW_TOKENS)[0] != gemma2.greedy(prompt, NEW_TOKENS)[0]


def test_config_defaults(gemma2: TinyModel) -> None:
    """A config without ``layer_types`` (Gemma 2's checkpoints) slides the even layers;
    the scale, the soft-caps and the embedding scale are read."""
    raw = json.loads((gemma2.path / "config.json").read_text())
    raw.pop("layer_types")
    config = dataclasses.replace(ModelConfig.from_dir(gemma2.path), raw=raw)
    args = Gemma2ForCausalLM.variant_args(config, MAX_SEQUENCE_LENGTH)
    assert args.llama.windows == (8, None)
    assert args.llama.attention_scale == pytest.approx(24**-0.5)
    assert (args.attn_softcap, args.final_softcap) == (2.0, 4.0)
    assert args.embedding_scale == pytest.approx(8.0)
    raw["hidden_activation"] = "relu"
    with pytest.raises(StartupError, match="unsupported hidden_activation 'relu'"):
        Gemma2ForCausalLM.variant_args(dataclasses.replace(config, raw=raw), MAX_SEQUENCE_LENGTH)
