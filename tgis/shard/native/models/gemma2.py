"""Gemma 2 (``Gemma2ForCausalLM``): the Llama-shaped layer with a norm before and after each
sub-layer (``input_layernorm``/``post_attention_layernorm`` around attention,
``pre_feedforward_layernorm``/``post_feedforward_layernorm`` around the MLP), every norm a
scale of ``1 + weight`` in float32 (``norms.OffsetRMSNorm``), a GeGLU MLP
(``gelu_pytorch_tanh``), embeddings times sqrt(hidden_size) rounded to the model's dtype
(``layers.scale_in_dtype``), the softmax scale 1/sqrt(``query_pre_attn_scalar``), the
attention scores soft-capped (``attn_logit_softcapping``: ``cap * tanh(score / cap)``, done
by the attention backends that say ``supports_softcap``; the others are refused at start-up)
and the logits too (``final_logit_softcapping``, ``layers.soft_cap``, on the float32 logits),
and sliding-window layers alternating with global ones (``layer_types``; a config without it
has transformers' default, the even layers sliding).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from tgis.shard.checkpoints.model_config import ModelConfig
from tgis.shard.errors import StartupError
from tgis.shard.native.models.llama_variants import Variant, VariantArgs, VariantForCausalLM


class Gemma2ForCausalLM(VariantForCausalLM):
    """Gemma 2's decoder stack plus LM head."""

    variant: ClassVar[Variant] = Variant(
        attn_norms=("input_layernorm", "post_attention_layernorm"),
        mlp_norms=("pre_feedforward_layernorm", "post_feedforward_layernorm"),
        offset_norms=True,
        activation="gelu_pytorch_tanh",
    )

    @classmethod
    def variant_args(cls, config: ModelConfig, max_sequence_length: int) -> VariantArgs:
        """Llama's fields read from Gemma 2's config, and its scales and soft-caps."""
        raw: dict[str, Any] = dict(config.raw)
        act = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
        if act not in ("gelu_pytorch_tanh", "gelu_new", "gelu_fast"):
            raise StartupError(f"{config.architecture}: unsupported hidden_activation '{act}'")
        raw["hidden_act"] = "silu"  # read as Llama's; the variant's activation is the GeGLU
        raw.setdefault("tie_word_embeddings", True)
        layers = int(raw["num_hidden_layers"])
        if raw.get("layer_types") is None:  # transformers' default: the even layers slide
            raw["layer_types"] = [
                "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)
            ]
        args = super().variant_args(dataclasses.replace(config, raw=raw), max_sequence_length)
        scalar = float(raw.get("query_pre_attn_scalar") or args.llama.head_dim)
        return VariantArgs(
            dataclasses.replace(args.llama, attention_scale=scalar**-0.5),
            cls.variant,
            embedding_scale=args.llama.hidden_size**0.5,
            attn_softcap=_cap(raw.get("attn_logit_softcapping")),
            final_softcap=_cap(raw.get("final_logit_softcapping")),
        )


def _cap(value: Any) -> float | None:
    """A soft-cap from the config (None or 0: none)."""
    return float(value) if value else None
