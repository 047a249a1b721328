"""Phi-3 (``Phi3ForCausalLM``, also Phi-3.5 and Phi-4-mini): Llama with q/k/v fused in one
``qkv_proj`` ([all q heads, all k heads, all v heads]) and gate/up in one ``gate_up_proj``
([gate; up]), each split into this rank's heads and columns at load
(``layers.split_qkv_ranges``, ``layers.fused_gate_up_linear``); rotary on the first
``partial_rotary_factor`` of each head, and LongRoPE scaling (``longrope``, formerly ``su``;
transformers reads Phi-3's ``yarn`` as ``longrope`` too) with its short factors, refused when
a sequence could outgrow ``original_max_position_embeddings`` (``rotary.check_rope_length``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from tgis.shard.checkpoints.model_config import ModelConfig
from tgis.shard.native.models.llama_variants import Variant, VariantArgs, VariantForCausalLM


class Phi3ForCausalLM(VariantForCausalLM):
    """Phi-3's decoder stack plus LM head."""

    variant: ClassVar[Variant] = Variant(fused=True)

    @classmethod
    def variant_args(cls, config: ModelConfig, max_sequence_length: int) -> VariantArgs:
        """Llama's fields, Phi-3's rope type names and its partial rotary factor."""
        raw = dict(config.raw)
        key = "rope_parameters" if raw.get("rope_parameters") else "rope_scaling"
        rope: dict[str, Any] = dict(raw.get(key) or {})
        for field in ("rope_type", "type"):
            if rope.get(field) in ("su", "yarn"):
                rope[field] = "longrope"
        raw[key] = rope
        args = super().variant_args(dataclasses.replace(config, raw=raw), max_sequence_length)
        factor = float(rope.get("partial_rotary_factor") or raw.get("partial_rotary_factor") or 1)
        variant = dataclasses.replace(cls.variant, partial_rotary_factor=factor)
        return VariantArgs(args.llama, variant)
