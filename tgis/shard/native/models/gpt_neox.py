"""GPT-NeoX (Pythia, GPT-NeoX-20B, and relatives) on flattened varlen inputs.

Token embedding (``gpt_neox.embed_in``), per layer LayerNorm → attention (fused
``query_key_value`` laid out per head as [q, k, v], partial rotary on the first
``rotary_pct`` of each head, ``dense`` output) and LayerNorm → GELU MLP
(``dense_h_to_4h``/``dense_4h_to_h``), combined either in parallel
(``use_parallel_residual``: x + attn(ln1(x)) + mlp(ln2(x))) or one after the other; a final
LayerNorm and the untied LM head (``embed_out``, ``lm_head`` in newer checkpoints).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tgis.shard.checkpoints.model_config import ModelConfig
from tgis.shard.checkpoints.weights import Weights
from tgis.shard.errors import StartupError
from tgis.shard.native.attention.interface import AttentionBackend
from tgis.shard.native.linear.sharded import VocabEmbedding, row_linear
from tgis.shard.native.models.decoder import DecoderLM
from tgis.shard.native.models.layers import (
    MLP,
    Activation,
    Attention,
    Heads,
    LayerNorm,
    Shapes,
    StepContext,
    activation,
    fused_qkv_linear,
    layer_norm_shapes,
    linear_shapes,
    load_lm_head,
)
from tgis.shard.native.models.rotary import (
    RotaryEmbedding,
    check_rope_length,
    rope_parameters,
)

ARCHITECTURE = "GPTNeoXForCausalLM"
LM_HEAD_NAMES = ("embed_out.weight", "lm_head.weight")


@dataclass(frozen=True)
class GPTNeoXArgs:
    """The fields of a GPT-NeoX ``config.json`` the implementation uses."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    layer_norm_eps: float
    act: Activation
    rope: dict[str, Any]
    rotary_dim: int
    max_position_embeddings: int
    use_parallel_residual: bool
    attention_bias: bool
    tie_word_embeddings: bool

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @classmethod
    def from_config(cls, config: ModelConfig, max_sequence_length: int) -> GPTNeoXArgs:
        """Parse and check ``config.raw``; StartupError for what this class cannot run."""
        raw = config.raw
        hidden = int(raw["hidden_size"])
        heads = int(raw["num_attention_heads"])
        if hidden % heads:
            raise StartupError(f"{ARCHITECTURE}: hidden_size {hidden} not divisible by {heads}")
        # transformers v4 configs name the rotary settings rotary_emb_base and rotary_pct.
        rope = rope_parameters({"rope_theta": raw.get("rotary_emb_base", 10000.0), **raw})
        check_rope_length(rope, max_sequence_length, config.max_position_embeddings, ARCHITECTURE)
        fraction = rope.get("partial_rotary_factor", raw.get("rotary_pct", 0.25))
        rotary_dim = int(hidden // heads * float(fraction))
        if rotary_dim < 2 or rotary_dim % 2:
            raise StartupError(f"{ARCHITECTURE}: rotary dimension {rotary_dim} must be even")
        return cls(
            vocab_size=config.vocab_size,
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=heads,
            layer_norm_eps=float(raw.get("layer_norm_eps", 1e-5)),
            act=activation(raw.get("hidden_act", "gelu"), ARCHITECTURE),
            rope=rope,
            rotary_dim=rotary_dim,
            max_position_embeddings=config.max_position_embeddings,
            use_parallel_residual=bool(raw.get("use_parallel_residual", True)),
            attention_bias=bool(raw.get("attention_bias", True)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        )


class GPTNeoXLayer:
    """One layer: attention and MLP on separately normed inputs, parallel or sequential."""

    def __init__(self, args: GPTNeoXArgs, heads: Heads, weights: Weights, index: int) -> None:
        prefix = f"gpt_neox.layers.{index}"
        eps = args.layer_norm_eps
        self.parallel_residual = args.use_parallel_residual
        self.input_norm = LayerNorm(weights, f"{prefix}.input_layernorm", eps)
        self.post_norm = LayerNorm(weights, f"{prefix}.post_attention_layernorm", eps)
        attn = f"{prefix}.attention"
        self.attn = Attention(
            index,
            heads,
            fused_qkv_linear(weights, f"{attn}.query_key_value", heads, args.attention_bias),
            row_linear(weights, f"{attn}.dense", args.attention_bias),
        )
        mlp = f"{prefix}.mlp"
        self.mlp = MLP(weights, f"{mlp}.dense_h_to_4h", f"{mlp}.dense_4h_to_h", True, args.act)

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """``x``: [tokens, hidden] → [tokens, hidden]."""
        attn = self.attn(self.input_norm(x), ctx)
        if self.parallel_residual:
            return self.mlp(self.post_norm(x), ctx.lora) + attn + x
        x = attn + x
        return self.mlp(self.post_norm(x), ctx.lora) + x


class GPTNeoXForCausalLM(DecoderLM):
    """GPT-NeoX decoder stack plus LM head, over flattened tokens and the paged KV cache."""

    parse_args = GPTNeoXArgs.from_config

    def __init__(
        self,
        config: ModelConfig,
        weights: Weights,
        attention: AttentionBackend,
        max_sequence_length: int,
    ) -> None:
        args = GPTNeoXArgs.from_config(config, max_sequence_length)
        self.args = args
        self.dtype = weights.dtype
        self.attention = attention
        self.heads = Heads.split(args.num_heads, args.num_heads, args.head_dim, weights.tp)
        self.embed = VocabEmbedding(weights, "gpt_neox.embed_in.weight")
        self.layers = [GPTNeoXLayer(args, self.heads, weights, i) for i in range(args.num_layers)]
        self.final_norm = LayerNorm(weights, "gpt_neox.final_layer_norm", args.layer_norm_eps)
        self.lm_head = load_lm_head(
            weights, self.embed, args.vocab_size, args.tie_word_embeddings, LM_HEAD_NAMES
        )
        self.rotary = RotaryEmbedding.from_parameters(
            args.rope, args.rotary_dim, args.max_position_embeddings, weights.device
        )

    @classmethod
    def checkpoint_shapes(cls, config: ModelConfig, max_sequence_length: int) -> Shapes:
        """Every tensor of a checkpoint of ``config`` (the names this class reads)."""
        args = GPTNeoXArgs.from_config(config, max_sequence_length)
        h, inter, bias = args.hidden_size, args.intermediate_size, args.attention_bias
        shapes: Shapes = {"gpt_neox.embed_in.weight": (args.vocab_size, h)}
        for i in range(args.num_layers):
            prefix = f"gpt_neox.layers.{i}"
            shapes |= layer_norm_shapes(f"{prefix}.input_layernorm", h)
            shapes |= layer_norm_shapes(f"{prefix}.post_attention_layernorm", h)
            shapes |= linear_shapes(f"{prefix}.attention.query_key_value", 3 * h, h, bias)
            shapes |= linear_shapes(f"{prefix}.attention.dense", h, h, bias)
            shapes |= linear_shapes(f"{prefix}.mlp.dense_h_to_4h", inter, h, bias=True)
            shapes |= linear_shapes(f"{prefix}.mlp.dense_4h_to_h", h, inter, bias=True)
        shapes |= layer_norm_shapes("gpt_neox.final_layer_norm", h)
        if not args.tie_word_embeddings:
            shapes[LM_HEAD_NAMES[0]] = (args.vocab_size, h)
        return shapes
