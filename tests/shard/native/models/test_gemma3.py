"""Gemma 3 beyond the shared family checks (test_families.py runs its ``gemma3`` variant):
that the tiny model's tokens depend on what the oracle is meant to check, the published
configs' older keys and omitted defaults, and the vision-language checkpoints
(``Gemma3ForConditionalGeneration``) served as their language model."""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tests.shard.driving import Router
from tests.shard.families import (
    _COMMON,
    FAMILIES,
    NEW_TOKENS,
    PROMPTS,
    Family,
    _randomise,
    assert_matches_hf,
)
from tests.shard.models import TinyModel
from tests.shard.native.models.test_families import (
    MAX_SEQUENCE_LENGTH,
    generate_batch,
    make_runner,
)
from tgis.shard.checkpoints.model_config import ModelConfig
from tgis.shard.errors import StartupError
from tgis.shard.native.models import model_class
from tgis.shard.native.models.gemma3 import Gemma3ForCausalLM

GEMMA3 = FAMILIES["gemma3"]
TINY_VISION: dict[str, Any] = dict(
    hidden_size=32,
    intermediate_size=32,
    num_hidden_layers=1,
    num_attention_heads=2,
    image_size=28,
    patch_size=14,
)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    path = tmp_path_factory.mktemp("gemma3")
    return TinyModel(path, GEMMA3.build(path))


@pytest.mark.parametrize(
    "change",
    [
        dict(rope_local_base_freq=10000.0),
        dict(rope_theta=100.0),
        dict(rope_scaling=None),
        dict(sliding_window=1000),
    ],
    ids=["local-base-as-global", "global-base-as-local", "global-unscaled", "no-window"],
)
def test_the_oracle_tokens_depend_on_the_option(
    gemma3: TinyModel, change: dict[str, object], tmp_path: Path
) -> None:
    """With the sliding layers' rope base the global one's (or the global layers' base the
    local one's, or their rope unscaled), or without the window, transformers' greedy
    tokens differ: test_families.py's oracle checks each. (The final logit soft-cap is
    monotonic: the oracle's logprobs, within 1e-4, check it.)"""
    other = Family(GEMMA3.config_class, GEMMA3.model_class, {**GEMMA3.params, **change})
    changed = TinyModel(tmp_path, other.build(tmp_path))
    prompt = PROMPTS[3]  # longer than the window
    assert changed.greedy(prompt, NEW_TOKENS)[0] != gemma3.greedy(prompt, NEW_TOKENS)[0]


def test_the_oracle_tokens_depend_on_the_qk_norms(gemma3: TinyModel, tmp_path: Path) -> None:
    """Without its q/k norms the same model's greedy tokens differ."""
    hf: Any = GEMMA3.build(tmp_path)
    for layer in hf.model.layers:
        layer.self_attn.q_norm = layer.self_attn.k_norm = torch.nn.Identity()
    prompt = PROMPTS[3]
    assert (
        TinyModel(tmp_path, hf).greedy(prompt, NEW_TOKENS)[0]
        != gemma3.greedy(prompt, NEW_TOKENS)[0]
    )


def _published_keys(config: dict[str, Any]) -> None:
    """The published configs' keys (gemma-3-1b's config.json): rope_theta,
    rope_local_base_freq and rope_scaling instead of rope_parameters, the layers by
    sliding_window_pattern instead of layer_types."""
    ropes = config.pop("rope_parameters")
    full, local = ropes["full_attention"], ropes["sliding_attention"]
    config.update(
        rope_theta=full.pop("rope_theta"),
        rope_local_base_freq=local["rope_theta"],
        rope_scaling=full,
        sliding_window_pattern=2,
    )
    del config["layer_types"]


def test_published_config_keys_match_hf(gemma3: TinyModel, tmp_path: Path) -> None:
    shutil.copytree(gemma3.path, tmp_path / "older")
    path = tmp_path / "older" / "config.json"
    config = json.loads(path.read_text())
    _published_keys(config)
    path.write_text(json.dumps(config))
    prompts = {3: PROMPTS[3]}
    assert_matches_hf(generate_batch(tmp_path / "older", prompts), gemma3, prompts)


def test_omitted_fields_take_gemma3_text_configs_defaults(tmp_path: Path) -> None:
    """A 4B-style config: the text config gives only what differs from Gemma3TextConfig."""
    text = dict(
        model_type="gemma3_text",
        hidden_size=2560,
        num_hidden_layers=8,
        rope_scaling=dict(rope_type="linear", factor=8.0),
        sliding_window=1024,
    )
    outer = dict(
        architectures=["Gemma3ForConditionalGeneration"],
        model_type="gemma3",
        eos_token_id=[1, 106],
        torch_dtype="bfloat16",
        text_config=text,
        vision_config=dict(model_type="siglip_vision_model"),
    )
    (tmp_path / "config.json").write_text(json.dumps(outer))
    config = ModelConfig.from_dir(tmp_path)
    assert (config.architecture, config.model_type) == ("Gemma3ForConditionalGeneration", "gemma3")
    assert (config.vocab_size, config.max_position_embeddings) == (262_208, 131_072)
    assert (config.eos_token_ids, config.torch_dtype) == ((1, 106), "bfloat16")
    args = model_class(config).variant_args(config, 4096)  # type: ignore[attr-defined]
    llama = args.llama
    assert (llama.num_heads, llama.num_kv_heads, llama.head_dim) == (8, 4, 256)
    assert llama.attention_scale == pytest.approx(256**-0.5)
    assert llama.tie_word_embeddings
    assert llama.windows == (1024,) * 5 + (None,) + (1024,) * 2  # layer 5 is global
    assert args.local_rope_layers == (0, 1, 2, 3, 4, 6, 7)
    assert (llama.rope["rope_type"], llama.rope["factor"]) == ("linear", 8.0)
    assert llama.rope["rope_theta"] == 1_000_000.0
    assert args.local_rope is not None
    assert (args.local_rope["rope_type"], args.local_rope["rope_theta"]) == ("default", 10_000.0)
    assert (args.attn_softcap, args.final_softcap) == (None, None)


def test_a_window_past_the_sequence_length_keeps_the_local_rope(gemma3: TinyModel) -> None:
    config = ModelConfig.from_dir(gemma3.path)
    args = Gemma3ForCausalLM.variant_args(config, 4)  # a window of 8 hides nothing
    assert args.llama.windows == ()
    assert args.local_rope_layers == (0,)


def test_bidirectional_attention_is_refused(gemma3: TinyModel) -> None:
    config = ModelConfig.from_dir(gemma3.path)
    raw = dict(config.raw, use_bidirectional_attention=True)
    with pytest.raises(StartupError, match="use_bidirectional_attention is not supported"):
        Gemma3ForCausalLM.variant_args(dataclasses.replace(config, raw=raw), 64)


# ---- Gemma3ForConditionalGeneration: the language model of a vision-language checkpoint --


@pytest.fixture(scope="module")
def conditional(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    """A tiny vision-language Gemma 3 whose untied LM head the outer config says (its
    text config's default ties it), saved by transformers."""
    path = tmp_path_factory.mktemp("gemma3-conditional")
    config = transformers.Gemma3Config(
        text_config=dict(_COMMON, **GEMMA3.params),
        vision_config=TINY_VISION,
        mm_tokens_per_image=4,
        eos_token_id=_COMMON["eos_token_id"],
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    _randomise(model)
    model.save_pretrained(path)
    model.generation_config.eos_token_id = None  # the reference never stops early
    return TinyModel(path, model)


def test_conditional_generation_serves_its_language_model(
    conditional: TinyModel, caplog: pytest.LogCaptureFixture
) -> None:
    """Text-only greedy tokens as transformers' ``generate`` without images."""
    prompts = {1: PROMPTS[1], 3: PROMPTS[3]}
    with caplog.at_level(logging.INFO, logger="tgis.shard.native.models.gemma3"):
        router = generate_batch(conditional.path, prompts)
    assert "images are not served" in caplog.text
    assert_matches_hf(router, conditional, prompts)


def test_conditional_generation_with_transformers_module_names(
    conditional: TinyModel, tmp_path: Path
) -> None:
    """A checkpoint with transformers' module names (``model.language_model.*``,
    ``lm_head``) reads as the published names (``language_model.model.*``)."""
    shutil.copytree(conditional.path, tmp_path / "renamed")
    file = tmp_path / "renamed" / "model.safetensors"
    renames = {"language_model.model.": "model.language_model.", "language_model.lm_": "lm_"}
    tensors = {}
    for name, tensor in load_file(file).items():
        for old, new in renames.items():
            name = new + name.removeprefix(old) if name.startswith(old) else name
        tensors[name] = tensor
    assert "lm_head.weight" in tensors and "model.language_model.norm.weight" in tensors
    save_file(tensors, file)
    router = Router(make_runner(tmp_path / "renamed"))
    router.add(3, PROMPTS[3])
    router.step({3: len(PROMPTS[3])})
    for _ in range(NEW_TOKENS - 1):
        router.decode([3])
    assert router.generated[3] == conditional.greedy(PROMPTS[3], NEW_TOKENS)[0]


def test_conditional_generation_dummy_load(conditional: TinyModel, tmp_path: Path) -> None:
    """``checkpoint_shapes`` are the checkpoint's language-model tensors (never the vision
    tower's), and ``--load-format dummy`` runs from the config alone."""
    config = ModelConfig.from_dir(conditional.path)
    shapes = model_class(config).checkpoint_shapes(config, MAX_SEQUENCE_LENGTH)
    with safe_open(str(conditional.path / "model.safetensors"), "pt") as f:
        stored = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118
    assert shapes == {k: v for k, v in stored.items() if k.startswith("language_model.")}
    (tmp_path / "dummy").mkdir()
    shutil.copy(conditional.path / "config.json", tmp_path / "dummy" / "config.json")
    router = Router(make_runner(tmp_path / "dummy", load_format="dummy"))
    router.add(1, PROMPTS[2])
    router.step({1: len(PROMPTS[2])})
    router.decode([1])
    assert len(router.generated[1]) == 2
