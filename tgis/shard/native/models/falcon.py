"""Falcon (and its RefinedWeb predecessors) on flattened varlen inputs, rotary only.

Token embedding (``transformer.word_embeddings``), per layer attention (fused
``query_key_value``, rotary, ``dense``) and GELU MLP (``dense_h_to_4h``/``dense_4h_to_h``),
a final LayerNorm and the LM head (tied to the embedding unless the config says otherwise).
Linear layers have biases only with ``bias: true``. Two layouts:

- ``new_decoder_architecture`` (Falcon-40B/180B, Falcon2): grouped-query attention with
  ``num_kv_heads``, the fused weight grouped per KV head as [q × (heads / kv), k, v];
  attention and MLP in parallel on ``ln_attn``/``ln_mlp`` (one shared ``input_layernorm``
  with ``num_ln_in_parallel_attn: 1``).
- the original (Falcon-7B): ``multi_query`` (one KV head; fused [all q, k, v]) or one KV
  head per query head ([q, k, v] per head); one ``input_layernorm`` shared by attention
  and MLP with ``parallel_attn``, else attention, residual, ``post_attention_layernorm``,
  MLP, residual.
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
    first_key,
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

ARCHITECTURE = "FalconForCausalLM"


@dataclass(frozen=True)
class FalconArgs:
    """The fields of a Falcon ``config.json`` the implementation uses."""

    vocab_size: int
    hidden_size: int
    ffn_hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    layer_norm_eps: float
    act: Activation
    rope: dict[str, Any]
    max_position_embeddings: int
    bias: bool
    parallel_attn: bool
    two_norms: bool  # ln_attn and ln_mlp instead of one input_layernorm
    tie_word_embeddings: bool

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @classmethod
    def from_config(cls, config: ModelConfig, max_sequence_length: int) -> FalconArgs:
        """Parse and check ``config.raw`` (also RefinedWeb's key names); StartupError for
        what this class cannot run."""
        raw = config.raw
        if raw.get("alibi"):
            raise StartupError(
                f"{ARCHITECTURE}: ALiBi position biases (alibi: true) are not supported"
            )
        if raw.get("apply_residual_connection_post_layernorm"):
            raise StartupError(
                f"{ARCHITECTURE}: apply_residual_connection_post_layernorm is not supported"
            )
        # RefinedWeb (Falcon-40B's original model_type) implies the new architecture.
        new_arch = bool(raw.get("new_decoder_architecture", config.model_type == "RefinedWeb"))
        parallel_attn = bool(raw.get("parallel_attn", True))
        if new_arch and not parallel_attn:
            raise StartupError(
                f"{ARCHITECTURE}: new_decoder_architecture requires parallel_attn: true"
            )
        rope = rope_parameters(raw)
        check_rope_length(rope, max_sequence_length, config.max_position_embeddings, ARCHITECTURE)
        hidden = int(first_key(raw, "hidden_size", "n_embed"))
        heads = int(first_key(raw, "num_attention_heads", "n_head"))
        if hidden % heads:
            raise StartupError(f"{ARCHITECTURE}: hidden_size {hidden} not divisible by {heads}")
        return cls(
            vocab_size=config.vocab_size,
            hidden_size=hidden,
            ffn_hidden_size=int(raw.get("ffn_hidden_size") or 4 * hidden),
            num_layers=int(first_key(raw, "num_hidden_layers", "n_layer")),
            num_heads=heads,
            num_kv_heads=_num_kv_heads(raw, new_arch, heads),
            layer_norm_eps=float(raw.get("layer_norm_epsilon", 1e-5)),
            act=activation(raw.get("activation", "gelu"), ARCHITECTURE),
            rope=rope,
            max_position_embeddings=config.max_position_embeddings,
            bias=bool(raw.get("bias", False)),
            parallel_attn=parallel_attn,
            two_norms=new_arch and int(raw.get("num_ln_in_parallel_attn") or 2) == 2,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)),
        )


def _num_kv_heads(raw: dict[str, Any], new_arch: bool, heads: int) -> int:
    """KV heads as transformers' FalconAttention counts them."""
    if new_arch:
        return int(first_key(raw, "num_kv_heads", "n_head_kv", default=heads))
    return 1 if raw.get("multi_query", True) else heads


def _norm_names(args: FalconArgs) -> tuple[str, str | None]:
    """A layer's (attention, MLP) LayerNorm names; no MLP norm when the MLP shares the first."""
    if args.two_norms:
        return "ln_attn", "ln_mlp"
    return "input_layernorm", None if args.parallel_attn else "post_attention_layernorm"


def _layer_norms(
    args: FalconArgs, weights: Weights, prefix: str
) -> tuple[LayerNorm, LayerNorm | None]:
    """A layer's (attention, MLP) LayerNorms (``_norm_names``)."""
    eps = args.layer_norm_eps
    attn, mlp = _norm_names(args)
    return (
        LayerNorm(weights, f"{prefix}.{attn}", eps),
        None if mlp is None else LayerNorm(weights, f"{prefix}.{mlp}", eps),
    )


class FalconLayer:
    """One decoder layer (either layout; see the module docstring)."""

    def __init__(self, args: FalconArgs, heads: Heads, weights: Weights, index: int) -> None:
        prefix = f"transformer.h.{index}"
        self.parallel = args.parallel_attn
        self.attn_norm, self.mlp_norm = _layer_norms(args, weights, prefix)
        attn = f"{prefix}.self_attention"
        self.attn = Attention(
            index,
            heads,
            fused_qkv_linear(weights, f"{attn}.query_key_value", heads, args.bias),
            row_linear(weights, f"{attn}.dense", args.bias),
        )
        mlp = f"{prefix}.mlp"
        self.mlp = MLP(weights, f"{mlp}.dense_h_to_4h", f"{mlp}.dense_4h_to_h", args.bias, args.act)

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """``x``: [tokens, hidden] → [tokens, hidden]."""
        h = self.attn_norm(x)
        attn = self.attn(h, ctx)
        if not self.parallel:
            assert self.mlp_norm is not None
            x = attn + x
            return x + self.mlp(self.mlp_norm(x), ctx.lora)
        mlp_in = h if self.mlp_norm is None else self.mlp_norm(x)
        return x + (self.mlp(mlp_in, ctx.lora) + attn)


class FalconForCausalLM(DecoderLM):
    """Falcon decoder stack plus LM head, over flattened tokens and the paged KV cache."""

    parse_args = FalconArgs.from_config

    def __init__(
        self,
        config: ModelConfig,
        weights: Weights,
        attention: AttentionBackend,
        max_sequence_length: int,
    ) -> None:
        args = FalconArgs.from_config(config, max_sequence_length)
        self.args = args
        self.dtype = weights.dtype
        self.attention = attention
        self.heads = Heads.split(args.num_heads, args.num_kv_heads, args.head_dim, weights.tp)
        self.embed = VocabEmbedding(weights, "transformer.word_embeddings.weight")
        self.layers = [FalconLayer(args, self.heads, weights, i) for i in range(args.num_layers)]
        self.final_norm = LayerNorm(weights, "transformer.ln_f", args.layer_norm_eps)
        self.lm_head = load_lm_head(weights, self.embed, args.vocab_size, args.tie_word_embeddings)
        self.rotary = RotaryEmbedding.from_parameters(
            args.rope, args.head_dim, args.max_position_embeddings, weights.device
        )

    @classmethod
    def checkpoint_shapes(cls, config: ModelConfig, max_sequence_length: int) -> Shapes:
        """Every tensor of a checkpoint of ``config`` (the names this class reads)."""
        args = FalconArgs.from_config(config, max_sequence_length)
        h, ffn, bias = args.hidden_size, args.ffn_hidden_size, args.bias
        qkv = (args.num_heads + 2 * args.num_kv_heads) * args.head_dim
        shapes: Shapes = {"transformer.word_embeddings.weight": (args.vocab_size, h)}
        for i in range(args.num_layers):
            prefix = f"transformer.h.{i}"
            for norm in _norm_names(args):
                if norm is not None:
                    shapes |= layer_norm_shapes(f"{prefix}.{norm}", h)
            attn, mlp = f"{prefix}.self_attention", f"{prefix}.mlp"
            shapes |= linear_shapes(f"{attn}.query_key_value", qkv, h, bias)
            shapes |= linear_shapes(f"{attn}.dense", h, h, bias)
            shapes |= linear_shapes(f"{mlp}.dense_h_to_4h", ffn, h, bias)
            shapes |= linear_shapes(f"{mlp}.dense_4h_to_h", h, ffn, bias)
        shapes |= layer_norm_shapes("transformer.ln_f", h)
        if not args.tie_word_embeddings:
            shapes["lm_head.weight"] = (args.vocab_size, h)
        return shapes
