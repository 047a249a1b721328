"""Starcoder2 (``Starcoder2ForCausalLM``) on flattened varlen inputs.

Token embedding, per layer LayerNorm (with bias) → attention (separate q/k/v projections
fused into one, biased when ``use_bias``, RoPE on the whole head, grouped-query attention
over the paged cache within the config's ``sliding_window``, biased o projection) →
residual → LayerNorm → MLP ``c_proj(act(c_fc(x)))`` (GELU, tanh approximation) → residual;
a final LayerNorm and the LM head (tied to the embedding by default). The q/k/v
projections are read as Llama's (``llama._separate_qkv``), the window as Mistral's
(``llama.layer_windows``: one window, every layer).
"""

from __future__ import annotations

import torch

from tgis.shard.checkpoints.model_config import ModelConfig
from tgis.shard.checkpoints.weights import Weights
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
    layer_norm_shapes,
    linear_shapes,
    load_lm_head,
)
from tgis.shard.native.models.llama import LlamaArgs, _separate_qkv, layer_windows
from tgis.shard.native.models.rotary import RotaryEmbedding, check_rope_length, rope_parameters

ARCHITECTURE = "Starcoder2ForCausalLM"


def parse_args(config: ModelConfig, max_sequence_length: int) -> LlamaArgs:
    """Starcoder2's ``config.json`` in Llama's fields (``rms_norm_eps`` holds LayerNorm's
    ``norm_epsilon``; every projection biased or none, by ``use_bias``); StartupError for
    what the class cannot run."""
    raw = config.raw
    activation(raw.get("hidden_act", "gelu_pytorch_tanh"), ARCHITECTURE)
    rope = rope_parameters(raw)
    check_rope_length(rope, max_sequence_length, config.max_position_embeddings, ARCHITECTURE)
    hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
    bias = bool(raw.get("use_bias", True))
    return LlamaArgs(
        vocab_size=config.vocab_size,
        hidden_size=hidden,
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=hidden // heads,
        rms_norm_eps=float(raw.get("norm_epsilon", 1e-5)),
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)),
        qkv_bias=bias,
        o_bias=bias,
        mlp_bias=bias,
        rope=rope,
        windows=layer_windows(raw, max_sequence_length),
    )


class Starcoder2Layer:
    """One decoder layer (this rank's heads and MLP columns with tensor parallelism)."""

    def __init__(
        self, args: LlamaArgs, heads: Heads, act: Activation, weights: Weights, index: int
    ) -> None:
        prefix = f"model.layers.{index}"
        attn, eps = f"{prefix}.self_attn", args.rms_norm_eps
        self.input_norm = LayerNorm(weights, f"{prefix}.input_layernorm", eps)
        self.post_norm = LayerNorm(weights, f"{prefix}.post_attention_layernorm", eps)
        qkv = _separate_qkv(weights, attn, args)
        self.attn = Attention(index, heads, qkv, row_linear(weights, f"{attn}.o_proj", args.o_bias))
        self.attn.window = args.window(index)
        mlp = f"{prefix}.mlp"
        self.mlp = MLP(weights, f"{mlp}.c_fc", f"{mlp}.c_proj", args.mlp_bias, act)

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """``x``: [tokens, hidden] → [tokens, hidden]."""
        x = x + self.attn(self.input_norm(x), ctx)
        return x + self.mlp(self.post_norm(x), ctx.lora)


class Starcoder2ForCausalLM(DecoderLM):
    """Starcoder2 decoder stack plus LM head, over flattened tokens and the paged KV cache."""

    parse_args = staticmethod(parse_args)

    def __init__(
        self,
        config: ModelConfig,
        weights: Weights,
        attention: AttentionBackend,
        max_sequence_length: int,
    ) -> None:
        args = parse_args(config, max_sequence_length)
        act = activation(config.raw.get("hidden_act", "gelu_pytorch_tanh"), ARCHITECTURE)
        self.args = args
        self.dtype = weights.dtype
        self.attention = attention
        self.heads = Heads.split(args.num_heads, args.num_kv_heads, args.head_dim, weights.tp)
        self.embed = VocabEmbedding(weights, "model.embed_tokens.weight")
        self.layers = [
            Starcoder2Layer(args, self.heads, act, weights, i) for i in range(args.num_layers)
        ]
        self.final_norm = LayerNorm(weights, "model.norm", args.rms_norm_eps)
        self.lm_head = load_lm_head(weights, self.embed, args.vocab_size, args.tie_word_embeddings)
        self.rotary = RotaryEmbedding.from_parameters(
            args.rope, args.head_dim, args.max_position_embeddings, weights.device
        )

    @classmethod
    def checkpoint_shapes(cls, config: ModelConfig, max_sequence_length: int) -> Shapes:
        """Every tensor of a checkpoint of ``config`` (the names this class reads)."""
        args = parse_args(config, max_sequence_length)
        h, inter, bias = args.hidden_size, args.intermediate_size, args.mlp_bias
        q, kv = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
        shapes: Shapes = {"model.embed_tokens.weight": (args.vocab_size, h)}
        for i in range(args.num_layers):
            prefix = f"model.layers.{i}"
            attn, mlp = f"{prefix}.self_attn", f"{prefix}.mlp"
            shapes |= layer_norm_shapes(f"{prefix}.input_layernorm", h)
            shapes |= layer_norm_shapes(f"{prefix}.post_attention_layernorm", h)
            for proj, rows in (("q", q), ("k", kv), ("v", kv)):
                shapes |= linear_shapes(f"{attn}.{proj}_proj", rows, h, bias)
            shapes |= linear_shapes(f"{attn}.o_proj", h, q, bias)
            shapes |= linear_shapes(f"{mlp}.c_fc", inter, h, bias)
            shapes |= linear_shapes(f"{mlp}.c_proj", h, inter, bias)
        shapes |= layer_norm_shapes("model.norm", h)
        if not args.tie_word_embeddings:
            shapes["lm_head.weight"] = (args.vocab_size, h)
        return shapes
