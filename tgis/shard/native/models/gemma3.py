"""Gemma 3 (``Gemma3ForCausalLM``, model type ``gemma3_text``; and the language model of
``Gemma3ForConditionalGeneration``, the 4B, 12B and 27B checkpoints): Gemma 2's layer
(``gemma2.py``: a norm before and after each sub-layer, every norm a scale of ``1 + weight``,
GeGLU, embeddings times sqrt(hidden_size), the softmax scale 1/sqrt(``query_pre_attn_scalar``))
with

- an RMSNorm of every query and key head before rotary, a ``1 + weight`` norm too
  (``norms.HeadQKNorm`` with ``norms.OffsetRMSNorm``);
- a rope of their own for the sliding-window layers (``rope_local_base_freq``, default rope)
  beside the global layers' (``rope_theta`` with its ``rope_scaling``, e.g. linear ×8 in the
  4B and larger models): transformers 5.24 keeps both in ``rope_parameters``, by layer type
  (``layer_ropes``); the attention runs the sliding layers' with ``local_rope``;
- five sliding layers to one global (``layer_types``; a config without it has transformers'
  default from ``sliding_window_pattern``, 6: layer i slides unless i + 1 is a multiple);
- the config's defaults as ``Gemma3TextConfig``'s (``checkpoints/text_config.py``: the
  multimodal checkpoints' ``text_config`` gives only what differs).

As in transformers, the logits are soft-capped when ``final_logit_softcapping`` is set
(``Gemma3ForCausalLM`` only: the conditional-generation model never caps them) and
``attn_logit_softcapping`` is never applied (Gemma 3 dropped it for the q/k norms; both are
null in the published configs). ``use_bidirectional_attention`` (EmbeddingGemma) is refused.

``Gemma3ForConditionalGeneration``: the language model only (text in, text out; images are
not served and the vision tower's weights are never read), under its checkpoint prefix:
``language_model.model`` (the published checkpoints', and what transformers 5.24 saves) or
``model.language_model`` (transformers' own module names since 4.52), its untied LM head
``language_model.lm_head`` or ``lm_head``.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, ClassVar

from tgis.shard.checkpoints.model_config import ModelConfig
from tgis.shard.checkpoints.weights import Weights
from tgis.shard.errors import StartupError
from tgis.shard.native.attention.interface import AttentionBackend
from tgis.shard.native.models.gemma2 import Gemma2ForCausalLM
from tgis.shard.native.models.llama_variants import Variant, VariantArgs
from tgis.shard.native.models.rotary import check_rope_length, rope_parameters

log = logging.getLogger(__name__)

SLIDING, FULL = "sliding_attention", "full_attention"
DEFAULT_THETA = {FULL: 1_000_000.0, SLIDING: 10_000.0}  # Gemma3TextConfig.default_theta
DEFAULT_PATTERN = 6  # one global layer in every sliding_window_pattern


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3's decoder stack plus LM head."""

    variant: ClassVar[Variant] = dataclasses.replace(Gemma2ForCausalLM.variant, qk_norm="head")
    caps_logits: ClassVar[bool] = True  # final_logit_softcapping applies (see the module)

    @classmethod
    def variant_args(cls, config: ModelConfig, max_sequence_length: int) -> VariantArgs:
        """Gemma 2's reading of the config, with Gemma 3's layer types and two ropes."""
        raw: dict[str, Any] = dict(config.raw)
        name = config.architecture or config.model_type
        if raw.get("use_bidirectional_attention"):
            raise StartupError(f"{name}: use_bidirectional_attention is not supported")
        if raw.get("layer_types") is None:
            pattern = int(raw.get("sliding_window_pattern") or DEFAULT_PATTERN)
            layers = int(raw["num_hidden_layers"])
            raw["layer_types"] = [SLIDING if (i + 1) % pattern else FULL for i in range(layers)]
        ropes = layer_ropes(raw)
        raw["rope_parameters"] = ropes[FULL]  # read as Llama's: the global layers'
        raw.pop("rope_scaling", None)
        args = super().variant_args(dataclasses.replace(config, raw=raw), max_sequence_length)
        local = rope_parameters({"rope_parameters": ropes[SLIDING]})
        check_rope_length(local, max_sequence_length, config.max_position_embeddings, name)
        sliding = tuple(i for i, kind in enumerate(raw["layer_types"]) if kind == SLIDING)
        return dataclasses.replace(
            args,
            attn_softcap=None,
            final_softcap=args.final_softcap if cls.caps_logits else None,
            local_rope=local,
            local_rope_layers=sliding,
        )

    def __init__(
        self,
        config: ModelConfig,
        weights: Weights,
        attention: AttentionBackend,
        max_sequence_length: int,
    ) -> None:
        if config.raw.get("attn_logit_softcapping"):
            log.warning(
                "%s: attn_logit_softcapping is ignored, as transformers ignores it for Gemma 3",
                config.architecture,
            )
        super().__init__(config, weights, attention, max_sequence_length)


def layer_ropes(raw: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The rope settings of the global (``full_attention``) and the sliding layers, as
    transformers 5.24 reads them (``Gemma3TextConfig.convert_rope_params_to_dict``): its
    ``rope_parameters`` by layer type, else the global layers' from ``rope_theta`` and
    ``rope_scaling``, the sliding layers' default rope of base ``rope_local_base_freq``."""
    given = raw.get("rope_parameters") or {}
    ropes = {kind: dict(given.get(kind) or {"rope_type": "default"}) for kind in (FULL, SLIDING)}
    if raw.get("rope_scaling") is not None:
        ropes[FULL].update(raw["rope_scaling"])
    for kind, key in ((FULL, "rope_theta"), (SLIDING, "rope_local_base_freq")):
        if ropes[kind].get("rope_theta") is None:
            ropes[kind]["rope_theta"] = raw.get(key) or DEFAULT_THETA[kind]
    return ropes


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """The language model of Gemma 3's vision-language checkpoints (see the module)."""

    decoder: ClassVar[str] = "language_model.model"
    module_decoder: ClassVar[str] = "model.language_model"  # transformers' module names
    lm_head_names: ClassVar[tuple[str, ...]] = ("language_model.lm_head.weight", "lm_head.weight")
    caps_logits: ClassVar[bool] = False

    @classmethod
    def decoder_of(cls, weights: Weights) -> str:
        """``language_model.model``, or ``model.language_model`` where the checkpoint has
        the module names."""
        other = cls.module_decoder
        if f"{cls.decoder}.embed_tokens.weight" not in weights and (
            f"{other}.embed_tokens.weight" in weights
        ):
            return other
        return cls.decoder

    def __init__(
        self,
        config: ModelConfig,
        weights: Weights,
        attention: AttentionBackend,
        max_sequence_length: int,
    ) -> None:
        log.info(
            "%s: serving the language model only (text in, text out); images are not served",
            config.architecture,
        )
        super().__init__(config, weights, attention, max_sequence_length)
