"""The Llama architecture (also Mistral without sliding window) on flattened varlen inputs.

Own implementation, reading Hugging Face checkpoints by their parameter names: token
embedding, per layer RMSNorm → attention (fused q/k/v projection, RoPE, grouped-query
attention over the paged cache, o projection) → residual → RMSNorm → SwiGLU MLP → residual,
then a final RMSNorm and the LM head (tied to the embedding when the config says so).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from tgis.shard.attention import AttentionBackend
from tgis.shard.errors import StartupError
from tgis.shard.kv_cache import KVCache, KVCacheSpec
from tgis.shard.model_config import ModelConfig
from tgis.shard.models.rotary import (
    RotaryEmbedding,
    apply_rotary,
    inverse_frequencies,
    rope_parameters,
)
from tgis.shard.parallel.layers import (
    ColumnLinear,
    LMHead,
    VocabEmbedding,
    column_linear,
    head_range,
    heads_rows,
    row_linear,
)
from tgis.shard.weights import Weights


@dataclass(frozen=True)
class LlamaArgs:
    """The fields of a Llama/Mistral ``config.json`` the implementation uses."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    rope: dict[str, Any]

    @classmethod
    def from_config(cls, config: ModelConfig, max_sequence_length: int) -> LlamaArgs:
        """Parse and check ``config.raw``; StartupError for what this class cannot run."""
        raw = config.raw
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise StartupError(f"{config.architecture}: unsupported hidden_act '{act}'")
        window = raw.get("sliding_window")
        windowed = bool(raw.get("use_sliding_window", True))
        if windowed and window is not None and int(window) < max_sequence_length:
            raise StartupError(
                f"{config.architecture}: sliding-window attention ({window}) is not "
                f"implemented; it is only accepted when >= --max-sequence-length"
            )
        hidden = int(raw["hidden_size"])
        heads = int(raw["num_attention_heads"])
        kv_heads = int(raw.get("num_key_value_heads") or heads)
        if heads % kv_heads:
            raise StartupError(f"num_attention_heads {heads} not divisible by {kv_heads} KV heads")
        head_dim = int(raw.get("head_dim") or hidden // heads)
        max_positions = config.max_position_embeddings
        return cls(
            vocab_size=config.vocab_size,
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", False)),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            rope=rope_parameters(raw),
        )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32, as Hugging Face's LlamaRMSNorm."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


class LlamaLayer:
    """One decoder layer; q/k/v and gate/up projections fused into single matmuls.

    With tensor parallelism the layer holds this rank's heads and MLP columns: q/k/v and
    gate/up are column-parallel, o and down row-parallel (one all-reduce each).
    """

    def __init__(self, args: LlamaArgs, weights: Weights, index: int) -> None:
        prefix = f"model.layers.{index}"
        attn, mlp = f"{prefix}.self_attn", f"{prefix}.mlp"
        tp = weights.tp
        self.index = index
        self.eps = args.rms_norm_eps
        self.head_dim = args.head_dim
        q_first, q_last = head_range(args.num_heads, tp, "num_attention_heads")
        kv_first, kv_last = head_range(args.num_kv_heads, tp, "num_key_value_heads")
        self.num_heads, self.num_kv_heads = q_last - q_first, kv_last - kv_first
        self.q_size = self.num_heads * args.head_dim
        self.kv_size = self.num_kv_heads * args.head_dim
        self.input_norm = weights.get(f"{prefix}.input_layernorm.weight")
        self.post_norm = weights.get(f"{prefix}.post_attention_layernorm.weight")
        heads = {"q": args.num_heads, "k": args.num_kv_heads, "v": args.num_kv_heads}
        what = {"q": "num_attention_heads", "k": "num_key_value_heads", "v": "num_key_value_heads"}

        def rows(p: str, kind: str) -> torch.Tensor:
            name = f"{attn}.{p}_proj.{kind}"
            return heads_rows(weights, name, heads[p], args.head_dim, what[p])

        qkv_bias = torch.cat([rows(p, "bias") for p in "qkv"]) if args.attention_bias else None
        self.qkv = ColumnLinear(torch.cat([rows(p, "weight") for p in "qkv"]), qkv_bias)
        self.o = row_linear(weights, f"{attn}.o_proj", args.attention_bias)
        self.gate_up = column_linear(weights, [f"{mlp}.gate_proj", f"{mlp}.up_proj"], args.mlp_bias)
        self.down = row_linear(weights, f"{mlp}.down_proj", args.mlp_bias)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attention: AttentionBackend,
        kv_cache: KVCache,
        attn_metadata: Any,
    ) -> torch.Tensor:
        """``x``: [tokens, hidden] → [tokens, hidden]."""
        tokens = x.shape[0]
        h = rms_norm(x, self.input_norm, self.eps)
        q, k, v = self.qkv(h).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = apply_rotary(q.view(tokens, self.num_heads, self.head_dim), cos, sin)
        k = apply_rotary(k.view(tokens, self.num_kv_heads, self.head_dim), cos, sin)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = kv_cache.layer(self.index)
        attn = attention.forward(q, k, v, k_cache, v_cache, attn_metadata)
        x = x + self.o(attn.reshape(tokens, self.q_size))
        h = rms_norm(x, self.post_norm, self.eps)
        gate, up = self.gate_up(h).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class LlamaForCausalLM:
    """Llama decoder stack plus LM head, over flattened tokens and the paged KV cache."""

    def __init__(
        self,
        config: ModelConfig,
        weights: Weights,
        attention: AttentionBackend,
        max_sequence_length: int,
    ) -> None:
        args = LlamaArgs.from_config(config, max_sequence_length)
        self.args = args
        self.dtype = weights.dtype
        self.attention = attention
        self.embed = VocabEmbedding(weights, "model.embed_tokens.weight")
        self.layers = [LlamaLayer(args, weights, i) for i in range(args.num_layers)]
        self.norm = weights.get("model.norm.weight")
        if args.tie_word_embeddings or "lm_head.weight" not in weights:
            if not args.tie_word_embeddings:
                raise StartupError("lm_head.weight missing and tie_word_embeddings is false")
            self.lm_head = LMHead.tied(self.embed, args.vocab_size)
        else:
            self.lm_head = LMHead.load(weights, "lm_head.weight")
        self.num_kv_heads = self.layers[0].num_kv_heads if self.layers else args.num_kv_heads
        inv_freq = inverse_frequencies(args.rope, args.head_dim, args.max_position_embeddings)
        self.rotary = RotaryEmbedding(inv_freq, weights.device)

    @property
    def kv_cache_spec(self) -> KVCacheSpec:
        """The shape of one KV-cache block for this model."""
        return KVCacheSpec(
            num_layers=self.args.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.args.head_dim,
            dtype=self.dtype,
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: KVCache,
        attn_metadata: Any,
    ) -> torch.Tensor:
        """Final (normed) hidden states [tokens, hidden] for flattened ``input_ids``."""
        x = self.embed(input_ids)
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        for layer in self.layers:
            x = layer.forward(x, cos, sin, self.attention, kv_cache, attn_metadata)
        return rms_norm(x, self.norm, self.args.rms_norm_eps)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [rows, vocab] for selected rows of ``forward``'s output."""
        return self.lm_head(hidden)
