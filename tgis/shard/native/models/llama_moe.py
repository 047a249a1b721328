"""Llama-family decoders whose MLPs are mixtures of experts (``linear/moe.py``).

The attention, norms and options are ``llama.py``'s; the MLP of each sparse layer is a
``SparseMoE``. The families differ in their checkpoint names and routing (``MoeArgs``):

- Mixtral: Mistral with ``block_sparse_moe`` (router ``gate``, experts ``w1``/``w3``/``w2``),
  top-k softmax weights renormalised.
- Qwen2-MoE: Qwen2 with ``mlp`` (router ``gate``, experts ``*_proj``), renormalised per
  ``norm_topk_prob``, a shared expert gated by a sigmoid, dense layers where
  ``mlp_only_layers`` / ``decoder_sparse_step`` say.
- Qwen3-MoE: as Qwen2-MoE without the shared expert, with Qwen3's attention (an RMSNorm on
  every query and key head, ``norms.HeadQKNorm``; biases per ``attention_bias``).
- Granite-MoE: Granite with ``block_sparse_moe`` (router ``router.layer``, experts fused in
  3-D ``input_linear`` / ``output_linear``), softmax over the top-k logits (renormalised).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.nn.functional as F

from tgis.shard.checkpoints.model_config import ModelConfig
from tgis.shard.checkpoints.weights import Weights
from tgis.shard.errors import StartupError
from tgis.shard.native.attention.interface import AttentionBackend
from tgis.shard.native.linear.moe import (
    ExpertReader,
    Experts,
    Routing,
    SharedExpert,
    SparseMoE,
    fused_experts,
    refuse_quantized,
    separate_experts,
)
from tgis.shard.native.linear.moe_grouped import expert_kernel
from tgis.shard.native.models.layers import Shapes, linear_shapes
from tgis.shard.native.models.llama import LlamaArgs, LlamaForCausalLM, LlamaLayer, MLPFn
from tgis.shard.native.models.norms import HeadQKNorm, qk_norm_shapes


@dataclass(frozen=True)
class MoeArgs:
    """The mixture-of-experts fields of a config and the family's checkpoint names."""

    family: str
    routing: Routing
    expert_size: int  # each expert's intermediate size
    shared_size: int  # the shared expert's (0: none)
    dense_layers: frozenset[int]  # layers with a dense MLP instead

    @classmethod
    def from_config(cls, config: ModelConfig, num_layers: int) -> MoeArgs:
        raw = config.raw
        family = config.model_type or _FAMILIES.get(config.architecture, "")
        if family not in ("mixtral", "qwen2_moe", "qwen3_moe", "granitemoe"):
            raise StartupError(f"{config.architecture}: unknown mixture-of-experts family")
        if raw.get("quantization_config"):
            raise StartupError(
                f"{config.architecture}: quantized mixture-of-experts models are not "
                "supported by the native engine yet; serve the unquantized checkpoint"
            )
        experts = int(raw.get("num_local_experts") or raw["num_experts"])
        qwen = family in ("qwen2_moe", "qwen3_moe")
        renormalize = bool(raw.get("norm_topk_prob", False)) if qwen else True
        routing = Routing(experts, int(raw["num_experts_per_tok"]), renormalize)
        return cls(
            family,
            routing,
            int(raw.get("moe_intermediate_size") or raw["intermediate_size"]),
            int(raw.get("shared_expert_intermediate_size") or 0),
            _dense_layers(raw, num_layers, experts),
        )

    def mlp_prefix(self, index: int) -> str:
        name = "mlp" if self.family in ("qwen2_moe", "qwen3_moe") else "block_sparse_moe"
        return f"model.layers.{index}.{name}"

    def router_name(self, index: int) -> str:
        name = "router.layer" if self.family == "granitemoe" else "gate"
        return f"{self.mlp_prefix(index)}.{name}.weight"

    def expert_shapes(self, index: int, hidden: int) -> Shapes:
        """The checkpoint tensors of layer ``index``'s experts and router."""
        prefix, n, inter = self.mlp_prefix(index), self.routing.num_experts, self.expert_size
        shapes: Shapes = {self.router_name(index): (n, hidden)}
        if self.family == "granitemoe":
            shapes[f"{prefix}.input_linear.weight"] = (n, 2 * inter, hidden)
            shapes[f"{prefix}.output_linear.weight"] = (n, hidden, inter)
            return shapes
        gate, up, down = _EXPERT_NAMES[self.family]
        for e in range(n):
            shapes |= linear_shapes(f"{prefix}.experts.{e}.{gate}", inter, hidden, False)
            shapes |= linear_shapes(f"{prefix}.experts.{e}.{up}", inter, hidden, False)
            shapes |= linear_shapes(f"{prefix}.experts.{e}.{down}", hidden, inter, False)
        if self.shared_size:
            shared, size = f"{prefix}.shared_expert", self.shared_size
            shapes |= linear_shapes(f"{shared}.gate_proj", size, hidden, False)
            shapes |= linear_shapes(f"{shared}.up_proj", size, hidden, False)
            shapes |= linear_shapes(f"{shared}.down_proj", hidden, size, False)
            shapes[f"{prefix}.shared_expert_gate.weight"] = (1, hidden)
        return shapes

    def expert_reader(self, weights: Weights, index: int) -> ExpertReader:
        prefix = self.mlp_prefix(index)
        if self.family == "granitemoe":
            return fused_experts(
                weights, f"{prefix}.input_linear.weight", f"{prefix}.output_linear.weight"
            )
        return separate_experts(weights, f"{prefix}.experts", _EXPERT_NAMES[self.family])


_FAMILIES = {
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "GraniteMoeForCausalLM": "granitemoe",
}
_EXPERT_NAMES = {
    "mixtral": ("w1", "w3", "w2"),
    "qwen2_moe": ("gate_proj", "up_proj", "down_proj"),
    "qwen3_moe": ("gate_proj", "up_proj", "down_proj"),
}


def _dense_layers(raw: dict[str, Any], num_layers: int, experts: int) -> frozenset[int]:
    """Qwen-MoE's layers with a dense MLP: ``mlp_only_layers``, and those not on the
    ``decoder_sparse_step``."""
    step = int(raw.get("decoder_sparse_step") or 1)
    only = {int(i) for i in raw.get("mlp_only_layers") or ()}
    return frozenset(
        i for i in range(num_layers) if i in only or experts <= 0 or (i + 1) % step != 0
    )


def _parse(config: ModelConfig, max_sequence_length: int) -> tuple[LlamaArgs, MoeArgs]:
    args = LlamaArgs.from_config(config, max_sequence_length)
    return args, MoeArgs.from_config(config, args.num_layers)


class LlamaMoeForCausalLM(LlamaForCausalLM):
    """``LlamaForCausalLM`` with a mixture of experts in place of each sparse layer's MLP."""

    parse_args = _parse  # type: ignore[assignment]

    def __init__(
        self,
        config: ModelConfig,
        weights: Weights,
        attention: AttentionBackend,
        max_sequence_length: int,
    ) -> None:
        refuse_quantized(weights, config.architecture)
        self.moe = _parse(config, max_sequence_length)[1]
        self.expert_kernel = expert_kernel(weights.device)  # fused Triton kernels on CUDA
        super().__init__(config, weights, attention, max_sequence_length)
        if self.moe.family == "qwen3_moe":  # Qwen3's attention: q/k heads normed
            for index, layer in enumerate(self.layers):
                attn = f"model.layers.{index}.self_attn"
                assert isinstance(layer, LlamaLayer)
                layer.attn.qk_norm = HeadQKNorm(weights, attn, self.args.rms_norm_eps)

    def layer_mlp(self, weights: Weights, index: int) -> MLPFn | None:
        moe = self.moe
        if index in moe.dense_layers:
            return None
        prefix = moe.mlp_prefix(index)
        experts = Experts(
            moe.expert_reader(weights, index),
            moe.routing.num_experts,
            moe.expert_size,
            weights.tp,
            "silu",
            self.expert_kernel,
        )
        shared = None
        if moe.shared_size:
            gate = f"{prefix}.shared_expert_gate"
            shared = SharedExpert(weights, f"{prefix}.shared_expert", gate, F.silu)
        router = weights.get(moe.router_name(index))
        return SparseMoE(router, moe.routing, experts, weights.tp, shared)

    @classmethod
    def checkpoint_shapes(cls, config: ModelConfig, max_sequence_length: int) -> Shapes:
        """Every tensor of a checkpoint of ``config``: Llama's with experts (and Qwen3-MoE's
        q/k norms)."""
        shapes = super().checkpoint_shapes(config, max_sequence_length)
        args, moe = _parse(config, max_sequence_length)
        if moe.family == "qwen3_moe":
            for index in range(args.num_layers):
                attn, dim = f"model.layers.{index}.self_attn", args.head_dim
                shapes |= qk_norm_shapes(attn, dim, dim)
        return shapes

    @classmethod
    def mlp_shapes(cls, config: ModelConfig, args: LlamaArgs, index: int) -> Shapes:
        moe = MoeArgs.from_config(config, args.num_layers)
        if index in moe.dense_layers:
            return super().mlp_shapes(config, args, index)
        return moe.expert_shapes(index, args.hidden_size)
