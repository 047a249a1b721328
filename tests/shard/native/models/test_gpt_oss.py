"""gpt-oss beyond the shared family checks (test_families.py runs its ``gpt-oss`` variant on
cpu_paged, whose C kernel adds the sinks to the decode softmax): the tiny model's tokens
depend on what the oracle is meant to check, an MXFP4 checkpoint of it is served as
transformers serves the same values, ``--load-format dummy`` builds it from its checkpoint
layout, and what it cannot run is refused at start-up."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.shard.families import FAMILIES, NEW_TOKENS, PROMPTS, assert_matches_hf
from tests.shard.models import TinyModel
from tests.shard.native.models.test_families import (
    MAX_SEQUENCE_LENGTH,
    generate_batch,
    make_runner,
)
from tgis.shard.checkpoints.model_config import ModelConfig
from tgis.shard.checkpoints.quantized.mxfp4 import E2M1_VALUES, SCALE_BIAS
from tgis.shard.config import EngineSettings
from tgis.shard.errors import StartupError
from tgis.shard.native.models import check_config
from tgis.shard.native.models.gpt_oss import GptOssForCausalLM

GPT_OSS = FAMILIES["gpt-oss"]


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    path = tmp_path_factory.mktemp("gpt-oss")
    return TinyModel(path, GPT_OSS.build(path))


def _no_sinks(hf: Any) -> None:
    for layer in hf.model.layers:
        layer.self_attn.sinks.fill_(-1e4)  # exp(-1e4): no mass


def _no_window(hf: Any) -> None:
    hf.config.layer_types = ["full_attention"] * len(hf.model.layers)


def _no_clamp(hf: Any) -> None:
    for layer in hf.model.layers:
        layer.mlp.experts.limit = 1e4


def _no_biases(hf: Any) -> None:
    for name, p in hf.named_parameters():
        if name.endswith("bias") or name.endswith("proj_bias"):
            p.zero_()


@pytest.mark.parametrize(
    "change",
    [_no_sinks, _no_window, _no_clamp, _no_biases],
    ids=["sinks", "window", "clamp", "biases"],
)
def test_the_oracle_tokens_depend_on_the_option(
    gpt_oss: TinyModel, change: Callable[[Any], None]
) -> None:
    """Without the sinks, the window, the SwiGLU clamp or the biases (q/k/v/o, router,
    experts), transformers' greedy tokens for the family's longest prompt differ: the
    oracle of test_families.py checks each of them."""
    changed = copy.deepcopy(gpt_oss.hf)
    with torch.no_grad():
        change(changed)
    other = TinyModel(gpt_oss.path, changed)
    prompt = PROMPTS[3]  # longer than the window
    assert other.greedy(prompt, NEW_TOKENS)[0] != gpt_oss.greedy(prompt, NEW_TOKENS)[0]


def _to_mxfp4(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A float [..., cols] matrix rounded to MXFP4: (blocks, scales, the values they hold).
    Each block of 32 gets the exponent that brings its largest magnitude within 6, each
    value the nearest E2M1 code."""
    values = torch.tensor(E2M1_VALUES[:8])
    groups = matrix.reshape(*matrix.shape[:-1], -1, 32)
    top = groups.abs().amax(-1).clamp(min=1e-30)
    exponents = torch.ceil(torch.log2(top / 6.0)).clamp(-20, 20)
    scaled = groups / torch.exp2(exponents).unsqueeze(-1)
    codes = (scaled.abs().unsqueeze(-1) - values).abs().argmin(-1)
    codes = codes + 8 * (scaled < 0).long()
    held = torch.tensor(E2M1_VALUES)[codes] * torch.exp2(exponents).unsqueeze(-1)
    pairs = codes.reshape(*codes.shape[:-1], 16, 2)
    blocks = (pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8)
    scales = (exponents + SCALE_BIAS).to(torch.uint8)
    return blocks, scales, held.reshape(matrix.shape)


def test_an_mxfp4_checkpoint_matches_hf_on_its_values(gpt_oss: TinyModel, tmp_path: Path) -> None:
    """The tiny checkpoint with its experts' matrices rounded to MXFP4 and stored as the
    published checkpoints store them (output-major ``_blocks``/``_scales``, config
    ``quant_method: mxfp4``): served as transformers serves the rounded values."""
    hf = copy.deepcopy(gpt_oss.hf)
    tensors = load_file(str(gpt_oss.path / "model.safetensors"))
    for index, layer in enumerate(hf.model.layers):
        experts = layer.mlp.experts
        for name in ("gate_up_proj", "down_proj"):
            key = f"model.layers.{index}.mlp.experts.{name}"
            dense = tensors.pop(key)  # input-major [experts, in, out]
            blocks, scales, held = _to_mxfp4(dense.transpose(1, 2).contiguous())
            tensors[f"{key}_blocks"], tensors[f"{key}_scales"] = blocks, scales
            with torch.no_grad():
                getattr(experts, name).copy_(held.transpose(1, 2))
    for name in ("config.json", "generation_config.json"):
        (tmp_path / name).write_text((gpt_oss.path / name).read_text())
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": []}
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    prompts = {3: PROMPTS[3]}
    rounded = TinyModel(tmp_path, hf)
    assert rounded.greedy(PROMPTS[3], NEW_TOKENS)[0] != gpt_oss.greedy(PROMPTS[3], NEW_TOKENS)[0]
    assert_matches_hf(generate_batch(tmp_path, prompts), rounded, prompts)


def test_checkpoint_shapes_are_the_checkpoint_and_dummy_weights_load(gpt_oss: TinyModel) -> None:
    config = ModelConfig.from_dir(gpt_oss.path)
    shapes = GptOssForCausalLM.checkpoint_shapes(config, MAX_SEQUENCE_LENGTH)
    saved = {
        k: tuple(v.shape) for k, v in load_file(str(gpt_oss.path / "model.safetensors")).items()
    }
    assert shapes == saved
    runner = make_runner(gpt_oss.path, load_format="dummy")
    assert isinstance(runner.model, GptOssForCausalLM)  # type: ignore[attr-defined]


def test_gpt_oss_20b_shape_and_defaults(gpt_oss: TinyModel) -> None:
    """gpt-oss-20b's published config (MXFP4, no layer_types) reads as 24 layers, even
    ones sliding over 128 keys, 32 experts (top 4), yarn rope; its dense layout counts the
    model's ~21B parameters."""
    raw = {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "hidden_size": 2880,
        "intermediate_size": 2880,
        "num_hidden_layers": 24,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "num_local_experts": 32,
        "num_experts_per_tok": 4,
        "vocab_size": 201088,
        "max_position_embeddings": 131072,
        "rope_theta": 150000,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 4096,
        },
        "sliding_window": 128,
        "swiglu_limit": 7.0,
        "tie_word_embeddings": False,
        "quantization_config": {"quant_method": "mxfp4"},
    }
    base = ModelConfig.from_dir(gpt_oss.path)
    config = dataclasses.replace(base, raw=raw, architecture="GptOssForCausalLM", vocab_size=201088)
    args = GptOssForCausalLM.parse_args(config, 4096)
    assert args.llama.windows[:3] == (128, None, 128)
    assert (args.routing.num_experts, args.routing.top_k) == (32, 4)
    assert args.llama.rope["rope_type"] == "yarn" and args.llama.qkv_bias and args.llama.o_bias
    shapes = GptOssForCausalLM.checkpoint_shapes(config, 4096)
    assert 20.5e9 < sum(math.prod(s) for s in shapes.values()) < 21.5e9
    check_config(config, 4096)


@pytest.mark.parametrize(
    ("quantization", "message"),
    [
        ({"quant_method": "gptq", "bits": 4}, "quantization gptq is not supported"),
        ({"quant_method": "fp8"}, "quantization fp8 is not supported"),
    ],
)
def test_other_quantizations_are_refused(
    gpt_oss: TinyModel, quantization: dict[str, Any], message: str
) -> None:
    config = ModelConfig.from_dir(gpt_oss.path)
    raw = {**config.raw, "quantization_config": quantization}
    with pytest.raises(StartupError, match=message):
        check_config(dataclasses.replace(config, raw=raw), MAX_SEQUENCE_LENGTH)


def test_mxfp4_of_another_family_is_refused(tmp_path: Path) -> None:
    FAMILIES["mixtral"].build(tmp_path)
    config = ModelConfig.from_dir(tmp_path)
    raw = {**config.raw, "quantization_config": {"quant_method": "mxfp4"}}
    with pytest.raises(StartupError, match="MXFP4 checkpoints are read for gpt-oss's experts"):
        check_config(dataclasses.replace(config, raw=raw), MAX_SEQUENCE_LENGTH)


def test_a_backend_without_sinks_is_refused_at_start_up(gpt_oss: TinyModel) -> None:
    with pytest.raises(StartupError, match="sdpa_varlen attention backend cannot do"):
        make_runner(gpt_oss.path, engine=EngineSettings(attention_backend="sdpa_varlen"))


@pytest.mark.slow  # starts tensor-parallel rank processes
def test_two_ranks_match_one(tmp_path: Path) -> None:
    """Heads and sinks split by query head, every expert's intermediate dimension split,
    the experts' down bias added once (rank 0's; twice would change the outputs): two ranks
    give one rank's outputs."""
    from tests.shard.native.models.test_families import TP_DETAILS
    from tests.shard.tp_utils import Request, assert_same_outputs, make_plans, run_plans

    GPT_OSS.build(tmp_path)
    plans = make_plans(
        [
            Request(1, tuple(PROMPTS[3]), 5, details=TP_DETAILS, chunk=12),
            Request(2, tuple(PROMPTS[2]), 4, details=TP_DETAILS, arrives=1),
        ]
    )
    config = {"max_sequence_length": MAX_SEQUENCE_LENGTH}
    single = run_plans(tmp_path, plans, world_size=1, **config)[0]
    reports = run_plans(tmp_path, plans, world_size=2, **config)
    assert not any(isinstance(o, str) for o in single.outputs), single.outputs
    assert_same_outputs(single.outputs, reports[0].outputs)
    assert reports[1].worker_error is None
    for name, shape in (("experts.gate_up_proj", (4, 64, 128)), ("experts.down_proj", (4, 64, 64))):
        key = f"model.layers.0.mlp.{name}"
        assert [r.reads.get(key) for r in reports] == [math.prod(shape) // 2] * 2, key
    sinks = "model.layers.0.self_attn.sinks"
    assert [r.reads.get(sinks) for r in reports] == [2, 2]
