"""GPT-BigCode (StarCoder, SantaCoder) on flattened varlen inputs.

Token plus learned absolute position embeddings (``transformer.wte``/``wpe``), per layer
LayerNorm → attention (fused ``c_attn``, multi-query: one KV head shared by every query
head, replicated on every rank; or one KV head per query head with ``multi_query: false``)
→ residual → LayerNorm → GELU MLP (``c_fc``/``c_proj``) → residual, a final LayerNorm and the
LM head, tied to ``wte`` unless the config says otherwise. Every linear layer has a bias.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tgis.shard.checkpoints.model_config import ModelConfig
from tgis.shard.checkpoints.weights import Weights
from tgis.shard.errors import StartupError
from tgis.shard.native.attention.interface import AttentionBackend
from tgis.shard.native.linear.sharded import VocabEmbedding, row_linear
from tgis.shard.native.models.decoder import DecoderLM, EmbeddingRows
from tgis.shard.native.models.layers import (
    MLP,
    Activation,
    Attention,
    Heads,
    LayerNorm,
    Shapes,
    StepContext,
    activation,
    first_key,
    fused_qkv_linear,
    layer_norm_shapes,
    linear_shapes,
    load_lm_head,
)

ARCHITECTURE = "GPTBigCodeForCausalLM"


@dataclass(frozen=True)
class GPTBigCodeArgs:
    """The fields of a GPT-BigCode ``config.json`` the implementation uses."""

    vocab_size: int
    hidden_size: int
    inner_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    layer_norm_eps: float
    act: Activation
    attention_scale: float | None  # None: 1/sqrt(head_dim)
    tie_word_embeddings: bool
    num_positions: int  # learned position embeddings (n_positions)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @classmethod
    def from_config(cls, config: ModelConfig, max_sequence_length: int) -> GPTBigCodeArgs:
        """Parse and check ``config.raw``; StartupError for what this class cannot run."""
        raw = config.raw
        if raw.get("add_cross_attention"):
            raise StartupError(f"{ARCHITECTURE}: cross-attention is not supported")
        positions = int(first_key(raw, "n_positions", "max_position_embeddings"))
        if max_sequence_length > positions:
            raise StartupError(
                f"{ARCHITECTURE}: --max-sequence-length {max_sequence_length} exceeds the "
                f"model's {positions} learned positions (n_positions)"
            )
        hidden = int(first_key(raw, "n_embd", "hidden_size"))
        heads = int(first_key(raw, "n_head", "num_attention_heads"))
        if hidden % heads:
            raise StartupError(f"{ARCHITECTURE}: n_embd {hidden} not divisible by n_head {heads}")
        return cls(
            vocab_size=config.vocab_size,
            hidden_size=hidden,
            inner_size=int(raw.get("n_inner") or 4 * hidden),
            num_layers=int(first_key(raw, "n_layer", "num_hidden_layers")),
            num_heads=heads,
            num_kv_heads=1 if raw.get("multi_query", True) else heads,
            layer_norm_eps=float(raw.get("layer_norm_epsilon", 1e-5)),
            act=activation(raw.get("activation_function", "gelu_pytorch_tanh"), ARCHITECTURE),
            attention_scale=None if raw.get("scale_attn_weights", True) else 1.0,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)),
            num_positions=positions,
        )


class GPTBigCodeLayer:
    """One block: pre-LayerNorm attention and MLP, each with a residual."""

    def __init__(self, args: GPTBigCodeArgs, heads: Heads, weights: Weights, index: int) -> None:
        prefix = f"transformer.h.{index}"
        eps = args.layer_norm_eps
        self.ln_1 = LayerNorm(weights, f"{prefix}.ln_1", eps)
        self.ln_2 = LayerNorm(weights, f"{prefix}.ln_2", eps)
        self.attn = Attention(
            index,
            heads,
            fused_qkv_linear(weights, f"{prefix}.attn.c_attn", heads, bias=True),
            row_linear(weights, f"{prefix}.attn.c_proj", bias=True),
            args.attention_scale,
        )
        self.mlp = MLP(weights, f"{prefix}.mlp.c_fc", f"{prefix}.mlp.c_proj", True, args.act)

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """``x``: [tokens, hidden] → [tokens, hidden]."""
        x = self.attn(self.ln_1(x), ctx) + x
        return x + self.mlp(self.ln_2(x), ctx.lora)


class GPTBigCodeForCausalLM(DecoderLM):
    """GPT-BigCode decoder stack plus LM head, over flattened tokens and the paged KV cache."""

    parse_args = GPTBigCodeArgs.from_config

    def __init__(
        self,
        config: ModelConfig,
        weights: Weights,
        attention: AttentionBackend,
        max_sequence_length: int,
    ) -> None:
        args = GPTBigCodeArgs.from_config(config, max_sequence_length)
        self.args = args
        self.dtype = weights.dtype
        self.attention = attention
        self.heads = Heads.split(args.num_heads, args.num_kv_heads, args.head_dim, weights.tp)
        self.embed = VocabEmbedding(weights, "transformer.wte.weight")
        self.position_embed = VocabEmbedding(weights, "transformer.wpe.weight")
        self.layers = [
            GPTBigCodeLayer(args, self.heads, weights, i) for i in range(args.num_layers)
        ]
        self.final_norm = LayerNorm(weights, "transformer.ln_f", args.layer_norm_eps)
        self.lm_head = load_lm_head(weights, self.embed, args.vocab_size, args.tie_word_embeddings)

    @classmethod
    def checkpoint_shapes(cls, config: ModelConfig, max_sequence_length: int) -> Shapes:
        """Every tensor of a checkpoint of ``config`` (the names this class reads)."""
        args = GPTBigCodeArgs.from_config(config, max_sequence_length)
        h, inner = args.hidden_size, args.inner_size
        qkv = (args.num_heads + 2 * args.num_kv_heads) * args.head_dim
        shapes: Shapes = {
            "transformer.wte.weight": (args.vocab_size, h),
            "transformer.wpe.weight": (args.num_positions, h),
        }
        for i in range(args.num_layers):
            prefix = f"transformer.h.{i}"
            shapes |= layer_norm_shapes(f"{prefix}.ln_1", h)
            shapes |= linear_shapes(f"{prefix}.attn.c_attn", qkv, h, bias=True)
            shapes |= linear_shapes(f"{prefix}.attn.c_proj", h, h, bias=True)
            shapes |= layer_norm_shapes(f"{prefix}.ln_2", h)
            shapes |= linear_shapes(f"{prefix}.mlp.c_fc", inner, h, bias=True)
            shapes |= linear_shapes(f"{prefix}.mlp.c_proj", h, inner, bias=True)
        shapes |= layer_norm_shapes("transformer.ln_f", h)
        if not args.tie_word_embeddings:
            shapes["lm_head.weight"] = (args.vocab_size, h)
        return shapes

    def embed_tokens(
        self, input_ids: torch.Tensor, positions: torch.Tensor, rows: EmbeddingRows | None = None
    ) -> torch.Tensor:
        """Token plus learned position embeddings."""
        return self.word_embeddings(input_ids, rows) + self.position_embed(positions)
