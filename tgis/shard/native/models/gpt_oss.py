"""gpt-oss (``GptOssForCausalLM``): Llama's decoder (``llama.py``) with

- attention sinks: a learned logit per query head (``self_attn.sinks``) in every row's
  softmax denominator (``Attention.sinks``, sharded by query head like the heads; done by
  the backends that say ``supports_sinks``, the others refused at start-up);
- biases on q/k/v and o (``attention_bias``, true by default);
- sliding-window layers (128 keys) alternating with full ones (``layer_types``; a config
  without it has transformers' default, the even layers sliding), yarn rope (theta 150,000
  and transformers' default yarn parameters when the config names none);
- norms whose weight multiplies the float32 normalised input (``norms.UpcastRMSNorm``);
- a mixture of experts in every layer (``linear/moe.py``): a router with a bias, softmax
  over the top-k logits (the renormalised top-k softmax), experts with biases on gate/up and
  down, gate and up interleaved in input-major 3-D tensors, a clamped SwiGLU
  (``ClampedSwiGLU``: ``swiglu_alpha``, ``swiglu_limit``), run by the fused Triton kernels
  on CUDA and the grouped path elsewhere (``linear/moe_grouped.py``).

The published checkpoints store the experts' matrices in MXFP4
(``quantization_config.quant_method == "mxfp4"``): they are dequantized at load into the
model's dtype (``checkpoints/quantized/mxfp4.py``), so they take 16 bits a value in
bfloat16 instead of 4.25: gpt-oss-20b's ~21B parameters take ~42 GB instead of ~13 GB,
gpt-oss-120b's ~117B ~234 GB (tensor parallelism across GPUs). Other quantizations are
refused.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from tgis.shard.checkpoints.model_config import ModelConfig
from tgis.shard.checkpoints.weights import Weights
from tgis.shard.errors import StartupError
from tgis.shard.native.attention.interface import AttentionBackend
from tgis.shard.native.linear.moe import (
    ClampedSwiGLU,
    Experts,
    Routing,
    SparseMoE,
    interleaved_experts,
)
from tgis.shard.native.linear.moe_grouped import expert_kernel
from tgis.shard.native.models.layers import Shapes, check_sinks
from tgis.shard.native.models.llama import LlamaArgs, LlamaForCausalLM, LlamaLayer, MLPFn
from tgis.shard.native.models.norms import UpcastRMSNorm

ARCHITECTURE = "GptOssForCausalLM"
DEFAULT_ROPE_THETA = 150000.0
DEFAULT_ROPE = {  # transformers' GptOssConfig default
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}


@dataclass(frozen=True)
class GptOssArgs:
    """The config read as Llama's (with gpt-oss's defaults) and the experts' fields."""

    llama: LlamaArgs
    routing: Routing
    expert_size: int
    glu: ClampedSwiGLU
    config: ModelConfig  # with gpt-oss's defaults filled in (what LlamaArgs reads)

    @classmethod
    def from_config(cls, config: ModelConfig, max_sequence_length: int) -> GptOssArgs:
        """Parse and check ``config.raw``; StartupError for what this class cannot run."""
        raw: dict[str, Any] = dict(config.raw)
        quantization = raw.get("quantization_config")
        if quantization:
            method = str(quantization.get("quant_method", "")).lower()
            if method != "mxfp4":
                name = method or "without a quant_method"
                raise StartupError(
                    f"{ARCHITECTURE}: quantization {name} is not supported by the native "
                    "engine (its MXFP4 experts are, dequantized at load); serve the MXFP4 or "
                    "the unquantized checkpoint"
                )
        layers = int(raw["num_hidden_layers"])
        if raw.get("layer_types") is None:  # transformers' default: the even layers slide
            raw["layer_types"] = [
                "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)
            ]
        raw.setdefault("sliding_window", 128)
        raw.setdefault("attention_bias", True)
        raw.setdefault("rms_norm_eps", 1e-5)
        if not (raw.get("rope_parameters") or raw.get("rope_scaling")):
            raw["rope_parameters"] = dict(DEFAULT_ROPE)
        rope: dict[str, Any] = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        if raw.get("rope_theta") is None and not rope.get("rope_theta"):
            raw["rope_theta"] = DEFAULT_ROPE_THETA
        filled = dataclasses.replace(config, raw=raw)
        llama = LlamaArgs.from_config(filled, max_sequence_length)
        experts = int(raw.get("num_local_experts") or raw["num_experts"])
        return cls(
            llama=llama,
            routing=Routing(experts, int(raw["num_experts_per_tok"]), renormalize=True),
            expert_size=int(raw["intermediate_size"]),
            glu=ClampedSwiGLU(
                float(raw.get("swiglu_alpha", 1.702)), float(raw.get("swiglu_limit", 7.0))
            ),
            config=filled,
        )


class GptOssForCausalLM(LlamaForCausalLM):
    """gpt-oss's decoder stack plus LM head: ``LlamaForCausalLM`` with attention sinks,
    upcast norms and its mixture of experts in every layer."""

    parse_args = GptOssArgs.from_config  # type: ignore[assignment]

    def __init__(
        self,
        config: ModelConfig,
        weights: Weights,
        attention: AttentionBackend,
        max_sequence_length: int,
    ) -> None:
        check_sinks(attention, ARCHITECTURE)
        self.gpt_oss = GptOssArgs.from_config(config, max_sequence_length)
        super().__init__(self.gpt_oss.config, weights, attention, max_sequence_length)
        eps = self.args.rms_norm_eps
        heads = self.heads
        for index, layer in enumerate(self.layers):
            assert isinstance(layer, LlamaLayer)
            prefix = f"model.layers.{index}"
            sinks = weights.get_part(
                f"{prefix}.self_attn.sinks", slice(heads.q_first, heads.q_last)
            )
            layer.attn.sinks = sinks.float()
            layer.input_norm = UpcastRMSNorm(weights, f"{prefix}.input_layernorm.weight", eps)
            layer.post_norm = UpcastRMSNorm(
                weights, f"{prefix}.post_attention_layernorm.weight", eps
            )
        self.final_norm = UpcastRMSNorm(weights, "model.norm.weight", eps)

    def layer_mlp(self, weights: Weights, index: int) -> MLPFn | None:
        args, mlp = self.gpt_oss, f"model.layers.{index}.mlp"
        read, biases = interleaved_experts(weights, f"{mlp}.experts")
        experts = Experts(
            read,
            args.routing.num_experts,
            args.expert_size,
            weights.tp,
            "silu",  # unused: the clamped SwiGLU replaces it
            expert_kernel(weights.device),  # fused Triton kernels on CUDA
            biases=biases,
            glu=args.glu,
        )
        router = weights.get(f"{mlp}.router.weight")
        router_bias = weights.get(f"{mlp}.router.bias")
        return SparseMoE(router, args.routing, experts, weights.tp, router_bias=router_bias)

    @classmethod
    def mlp_shapes(cls, config: ModelConfig, args: LlamaArgs, index: int) -> Shapes:
        """The checkpoint tensors of layer ``index``'s router and experts (dense: what
        ``--load-format dummy`` creates, the MXFP4 matrices' dequantized form)."""
        experts = int(config.raw.get("num_local_experts") or config.raw["num_experts"])
        mlp, h, inter = f"model.layers.{index}.mlp", args.hidden_size, args.intermediate_size
        return {
            f"{mlp}.router.weight": (experts, h),
            f"{mlp}.router.bias": (experts,),
            f"{mlp}.experts.gate_up_proj": (experts, h, 2 * inter),
            f"{mlp}.experts.gate_up_proj_bias": (experts, 2 * inter),
            f"{mlp}.experts.down_proj": (experts, inter, h),
            f"{mlp}.experts.down_proj_bias": (experts, h),
        }

    @classmethod
    def checkpoint_shapes(cls, config: ModelConfig, max_sequence_length: int) -> Shapes:
        """Every tensor of a (dense) checkpoint of ``config``: Llama's with biases, the
        experts and every layer's sinks."""
        args = GptOssArgs.from_config(config, max_sequence_length)
        shapes = super().checkpoint_shapes(args.config, max_sequence_length)
        for index in range(args.llama.num_layers):
            shapes[f"model.layers.{index}.self_attn.sinks"] = (args.llama.num_heads,)
        return shapes
