"""The Llama architecture and its close relatives on flattened varlen inputs.

Own implementation, reading Hugging Face checkpoints by their parameter names: token
embedding, per layer RMSNorm → attention (fused q/k/v projection, RoPE, grouped-query
attention over the paged cache, o projection) → residual → RMSNorm → SwiGLU MLP → residual,
then a final RMSNorm and the LM head (tied to the embedding when the config says so).

The same code runs the families that differ from Llama only in a few options
(``LlamaArgs``): Mistral (with its sliding window), Granite (embedding, residual and logits
multipliers, its own softmax scale) and Qwen2 (biases on q/k/v but not o).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F

from tgis.shard.adapters.lora_layout import LoraSite
from tgis.shard.checkpoints.model_config import ModelConfig
from tgis.shard.checkpoints.weights import Weights
from tgis.shard.errors import StartupError
from tgis.shard.native.attention.interface import AttentionBackend
from tgis.shard.native.linear.lora_rows import LoraRows
from tgis.shard.native.linear.sharded import (
    ColumnLinear,
    VocabEmbedding,
    column_linear,
    head_range,
    heads_rows,
    lora_part,
    row_linear,
)
from tgis.shard.native.models.decoder import DecoderLM, EmbeddingRows
from tgis.shard.native.models.layers import (
    Attention,
    Heads,
    RMSNorm,
    Shapes,
    StepContext,
    linear_shapes,
    load_lm_head,
)
from tgis.shard.native.models.rotary import (
    RotaryEmbedding,
    check_rope_length,
    rope_parameters,
)

# Architectures of the Llama relatives whose config may lack ``model_type``.
_ARCHITECTURE_TYPES = {
    "GraniteForCausalLM": "granite",
    "Qwen2ForCausalLM": "qwen2",
    "GraniteMoeForCausalLM": "granitemoe",
    "Qwen2MoeForCausalLM": "qwen2_moe",
}


@dataclass(frozen=True)
class LlamaArgs:
    """The fields of a Llama-family ``config.json`` the implementation uses."""

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
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    rope: dict[str, Any]
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_scale: float | None = None  # softmax scale; None: 1/sqrt(head_dim)
    logits_scaling: float = 1.0  # logits are divided by it
    windows: tuple[int | None, ...] = ()  # each layer's sliding window (none: every layer full)

    @classmethod
    def from_config(cls, config: ModelConfig, max_sequence_length: int) -> LlamaArgs:
        """Parse and check ``config.raw``; StartupError for what this class cannot run."""
        raw = config.raw
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise StartupError(f"{config.architecture}: unsupported hidden_act '{act}'")
        rope = rope_parameters(raw)
        check_rope_length(
            rope, max_sequence_length, config.max_position_embeddings, config.architecture
        )
        hidden = int(raw["hidden_size"])
        heads = int(raw["num_attention_heads"])
        attention_bias = bool(raw.get("attention_bias", False))
        args = cls(
            vocab_size=config.vocab_size,
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=config.max_position_embeddings,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=attention_bias,
            o_bias=attention_bias,
            mlp_bias=bool(raw.get("mlp_bias", False)),
            rope=rope,
            windows=layer_windows(raw, max_sequence_length),
        )
        return _with_family_options(args, config)

    def window(self, index: int) -> int | None:
        """Layer ``index``'s sliding window (None: full attention)."""
        return self.windows[index] if self.windows else None


def layer_windows(raw: dict[str, Any], max_sequence_length: int) -> tuple[int | None, ...]:
    """Each layer's sliding window as transformers reads the config (None: full attention;
    empty when no layer slides): the ``sliding_attention`` layers of ``layer_types``, else
    every layer (Mistral) or, with Qwen2's ``max_window_layers``, the layers from there on.
    A window of at least ``max_sequence_length`` keys hides nothing and is dropped."""
    window = raw.get("sliding_window")
    if window is None or not raw.get("use_sliding_window", True):
        return ()
    if int(window) < 1:
        raise StartupError(f"sliding_window {window} is not a positive number of tokens")
    layers = int(raw["num_hidden_layers"])
    kinds = raw.get("layer_types")
    if kinds is None:  # Qwen2 without layer_types: layers from max_window_layers on slide.
        first = int(raw.get("max_window_layers") or 0)
        kinds = ["full_attention" if i < first else "sliding_attention" for i in range(layers)]
    if int(window) >= max_sequence_length or "sliding_attention" not in kinds:
        return ()
    return tuple(int(window) if kind == "sliding_attention" else None for kind in kinds)


def _with_family_options(args: LlamaArgs, config: ModelConfig) -> LlamaArgs:
    """``args`` with the options of the config's family where it departs from Llama."""
    family = config.model_type or _ARCHITECTURE_TYPES.get(config.architecture, "")
    raw = config.raw
    if family in ("granite", "granitemoe"):
        return replace(
            args,
            embedding_multiplier=float(raw.get("embedding_multiplier", 1.0)),
            residual_multiplier=float(raw.get("residual_multiplier", 1.0)),
            attention_scale=float(raw.get("attention_multiplier", 1.0)),
            logits_scaling=float(raw.get("logits_scaling", 1.0)),
        )
    if family in ("qwen2", "qwen2_moe"):
        return replace(args, qkv_bias=bool(raw.get("qkv_bias", True)), o_bias=False)
    return args


def _scaled(x: torch.Tensor, factor: float) -> torch.Tensor:
    """``x * factor``, skipping the multiplication when ``factor`` is 1."""
    return x if factor == 1.0 else x * factor


MLPFn = Callable[[torch.Tensor, LoraRows | None], torch.Tensor]
"""A layer's MLP: normed hidden states [tokens, hidden] (and the step's LoRA rows) → its
output, all-reduced: ``GatedMLP`` or a mixture of experts (``llama_moe.py``)."""


class GatedMLP:
    """SwiGLU, ``down(silu(gate(x)) * up(x))``: gate/up fused and column-parallel, down
    row-parallel."""

    def __init__(self, weights: Weights, prefix: str, bias: bool) -> None:
        self.gate_up = column_linear(weights, [f"{prefix}.gate_proj", f"{prefix}.up_proj"], bias)
        self.down = row_linear(weights, f"{prefix}.down_proj", bias)

    def __call__(self, x: torch.Tensor, lora: LoraRows | None = None) -> torch.Tensor:
        gate, up = self.gate_up(x, lora).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up, lora)


class LlamaLayer:
    """One decoder layer; q/k/v and gate/up projections fused into single matmuls.

    With tensor parallelism the layer holds this rank's heads and MLP columns: q/k/v and
    gate/up are column-parallel, o and down row-parallel (one all-reduce each). ``mlp``
    replaces the dense MLP (a mixture of experts).
    """

    def __init__(
        self, args: LlamaArgs, heads: Heads, weights: Weights, index: int, mlp: MLPFn | None = None
    ) -> None:
        prefix = f"model.layers.{index}"
        attn = f"{prefix}.self_attn"
        self.eps = args.rms_norm_eps
        self.residual_multiplier = args.residual_multiplier
        self.input_norm = RMSNorm(weights, f"{prefix}.input_layernorm.weight", self.eps)
        self.post_norm = RMSNorm(weights, f"{prefix}.post_attention_layernorm.weight", self.eps)
        self.attn = Attention(
            index,
            heads,
            _separate_qkv(weights, attn, args),
            row_linear(weights, f"{attn}.o_proj", args.o_bias),
            args.attention_scale,
        )
        self.attn.window = args.window(index)
        self.mlp = mlp or GatedMLP(weights, f"{prefix}.mlp", args.mlp_bias)

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """``x``: [tokens, hidden] → [tokens, hidden]."""
        x = x + _scaled(self.attn(self.input_norm(x), ctx), self.residual_multiplier)
        return x + _scaled(self.mlp(self.post_norm(x), ctx.lora), self.residual_multiplier)


def _separate_qkv(weights: Weights, attn: str, args: LlamaArgs) -> ColumnLinear:
    """This rank's heads of the separate q/k/v projections, fused into one."""
    heads = {"q": args.num_heads, "k": args.num_kv_heads, "v": args.num_kv_heads}
    what = {"q": "num_attention_heads", "k": "num_key_value_heads", "v": "num_key_value_heads"}

    def rows(p: str) -> tuple[int, int]:
        first, last = head_range(heads[p], weights.tp, what[p])
        return first * args.head_dim, last * args.head_dim

    def bias(p: str) -> torch.Tensor:
        return heads_rows(weights, f"{attn}.{p}_proj.bias", heads[p], args.head_dim, what[p])

    b = torch.cat([bias(p) for p in "qkv"]) if args.qkv_bias else None
    site = LoraSite(
        tuple(lora_part(weights, f"{attn}.{p}_proj", (rows(p),)) for p in "qkv"),
        row_parallel=False,
    )
    weight = [weights.linear(f"{attn}.{p}_proj", rows=[rows(p)]) for p in "qkv"]
    return ColumnLinear(weight, b, site)


class LlamaForCausalLM(DecoderLM):
    """Llama decoder stack plus LM head, over flattened tokens and the paged KV cache."""

    parse_args = LlamaArgs.from_config

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
        self.heads = Heads.split(args.num_heads, args.num_kv_heads, args.head_dim, weights.tp)
        self.embed = VocabEmbedding(weights, "model.embed_tokens.weight")
        self.layers = [
            LlamaLayer(args, self.heads, weights, i, self.layer_mlp(weights, i))
            for i in range(args.num_layers)
        ]
        self.final_norm = RMSNorm(weights, "model.norm.weight", args.rms_norm_eps)
        self.lm_head = load_lm_head(weights, self.embed, args.vocab_size, args.tie_word_embeddings)
        self.rotary = RotaryEmbedding.from_parameters(
            args.rope, args.head_dim, args.max_position_embeddings, weights.device
        )

    def layer_mlp(self, weights: Weights, index: int) -> MLPFn | None:
        """Layer ``index``'s MLP when it is not the dense one (a subclass's experts)."""
        del weights, index
        return None

    @classmethod
    def mlp_shapes(cls, config: ModelConfig, args: LlamaArgs, index: int) -> Shapes:
        """The checkpoint tensors of layer ``index``'s MLP."""
        del config
        mlp, h, inter = f"model.layers.{index}.mlp", args.hidden_size, args.intermediate_size
        shapes = linear_shapes(f"{mlp}.gate_proj", inter, h, args.mlp_bias)
        shapes |= linear_shapes(f"{mlp}.up_proj", inter, h, args.mlp_bias)
        return shapes | linear_shapes(f"{mlp}.down_proj", h, inter, args.mlp_bias)

    @classmethod
    def checkpoint_shapes(cls, config: ModelConfig, max_sequence_length: int) -> Shapes:
        """Every tensor of a checkpoint of ``config`` (the names this class reads)."""
        args = LlamaArgs.from_config(config, max_sequence_length)
        h = args.hidden_size
        q, kv = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
        shapes: Shapes = {"model.embed_tokens.weight": (args.vocab_size, h)}
        for i in range(args.num_layers):
            prefix = f"model.layers.{i}"
            attn = f"{prefix}.self_attn"
            shapes[f"{prefix}.input_layernorm.weight"] = (h,)
            shapes[f"{prefix}.post_attention_layernorm.weight"] = (h,)
            for proj, rows in (("q", q), ("k", kv), ("v", kv)):
                shapes |= linear_shapes(f"{attn}.{proj}_proj", rows, h, args.qkv_bias)
            shapes |= linear_shapes(f"{attn}.o_proj", h, q, args.o_bias)
            shapes |= cls.mlp_shapes(config, args, i)
        shapes["model.norm.weight"] = (h,)
        if not args.tie_word_embeddings:
            shapes["lm_head.weight"] = (args.vocab_size, h)
        return shapes

    def embed_tokens(
        self, input_ids: torch.Tensor, positions: torch.Tensor, rows: EmbeddingRows | None = None
    ) -> torch.Tensor:
        """Token embeddings, times Granite's ``embedding_multiplier``."""
        x = super().embed_tokens(input_ids, positions, rows)
        return _scaled(x, self.args.embedding_multiplier)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [rows, vocab], divided by Granite's ``logits_scaling``."""
        logits = super().compute_logits(hidden)
        scaling = self.args.logits_scaling
        return logits if scaling == 1.0 else logits / scaling
