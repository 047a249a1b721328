"""The language model's part of a ``config.json``, with the defaults a config may omit.

A vision-language checkpoint (Gemma 3's ``Gemma3ForConditionalGeneration``) nests its
language model's config under ``text_config`` (what transformers' ``get_text_config``
returns) and has no ``vocab_size`` of its own; tgis serves its language model only (text in,
text out), so ``ModelConfig`` reads that text config, with the outer config's architecture,
model type, dtype, end-of-sequence ids, tied head and quantization on top (``OUTER_KEYS``).

A published config may give only what differs from its transformers config class's defaults
(Gemma 3 4B's ``text_config`` has no ``vocab_size``, ``num_attention_heads``, ...):
``CONFIG_DEFAULTS`` holds those defaults, by ``model_type``, for the fields tgis reads, as
transformers 5.24 fills them in.
"""

from __future__ import annotations

from typing import Any

OUTER_KEYS = (
    "architectures",
    "model_type",
    "dtype",
    "torch_dtype",
    "eos_token_id",
    "tie_word_embeddings",
    "quantization_config",
)
"""The keys of a nested config's outer level that describe the whole checkpoint."""

CONFIG_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma3_text": dict(  # Gemma3TextConfig's (its rope defaults: models/gemma3.py)
        vocab_size=262_208,
        hidden_size=2304,
        intermediate_size=9216,
        num_hidden_layers=26,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=256,
        hidden_activation="gelu_pytorch_tanh",
        max_position_embeddings=131_072,
        rms_norm_eps=1e-6,
        eos_token_id=1,
        tie_word_embeddings=True,
        attention_bias=False,
        query_pre_attn_scalar=256,
        sliding_window=4096,
    ),
}


def text_model_config(raw: dict[str, Any]) -> dict[str, Any]:
    """``raw`` as the language model's config: its ``text_config`` when it nests one and has
    no ``vocab_size`` itself, with ``OUTER_KEYS`` from the outer level; the defaults of its
    model type under what the config gives."""
    text = raw.get("text_config")
    if not isinstance(text, dict) or raw.get("vocab_size") is not None:
        return _with_defaults(raw)
    merged = _with_defaults(text)
    merged.update({key: raw[key] for key in OUTER_KEYS if raw.get(key) is not None})
    return merged


def _with_defaults(raw: dict[str, Any]) -> dict[str, Any]:
    """``raw`` over its model type's ``CONFIG_DEFAULTS``: a missing key takes the default (a
    null one stays null, as transformers reads it)."""
    return CONFIG_DEFAULTS.get(str(raw.get("model_type", "")), {}) | raw
