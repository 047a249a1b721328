"""Rotary position embeddings (RoPE) as Hugging Face computes them: default, linear, Llama 3,
YaRN (its ramp between interpolated and extrapolated frequencies, its attention factor),
dynamic NTK (the default rope up to ``max_position_embeddings``), LongRoPE (Phi-3's
``longrope``, formerly ``su``: its short factors and attention factor)."""

from __future__ import annotations

import math
from typing import Any

import torch

from tgis.shard.errors import StartupError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic", "longrope")
_ALIASES = {"su": "longrope"}  # LongRoPE's name in Phi-3's first configs


def rope_parameters(raw: dict[str, Any]) -> dict[str, Any]:
    """The RoPE settings of a config, in either transformers' v5 or v4 layout."""
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    params.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    if raw.get("original_max_position_embeddings") is not None:  # it wins, as in transformers
        params["original_max_position_embeddings"] = raw["original_max_position_embeddings"]
    rope_type = params.get("rope_type") or params.get("type") or "default"
    rope_type = _ALIASES.get(rope_type, rope_type)
    params["rope_type"] = rope_type
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise StartupError(
            f"unsupported rope type '{rope_type}' (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    return params


def inverse_frequencies(params: dict[str, Any], head_dim: int, max_positions: int) -> torch.Tensor:
    """``inv_freq`` of shape [head_dim // 2], float32 on the CPU."""
    base = float(params["rope_theta"])
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (base**exponents)
    rope_type = params["rope_type"]
    if rope_type == "linear":
        return inv_freq / float(params["factor"])
    if rope_type == "llama3":
        return _llama3_scaling(inv_freq, params, max_positions)
    if rope_type == "longrope":  # the short factors: see check_rope_length
        factors = torch.tensor(params["short_factor"], dtype=torch.float32)
        return 1.0 / (factors * base**exponents)
    if rope_type == "yarn":
        return _yarn_scaling(params, head_dim, max_positions)
    return inv_freq  # default, and dynamic up to max_positions (check_rope_length)


def _original_positions(params: dict[str, Any], max_positions: int) -> int:
    return int(params.get("original_max_position_embeddings") or max_positions)


def _factor(params: dict[str, Any], max_positions: int) -> float:
    """The scaling factor; YaRN and LongRoPE default it to the ratio of positions."""
    return float(params.get("factor") or max_positions / _original_positions(params, max_positions))


def _yarn_scaling(params: dict[str, Any], dim: int, max_positions: int) -> torch.Tensor:
    """YaRN's ``inv_freq``: the interpolated frequencies (divided by ``factor``) for the
    dimensions that turn fewer than ``beta_slow`` times over the original positions, the
    original ones for those that turn more than ``beta_fast`` times, a linear ramp between."""
    base = float(params["rope_theta"])
    factor = _factor(params, max_positions)
    original = _original_positions(params, max_positions)

    def dimension(rotations: float) -> float:  # the dimension turning ``rotations`` times
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = dimension(params.get("beta_fast") or 32), dimension(params.get("beta_slow") or 1)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolated = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolated) + (1.0 / pos_freqs) * extrapolated


def attention_scaling(params: dict[str, Any], max_positions: int) -> float:
    """The factor cos and sin are multiplied by: YaRN's and LongRoPE's ``attention_factor``,
    by default YaRN's 0.1 ln(factor) + 1 (or the ratio of two such with ``mscale`` and
    ``mscale_all_dim``) and LongRoPE's sqrt(1 + ln(factor) / ln(original positions)); else 1."""
    rope_type = params["rope_type"]
    if rope_type not in ("yarn", "longrope"):
        return 1.0
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    factor = _factor(params, max_positions)
    if rope_type == "longrope":
        original = _original_positions(params, max_positions)
        return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))

    def mscale(scale: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * scale * math.log(factor) + 1.0

    if params.get("mscale") and params.get("mscale_all_dim"):
        return mscale(float(params["mscale"])) / mscale(float(params["mscale_all_dim"]))
    return mscale(1.0)


def check_rope_length(
    params: dict[str, Any], max_sequence_length: int, max_positions: int, architecture: str
) -> None:
    """StartupError when a sequence could outgrow what the engine's rope computes.

    LongRoPE switches from its short to its long factors, for every position of a sequence,
    once the sequence is longer than ``original_max_position_embeddings`` (transformers then
    recomputes the whole sequence's keys); the engine keeps keys in its paged cache and
    computes the short factors only, which is exact while no sequence is longer than that.
    Dynamic NTK is the default rope up to ``max_position_embeddings``; past it transformers
    changes the base with the batch's longest sequence at every step, which cached keys
    cannot follow.
    """
    rope_type = params["rope_type"]
    if rope_type == "dynamic" and max_sequence_length > max_positions:
        raise StartupError(
            f"{architecture}: dynamic rope scaling changes its frequencies past "
            f"max_position_embeddings ({max_positions}) with the batch's longest sequence, "
            f"which keys kept in the paged cache cannot follow; set --max-sequence-length "
            f"<= {max_positions} (where it is the default rope)"
        )
    if rope_type != "longrope":
        return
    original = _original_positions(params, max_positions)
    if max_sequence_length > original:
        raise StartupError(
            f"{architecture}: longrope switches to its long factors past "
            f"original_max_position_embeddings ({original}) and recomputes the sequence's "
            f"keys, which the paged engine does not; set --max-sequence-length <= {original} "
            f"(the short factors are exact up to there)"
        )


def _llama3_scaling(
    inv_freq: torch.Tensor, params: dict[str, Any], max_positions: int
) -> torch.Tensor:
    factor = float(params["factor"])
    low_freq_factor = float(params["low_freq_factor"])
    high_freq_factor = float(params["high_freq_factor"])
    old_context_len = float(params.get("original_max_position_embeddings") or max_positions)
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding:
    """Computes cos/sin for arbitrary positions and rotates query/key heads."""

    def __init__(self, inv_freq: torch.Tensor, device: torch.device, scaling: float = 1.0) -> None:
        self.inv_freq = inv_freq.to(device=device, dtype=torch.float32)
        self.scaling = scaling  # attention_scaling

    @classmethod
    def from_parameters(
        cls, params: dict[str, Any], rotary_dim: int, max_positions: int, device: torch.device
    ) -> RotaryEmbedding:
        """The rotary embedding of ``rope_parameters`` over the first ``rotary_dim`` dimensions
        of each head."""
        inv_freq = inverse_frequencies(params, rotary_dim, max_positions)
        return cls(inv_freq, device, attention_scaling(params, max_positions))

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of shape [tokens, 1, head_dim] (broadcast over heads)."""
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.scaling != 1.0:
            cos, sin = cos * self.scaling, sin * self.scaling
        return cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ([tokens, heads, head_dim]) by the position angles, NeoX style (halves).

    With partial rotary (``cos``/``sin`` narrower than the head, as GPT-NeoX's
    ``rotary_pct``), only the first ``cos.shape[-1]`` dimensions turn; the rest pass.
    """
    rotary_dim = cos.shape[-1]
    if rotary_dim < x.shape[-1]:
        turned = apply_rotary(x[..., :rotary_dim], cos, sin)
        return torch.cat((turned, x[..., rotary_dim:]), dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
