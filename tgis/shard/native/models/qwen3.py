"""Qwen3 (``Qwen3ForCausalLM``): Llama with an RMSNorm on every query and key head before
rotary (``norms.HeadQKNorm``), ``head_dim`` given by the config, biases with
``attention_bias``. Its sliding-window option (``use_sliding_window``, off in the released
checkpoints) is refused unless the window covers ``--max-sequence-length`` (``LlamaArgs``).
"""

from __future__ import annotations

from typing import ClassVar

from tgis.shard.native.models.llama_variants import Variant, VariantForCausalLM


class Qwen3ForCausalLM(VariantForCausalLM):
    """Qwen3's decoder stack plus LM head."""

    variant: ClassVar[Variant] = Variant(qk_norm="head")
