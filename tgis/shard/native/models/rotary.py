"""Rotary position embeddings (RoPE) as Hugging Face computes them, incl. Llama 3 scaling."""

from __future__ import annotations

import math
from typing import Any

import torch

from tgis.shard.errors import StartupError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_parameters(raw: dict[str, Any]) -> dict[str, Any]:
    """The RoPE settings of a config, in either transformers' v5 or v4 layout."""
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    params.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type") or params.get("type") or "default"
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
    return inv_freq


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

    def __init__(self, inv_freq: torch.Tensor, device: torch.device) -> None:
        self.inv_freq = inv_freq.to(device=device, dtype=torch.float32)

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of shape [tokens, 1, head_dim] (broadcast over heads)."""
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]


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
