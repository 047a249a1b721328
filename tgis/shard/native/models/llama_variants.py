"""The Llama-shaped decoder of the newer families, each a module of its own that says which
options it takes (``Variant``): Qwen3 (per-head q/k norms), OLMo 2 (post-sub-layer norms and
whole-projection q/k norms), Phi-3 (fused ``qkv_proj``/``gate_up_proj`` tensors, LongRoPE,
partial rotary), Gemma 2 and 3 (offset norms before and after each sub-layer, GeGLU, scaled
embeddings, soft-caps; Gemma 3's sliding layers with a rope of their own, its language model
read under a multimodal checkpoint's prefix: ``VariantForCausalLM.decoder``).

The config is read as Llama's (``LlamaArgs``); the layer puts together the shared pieces:
``norms.py``'s ``SubLayerNorms`` and q/k norms, ``layers.py``'s fused-tensor loaders and
``rotary.py``'s rope. Everything else (grouped-query attention over the paged cache, SwiGLU,
tensor parallelism, LoRA sites) is as for Llama.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from tgis.shard.checkpoints.model_config import ModelConfig
from tgis.shard.checkpoints.weights import Weights
from tgis.shard.native.attention.interface import AttentionBackend
from tgis.shard.native.linear.sharded import ColumnLinear, VocabEmbedding, column_linear, row_linear
from tgis.shard.native.models.decoder import DecoderLM, EmbeddingRows
from tgis.shard.native.models.layers import (
    ACTIVATIONS,
    Attention,
    Heads,
    QKNormFn,
    RMSNorm,
    Shapes,
    StepContext,
    check_softcap,
    fused_gate_up_linear,
    fused_qkv_linear,
    linear_shapes,
    load_lm_head,
    scale_in_dtype,
    soft_cap,
    split_qkv_ranges,
)
from tgis.shard.native.models.llama import LlamaArgs, _separate_qkv
from tgis.shard.native.models.norms import (
    HeadQKNorm,
    OffsetRMSNorm,
    ProjectionQKNorm,
    SubLayerNorms,
    UpcastRMSNorm,
    qk_norm_shapes,
    sublayer_norm_shapes,
)
from tgis.shard.native.models.rotary import RotaryEmbedding

NormNames = tuple[str | None, str | None]
"""The (before, after) norms around one sub-layer, by checkpoint name; None: no such norm."""

PRE_NORMS = (("input_layernorm", None), ("post_attention_layernorm", None))  # Llama's


@dataclass(frozen=True)
class Variant:
    """What a family changes in the Llama layer."""

    attn_norms: NormNames = PRE_NORMS[0]
    mlp_norms: NormNames = PRE_NORMS[1]
    qk_norm: str | None = None  # "head" (HeadQKNorm) or "projection" (ProjectionQKNorm)
    fused: bool = False  # qkv_proj and gate_up_proj instead of q/k/v and gate/up
    partial_rotary_factor: float = 1.0
    upcast_norms: bool = False  # norm weights applied in float32 (UpcastRMSNorm)
    offset_norms: bool = False  # Gemma's norms: a scale of 1 + weight (OffsetRMSNorm)
    activation: str = "silu"  # the gated MLP's (layers.ACTIVATIONS)

    @property
    def norm(self) -> type[RMSNorm]:
        if self.offset_norms:
            return OffsetRMSNorm
        return UpcastRMSNorm if self.upcast_norms else RMSNorm


@dataclass(frozen=True)
class VariantArgs:
    """A config read as Llama's, and the family's options."""

    llama: LlamaArgs
    variant: Variant
    embedding_scale: float | None = None  # embeddings times it, in the model's dtype
    attn_softcap: float | None = None  # every layer's attention logit soft-cap
    final_softcap: float | None = None  # the logits' soft-cap
    local_rope: dict[str, Any] | None = None  # the local_rope_layers' rope (else llama.rope)
    local_rope_layers: tuple[int, ...] = ()  # the layers turned by local_rope

    @property
    def rotary_dim(self) -> int:
        return int(self.llama.head_dim * self.variant.partial_rotary_factor)


class VariantLayer:
    """One decoder layer: attention, then the gated MLP, each inside its ``SubLayerNorms``."""

    def __init__(
        self, args: VariantArgs, heads: Heads, weights: Weights, index: int, decoder: str = "model"
    ) -> None:
        prefix = f"{decoder}.layers.{index}"
        attn, mlp = f"{prefix}.self_attn", f"{prefix}.mlp"
        llama, variant = args.llama, args.variant
        eps = llama.rms_norm_eps
        self.attn_norms = SubLayerNorms(weights, prefix, variant.attn_norms, eps, norm=variant.norm)
        self.mlp_norms = SubLayerNorms(weights, prefix, variant.mlp_norms, eps, norm=variant.norm)
        self.attn = Attention(
            index,
            heads,
            _qkv(weights, attn, args, heads),
            row_linear(weights, f"{attn}.o_proj", llama.o_bias),
            llama.attention_scale,
            qk_norm=_qk_norm(weights, attn, args, heads),
        )
        self.attn.window = llama.window(index)
        self.attn.softcap = args.attn_softcap
        self.attn.local_rope = index in args.local_rope_layers
        self.act = ACTIVATIONS[variant.activation]
        if variant.fused:
            self.gate_up = fused_gate_up_linear(weights, f"{mlp}.gate_up_proj", llama.mlp_bias)
        else:
            names = [f"{mlp}.gate_proj", f"{mlp}.up_proj"]
            self.gate_up = column_linear(weights, names, llama.mlp_bias)
        self.down = row_linear(weights, f"{mlp}.down_proj", llama.mlp_bias)

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """``x``: [tokens, hidden] → [tokens, hidden]."""
        x = self.attn_norms(x, lambda h: self.attn(h, ctx))
        return self.mlp_norms(x, lambda h: self._mlp(h, ctx))

    def _mlp(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        gate, up = self.gate_up(x, ctx.lora).chunk(2, dim=-1)
        return self.down(self.act(gate) * up, ctx.lora)


def _qkv(weights: Weights, attn: str, args: VariantArgs, heads: Heads) -> ColumnLinear:
    """This rank's q/k/v heads as one projection, from a fused tensor or the separate ones."""
    if args.variant.fused:
        bias = args.llama.qkv_bias
        return fused_qkv_linear(weights, f"{attn}.qkv_proj", heads, bias, split_qkv_ranges)
    return _separate_qkv(weights, attn, args.llama)


def _qk_norm(weights: Weights, attn: str, args: VariantArgs, heads: Heads) -> QKNormFn | None:
    eps = args.llama.rms_norm_eps
    if args.variant.qk_norm == "head":
        return HeadQKNorm(weights, attn, eps, args.variant.norm)
    if args.variant.qk_norm == "projection":
        return ProjectionQKNorm(weights, attn, heads, eps)
    return None


class VariantForCausalLM(DecoderLM):
    """The decoder stack plus LM head of a family of ``Variant`` options (its subclass names
    them in ``variant``, and may read more of the config in ``variant_args``).

    ``decoder`` is the checkpoint module holding ``embed_tokens``, ``layers`` and ``norm``
    (a multimodal checkpoint's language model has its own: ``decoder_of``); ``lm_head_names``
    the names an untied LM head may have, the first the one ``checkpoint_shapes`` gives."""

    parse_args = LlamaArgs.from_config  # the fields read as Llama's; see variant_args
    variant: ClassVar[Variant] = Variant()
    decoder: ClassVar[str] = "model"
    lm_head_names: ClassVar[tuple[str, ...]] = ("lm_head.weight",)

    @classmethod
    def variant_args(cls, config: ModelConfig, max_sequence_length: int) -> VariantArgs:
        """Parse and check ``config.raw``; StartupError for what this class cannot run."""
        llama = LlamaArgs.from_config(config, max_sequence_length)
        return VariantArgs(llama, cls.variant)

    @classmethod
    def check_config(cls, config: ModelConfig, max_sequence_length: int) -> None:
        """StartupError for a config this class cannot run (reads no weights)."""
        cls.variant_args(config, max_sequence_length)

    def __init__(
        self,
        config: ModelConfig,
        weights: Weights,
        attention: AttentionBackend,
        max_sequence_length: int,
    ) -> None:
        args = self.variant_args(config, max_sequence_length)
        llama = args.llama
        self.args = args
        self.dtype = weights.dtype
        self.attention = attention
        if args.attn_softcap is not None:
            check_softcap(attention, config.architecture)
        self.heads = Heads.split(llama.num_heads, llama.num_kv_heads, llama.head_dim, weights.tp)
        decoder = self.decoder_of(weights)
        self.embed = VocabEmbedding(weights, f"{decoder}.embed_tokens.weight")
        self.layers = [
            VariantLayer(args, self.heads, weights, i, decoder) for i in range(llama.num_layers)
        ]
        self.final_norm = args.variant.norm(weights, f"{decoder}.norm.weight", llama.rms_norm_eps)
        self.lm_head = load_lm_head(
            weights, self.embed, llama.vocab_size, llama.tie_word_embeddings, self.lm_head_names
        )
        self.rotary = self._rotary(llama.rope, args, weights)
        if args.local_rope is not None:
            self.local_rotary = self._rotary(args.local_rope, args, weights)

    @classmethod
    def decoder_of(cls, weights: Weights) -> str:
        """The checkpoint module of the decoder stack in ``weights`` (``decoder``)."""
        del weights
        return cls.decoder

    @staticmethod
    def _rotary(rope: dict[str, Any], args: VariantArgs, weights: Weights) -> RotaryEmbedding:
        llama = args.llama
        return RotaryEmbedding.from_parameters(
            rope, args.rotary_dim, llama.max_position_embeddings, weights.device
        )

    def word_embeddings(
        self, input_ids: torch.Tensor, rows: EmbeddingRows | None = None
    ) -> torch.Tensor:
        """The vocabulary embeddings times Gemma's ``embedding_scale`` when it has one (as
        transformers scales them: prompt-tuning ``rows`` are put in place unscaled, as its
        ``inputs_embeds``)."""
        scale = self.args.embedding_scale
        if scale is None:
            return super().word_embeddings(input_ids, rows)
        x = scale_in_dtype(self.embed(input_ids), scale)
        if rows is not None:
            x = x.index_copy(0, rows.index, rows.values.to(x.dtype))
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [rows, vocab], soft-capped when the family caps them."""
        logits = super().compute_logits(hidden)
        cap = self.args.final_softcap
        return logits if cap is None else soft_cap(logits, cap)

    @classmethod
    def checkpoint_shapes(cls, config: ModelConfig, max_sequence_length: int) -> Shapes:
        """Every tensor of a checkpoint of ``config`` (the names this class reads)."""
        args = cls.variant_args(config, max_sequence_length)
        llama = args.llama
        decoder = cls.decoder
        shapes: Shapes = {f"{decoder}.embed_tokens.weight": (llama.vocab_size, llama.hidden_size)}
        for i in range(llama.num_layers):
            shapes |= _layer_shapes(args, f"{decoder}.layers.{i}")
        shapes[f"{decoder}.norm.weight"] = (llama.hidden_size,)
        if not llama.tie_word_embeddings:
            shapes[cls.lm_head_names[0]] = (llama.vocab_size, llama.hidden_size)
        return shapes


def _layer_shapes(args: VariantArgs, prefix: str) -> Shapes:
    """The checkpoint tensors of one layer."""
    llama, variant = args.llama, args.variant
    h, inter, dim = llama.hidden_size, llama.intermediate_size, llama.head_dim
    q, kv = llama.num_heads * dim, llama.num_kv_heads * dim
    attn, mlp = f"{prefix}.self_attn", f"{prefix}.mlp"
    shapes = sublayer_norm_shapes(prefix, variant.attn_norms, h)
    shapes |= sublayer_norm_shapes(prefix, variant.mlp_norms, h)
    if variant.fused:
        shapes |= linear_shapes(f"{attn}.qkv_proj", q + 2 * kv, h, llama.qkv_bias)
        shapes |= linear_shapes(f"{mlp}.gate_up_proj", 2 * inter, h, llama.mlp_bias)
    else:
        for proj, rows in (("q", q), ("k", kv), ("v", kv)):
            shapes |= linear_shapes(f"{attn}.{proj}_proj", rows, h, llama.qkv_bias)
        shapes |= linear_shapes(f"{mlp}.gate_proj", inter, h, llama.mlp_bias)
        shapes |= linear_shapes(f"{mlp}.up_proj", inter, h, llama.mlp_bias)
    shapes |= linear_shapes(f"{attn}.o_proj", h, q, llama.o_bias)
    shapes |= linear_shapes(f"{mlp}.down_proj", h, inter, llama.mlp_bias)
    if variant.qk_norm == "head":
        shapes |= qk_norm_shapes(attn, dim, dim)
    elif variant.qk_norm == "projection":
        shapes |= qk_norm_shapes(attn, q, kv)
    return shapes
