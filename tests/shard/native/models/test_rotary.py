"""rotary.py against transformers' own rotary embedding: cos and sin (attention factor
included) of every rope type the engine computes, and the lengths it refuses."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers

from tgis.shard.errors import StartupError
from tgis.shard.native.models.rotary import RotaryEmbedding, check_rope_length, rope_parameters

_SHAPE: dict[str, Any] = dict(
    vocab_size=64,
    hidden_size=128,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=4,
    max_position_embeddings=512,
)
_LONGROPE = dict(
    type="longrope",
    short_factor=[1.0 + 0.1 * i for i in range(16)],
    long_factor=[4.0 + i for i in range(16)],
)

CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "default": ("Qwen2Config", {}),
    "linear": ("LlamaConfig", dict(rope_scaling=dict(type="linear", factor=2.0))),
    "llama3": (
        "LlamaConfig",
        dict(
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=64,
            )
        ),
    ),
    "yarn": ("Qwen2Config", dict(rope_scaling=dict(type="yarn", factor=4.0))),
    "yarn-original": (
        "Qwen2Config",
        dict(rope_scaling=dict(type="yarn", factor=4.0, original_max_position_embeddings=128)),
    ),
    "yarn-betas-untruncated": (
        "LlamaConfig",
        dict(
            rope_scaling=dict(
                rope_type="yarn",
                factor=8.0,
                beta_fast=16,
                beta_slow=2,
                truncate=False,
                original_max_position_embeddings=64,
            )
        ),
    ),
    "yarn-mscale": (
        "LlamaConfig",
        dict(rope_scaling=dict(rope_type="yarn", factor=16.0, mscale=0.8, mscale_all_dim=0.5)),
    ),
    "yarn-attention-factor": (
        "LlamaConfig",
        dict(rope_scaling=dict(rope_type="yarn", factor=2.0, attention_factor=1.3)),
    ),
    "dynamic": ("LlamaConfig", dict(rope_scaling=dict(type="dynamic", factor=2.0))),
    "longrope": (
        "Phi3Config",
        dict(_SHAPE, pad_token_id=0, original_max_position_embeddings=256, rope_scaling=_LONGROPE),
    ),
    "su": (  # read by us as Phi-3's first configs name it (transformers 5 calls it longrope)
        "Phi3Config",
        dict(pad_token_id=0, original_max_position_embeddings=128, rope_scaling=_LONGROPE),
    ),
}


def _hf_and_ours(name: str) -> tuple[Any, RotaryEmbedding, int]:
    config_class, params = CASES[name]
    config = getattr(transformers, config_class)(**{**_SHAPE, **params})
    family = config_class.removesuffix("Config")
    module = getattr(transformers, f"{family}Model")(config).rotary_emb
    raw = config.to_dict()
    raw.pop("rope_parameters", None)  # as a v4 config.json: rope_scaling and the top level
    raw["rope_scaling"] = params.get("rope_scaling")
    if name == "su":
        raw["rope_scaling"] = dict(_LONGROPE, type="su")
    ours = RotaryEmbedding.from_parameters(
        rope_parameters(raw), 32, config.max_position_embeddings, torch.device("cpu")
    )
    return module, ours, config.max_position_embeddings


@pytest.mark.parametrize("name", sorted(CASES))
def test_cos_sin_equal_transformers(name: str) -> None:
    module, ours, max_positions = _hf_and_ours(name)
    # the positions every sequence may reach (up to where check_rope_length stops them)
    limit = 128 if name == "su" else 256 if name == "longrope" else max_positions
    positions = torch.arange(limit)
    x = torch.zeros(1, limit, 32)
    cos, sin = module(x, positions[None, :])
    our_cos, our_sin = ours.cos_sin(positions, torch.float32)
    torch.testing.assert_close(our_cos[:, 0, :], cos[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(our_sin[:, 0, :], sin[0], rtol=0, atol=1e-6)


def test_the_scalings_change_the_frequencies() -> None:
    """Each case is a different rope: none of them is the default's by accident."""
    default = _hf_and_ours("default")[1]
    for name in set(CASES) - {"default", "dynamic"}:
        ours = _hf_and_ours(name)[1]
        positions = torch.arange(200)
        cos, default_cos = (r.cos_sin(positions, torch.float32)[0] for r in (ours, default))
        assert not torch.allclose(cos, default_cos), name


@pytest.mark.parametrize(
    ("rope", "limit", "message"),
    [
        (dict(rope_type="dynamic", factor=2.0), 512, r"dynamic rope scaling .* \(512\)"),
        (
            dict(_LONGROPE, rope_type="longrope", original_max_position_embeddings=256),
            256,
            r"longrope switches to its long factors past original_max_position_embeddings \(256\)",
        ),
    ],
    ids=["dynamic", "longrope"],
)
def test_lengths_past_what_the_cache_can_hold_are_refused(
    rope: dict[str, Any], limit: int, message: str
) -> None:
    params = rope_parameters({"rope_parameters": rope})
    check_rope_length(params, limit, 512, "X")  # up to the limit: served
    with pytest.raises(StartupError, match=message):
        check_rope_length(params, limit + 1, 512, "X")
