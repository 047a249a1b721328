"""OLMo 2 (``Olmo2ForCausalLM``): Llama with its norms after the sub-layers instead of before
(``x + norm(attention(x))``, ``x + norm(mlp(x))``: ``post_attention_layernorm`` and
``post_feedforward_layernorm``, no ``input_layernorm``) and an RMSNorm over the whole q and
the whole k projection before rotary (``norms.ProjectionQKNorm``); every norm applies its
weight in float32, before the cast back (``norms.UpcastRMSNorm``).
"""

from __future__ import annotations

from typing import ClassVar

from tgis.shard.native.models.llama_variants import Variant, VariantForCausalLM


class Olmo2ForCausalLM(VariantForCausalLM):
    """OLMo 2's decoder stack plus LM head."""

    variant: ClassVar[Variant] = Variant(
        attn_norms=(None, "post_attention_layernorm"),
        mlp_norms=(None, "post_feedforward_layernorm"),
        qk_norm="projection",
        upcast_norms=True,
    )
