"""Granite 4.0's hybrid decoder (``GraniteMoeHybridForCausalLM``): Mamba-2 layers and
attention layers, each followed by a shared MLP and, when the config has experts, a
mixture of experts beside it.

Per layer (``layer_types``: "mamba" / "linear_attention", or "attention" /
"full_attention"): RMSNorm → the Mamba-2 mixer (``mamba.py``, its state in the recurrent
state slots of ``recurrent_state.py``) or grouped-query attention over the paged cache
(RoPE when ``position_embedding_type`` is "rope", none for "nope"; softmax scale
``attention_multiplier``) → residual times ``residual_multiplier`` → RMSNorm → the shared
MLP (``shared_mlp``: fused [gate; up] ``input_linear``, ``output_linear``) plus the experts
(``block_sparse_moe``, Granite-MoE's fused 3-D experts and softmax over the top-k logits)
→ residual times ``residual_multiplier``. Embeddings times ``embedding_multiplier``,
logits divided by ``logits_scaling``. Only the attention layers have KV caches.

The step's sequences and their slots reach the Mamba layers through ``forward``'s
``state`` (``StateStep``); the forward always runs eagerly (no compiled step or CUDA
graphs). With tensor parallelism every rank holds its heads' share of each Mamba layer
(``MambaMixer``) and of its state.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F

from tgis.shard.checkpoints.model_config import ModelConfig
from tgis.shard.checkpoints.weights import Weights
from tgis.shard.errors import StartupError
from tgis.shard.native.attention.interface import AttentionBackend
from tgis.shard.native.attention.kv_cache import KVCache, KVCacheSpec
from tgis.shard.native.linear.lora_rows import LoraRows
from tgis.shard.native.linear.moe import (
    Experts,
    Routing,
    SparseMoE,
    fused_experts,
    refuse_quantized,
)
from tgis.shard.native.linear.moe_grouped import expert_kernel
from tgis.shard.native.linear.sharded import VocabEmbedding, row_linear
from tgis.shard.native.models.decoder import DecoderLM, EmbeddingRows, paged_attend
from tgis.shard.native.models.layers import (
    Attention,
    Heads,
    RMSNorm,
    Shapes,
    StepContext,
    fused_gate_up_linear,
    linear_shapes,
    load_lm_head,
)
from tgis.shard.native.models.llama import LlamaArgs, _separate_qkv
from tgis.shard.native.models.mamba import MambaArgs, MambaMixer
from tgis.shard.native.models.recurrent_state import StateSpec, StateStep
from tgis.shard.native.models.rotary import RotaryEmbedding

_KINDS = {
    "mamba": "mamba",
    "linear_attention": "mamba",
    "attention": "attention",
    "full_attention": "attention",
}


@dataclass(frozen=True)
class HybridArgs:
    """A ``granitemoehybrid`` config: the attention and multipliers as Granite's
    (``LlamaArgs``), the Mamba mixers', each layer's kind, the experts and shared MLP."""

    llama: LlamaArgs
    mamba: MambaArgs
    kinds: tuple[str, ...]  # "mamba" or "attention", per layer
    rope: bool
    routing: Routing | None  # None: no experts
    expert_size: int
    shared_size: int

    @classmethod
    def from_config(cls, config: ModelConfig, max_sequence_length: int) -> HybridArgs:
        raw, name = config.raw, config.architecture or config.model_type
        position = raw.get("position_embedding_type") or "nope"
        if position not in ("rope", "nope"):
            raise StartupError(f"{name}: unsupported position_embedding_type '{position}'")
        llama = LlamaArgs.from_config(config, max_sequence_length)
        llama = replace(
            llama,
            embedding_multiplier=float(raw.get("embedding_multiplier", 1.0)),
            residual_multiplier=float(raw.get("residual_multiplier", 1.0)),
            attention_scale=float(raw.get("attention_multiplier", 1.0)),
            logits_scaling=float(raw.get("logits_scaling", 1.0)),
        )
        kinds = _layer_kinds(raw, llama.num_layers, name)
        experts = int(raw.get("num_local_experts") or 0)
        routing = Routing(experts, int(raw["num_experts_per_tok"]), True) if experts else None
        return cls(
            llama=llama,
            mamba=MambaArgs.from_config(raw, name),
            kinds=kinds,
            rope=position == "rope",
            routing=routing,
            expert_size=int(raw["intermediate_size"]),
            shared_size=int(raw.get("shared_intermediate_size") or 0),
        )

    @property
    def mamba_layers(self) -> int:
        return sum(1 for kind in self.kinds if kind == "mamba")


def _layer_kinds(raw: dict[str, Any], num_layers: int, name: str) -> tuple[str, ...]:
    """Each layer's kind from ``layer_types`` (or ``layers_block_type``, its older name);
    every layer is a Mamba layer when neither is given, as in transformers."""
    names = raw.get("layer_types") or raw.get("layers_block_type") or ["mamba"] * num_layers
    if len(names) != num_layers:
        raise StartupError(f"{name}: {len(names)} layer_types for {num_layers} layers")
    unknown = sorted({kind for kind in names if kind not in _KINDS})
    if unknown:
        raise StartupError(f"{name}: unsupported layer type(s) {', '.join(unknown)}")
    kinds = tuple(_KINDS[kind] for kind in names)
    if "attention" not in kinds:
        raise StartupError(f"{name}: a model without attention layers is not supported")
    return kinds


class SharedMLP:
    """Granite's shared MLP: ``output_linear(silu(gate) * up)``, [gate; up] fused in
    ``input_linear``."""

    def __init__(self, weights: Weights, prefix: str) -> None:
        self.gate_up = fused_gate_up_linear(weights, f"{prefix}.input_linear", False)
        self.down = row_linear(weights, f"{prefix}.output_linear", False)

    def __call__(self, x: torch.Tensor, lora: LoraRows | None = None) -> torch.Tensor:
        gate, up = self.gate_up(x, lora).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up, lora)


class HybridLayer:
    """One layer: its mixer (Mamba or attention), then the shared MLP and the experts."""

    def __init__(
        self,
        args: HybridArgs,
        heads: Heads,
        weights: Weights,
        index: int,
        mixer_index: int,
    ) -> None:
        prefix, llama = f"model.layers.{index}", args.llama
        self.residual_multiplier = llama.residual_multiplier
        self.input_norm = RMSNorm(weights, f"{prefix}.input_layernorm.weight", llama.rms_norm_eps)
        self.post_norm = RMSNorm(
            weights, f"{prefix}.post_attention_layernorm.weight", llama.rms_norm_eps
        )
        self.mamba: MambaMixer | None = None
        self.attn: Attention | None = None
        if args.kinds[index] == "mamba":
            self.mamba = MambaMixer(weights, f"{prefix}.mamba", args.mamba, mixer_index)
        else:
            attn = f"{prefix}.self_attn"
            self.attn = Attention(
                mixer_index,
                heads,
                _separate_qkv(weights, attn, llama),
                row_linear(weights, f"{attn}.o_proj", llama.o_bias),
                llama.attention_scale,
            )
        self.shared = SharedMLP(weights, f"{prefix}.shared_mlp")
        self.moe: SparseMoE | None = None
        if args.routing is not None:
            moe = f"{prefix}.block_sparse_moe"
            reader = fused_experts(
                weights, f"{moe}.input_linear.weight", f"{moe}.output_linear.weight"
            )
            experts = Experts(
                reader,
                args.routing.num_experts,
                args.expert_size,
                weights.tp,
                "silu",
                expert_kernel(weights.device),  # fused Triton kernels on CUDA
            )
            router = weights.get(f"{moe}.router.layer.weight")
            self.moe = SparseMoE(router, args.routing, experts, weights.tp)

    def forward(
        self, x: torch.Tensor, ctx: StepContext, state: StateStep | None = None
    ) -> torch.Tensor:
        """``x``: [tokens, hidden] → [tokens, hidden]; ``state``: the step's state slots (a
        Mamba layer needs them)."""
        h = self.input_norm(x)
        if self.mamba is not None:
            assert state is not None
            h = self.mamba(h, state, ctx.lora)
        else:
            assert self.attn is not None
            h = self.attn(h, ctx)
        x = x + _scaled(h, self.residual_multiplier)
        h = self.post_norm(x)
        mlp = self.shared(h, ctx.lora)
        if self.moe is not None:
            mlp = mlp + self.moe(h)
        return x + _scaled(mlp, self.residual_multiplier)


def _scaled(x: torch.Tensor, factor: float) -> torch.Tensor:
    return x if factor == 1.0 else x * factor


class GraniteHybridForCausalLM(DecoderLM):
    """Granite 4.0 hybrid: Mamba-2 and attention layers with experts, over flattened
    tokens, the paged KV cache (attention layers) and the recurrent state slots (Mamba
    layers)."""

    parse_args = HybridArgs.from_config

    def __init__(
        self,
        config: ModelConfig,
        weights: Weights,
        attention: AttentionBackend,
        max_sequence_length: int,
    ) -> None:
        args = HybridArgs.from_config(config, max_sequence_length)
        if args.routing is not None:
            refuse_quantized(weights, config.architecture)
        self.args = args
        llama = args.llama
        self.dtype = weights.dtype
        self.attention = attention
        self.heads = Heads.split(llama.num_heads, llama.num_kv_heads, llama.head_dim, weights.tp)
        self.embed = VocabEmbedding(weights, "model.embed_tokens.weight")
        layers: list[HybridLayer] = []
        counts = {"mamba": 0, "attention": 0}  # each layer's place among its kind's
        for index, kind in enumerate(args.kinds):
            layers.append(HybridLayer(args, self.heads, weights, index, counts[kind]))
            counts[kind] += 1
        self.layers = self.hybrid_layers = layers
        self.final_norm = RMSNorm(weights, "model.norm.weight", llama.rms_norm_eps)
        self.lm_head = load_lm_head(
            weights, self.embed, llama.vocab_size, llama.tie_word_embeddings
        )
        self.rotary = None
        if args.rope:
            self.rotary = RotaryEmbedding.from_parameters(
                llama.rope, llama.head_dim, llama.max_position_embeddings, weights.device
            )

    @property
    def kv_cache_spec(self) -> KVCacheSpec:
        """KV blocks of the attention layers alone."""
        return KVCacheSpec(
            num_layers=len(self.args.kinds) - self.args.mamba_layers,
            num_kv_heads=self.heads.num_kv_heads,
            head_dim=self.heads.head_dim,
            dtype=self.dtype,
        )

    @property
    def state_spec(self) -> StateSpec:
        """One recurrent-state slot: every Mamba layer's convolution and SSM states (of
        this rank's heads)."""
        local = next(layer.mamba.args for layer in self.hybrid_layers if layer.mamba)
        return local.state_spec(self.args.mamba_layers, self.dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: KVCache,
        attn_metadata: Any,
        rows: EmbeddingRows | None = None,
        lora: LoraRows | None = None,
        state: StateStep | None = None,
    ) -> torch.Tensor:
        """Final hidden states [tokens, hidden]; ``state``: the step's sequences and their
        recurrent-state slots (required)."""
        if state is None:
            raise ValueError("a hybrid model's step needs its sequences' state slots")
        attend = paged_attend(self.attention, kv_cache, attn_metadata)
        x = self.embed_tokens(input_ids, positions, rows)
        rope = None if self.rotary is None else self.rotary.cos_sin(positions, x.dtype)
        ctx = StepContext(attend, rope, lora)
        for layer in self.hybrid_layers:
            x = layer.forward(x, ctx, state)
        return self.final_norm(x)

    def embed_tokens(
        self, input_ids: torch.Tensor, positions: torch.Tensor, rows: EmbeddingRows | None = None
    ) -> torch.Tensor:
        """Token embeddings times ``embedding_multiplier``."""
        x = super().embed_tokens(input_ids, positions, rows)
        return _scaled(x, self.args.llama.embedding_multiplier)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [rows, vocab], divided by ``logits_scaling``."""
        logits = super().compute_logits(hidden)
        scaling = self.args.llama.logits_scaling
        return logits if scaling == 1.0 else logits / scaling

    @classmethod
    def checkpoint_shapes(cls, config: ModelConfig, max_sequence_length: int) -> Shapes:
        """Every tensor of a checkpoint of ``config`` (the names this class reads)."""
        args = HybridArgs.from_config(config, max_sequence_length)
        llama, h = args.llama, args.llama.hidden_size
        q, kv = llama.num_heads * llama.head_dim, llama.num_kv_heads * llama.head_dim
        shapes: Shapes = {"model.embed_tokens.weight": (llama.vocab_size, h)}
        for i, kind in enumerate(args.kinds):
            prefix = f"model.layers.{i}"
            shapes[f"{prefix}.input_layernorm.weight"] = (h,)
            shapes[f"{prefix}.post_attention_layernorm.weight"] = (h,)
            if kind == "mamba":
                shapes |= args.mamba.shapes(f"{prefix}.mamba", h)
            else:
                attn = f"{prefix}.self_attn"
                for proj, rows in (("q", q), ("k", kv), ("v", kv)):
                    shapes |= linear_shapes(f"{attn}.{proj}_proj", rows, h, llama.qkv_bias)
                shapes |= linear_shapes(f"{attn}.o_proj", h, q, llama.o_bias)
            mlp, size = f"{prefix}.shared_mlp", args.shared_size
            shapes |= linear_shapes(f"{mlp}.input_linear", 2 * size, h, False)
            shapes |= linear_shapes(f"{mlp}.output_linear", h, size, False)
            if args.routing is not None:
                moe, n = f"{prefix}.block_sparse_moe", args.routing.num_experts
                inter = args.expert_size
                shapes[f"{moe}.router.layer.weight"] = (n, h)
                shapes[f"{moe}.input_linear.weight"] = (n, 2 * inter, h)
                shapes[f"{moe}.output_linear.weight"] = (n, h, inter)
        shapes["model.norm.weight"] = (h,)
        if not llama.tie_word_embeddings:
            shapes["lm_head.weight"] = (llama.vocab_size, h)
        return shapes
