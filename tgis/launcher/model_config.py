"""The model as the launcher sees it: its directory, and what its config.json says about the
context length (max_sequence_length; a vision-language model's, its language model's:
``text_config.text_model_config``; by default no longer than the native engine's rope is
exact for: ``native_rope_limit``)."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tgis.launcher.config import ConfigError, LauncherConfig
from tgis.model_files import MAX_SEQUENCE_LENGTH_KEYS, ModelNotFoundError, resolve_model_dir
from tgis.shard.checkpoints.text_config import text_model_config

DEFAULT_MAX_SEQUENCE_LENGTH = 2048

NAME_THE_MODEL = (
    "--model-name / MODEL_NAME (or TGI's --model-id / MODEL_ID): a directory with "
    "config.json, or a model id in the local Hugging Face cache"
)
EMBEDDED_MODEL_WARNING = (
    "No model named: serving the embedded demo model, a 4M-parameter toy that writes "
    f"English-like noise. To serve a model, name it with {NAME_THE_MODEL}"
)
NO_MODEL_MESSAGE = (
    "no model named, and TGIS_REQUIRE_MODEL (--require-model) refuses to serve the embedded "
    f"demo model: name the model with {NAME_THE_MODEL}"
)


def check_model_named(flags: LauncherConfig, log: logging.Logger) -> None:
    """Without a model named, the embedded demo model is served: a warning, or (with
    ``--require-model``, which the container image sets) a ConfigError."""
    if flags.model_name:
        return
    if flags.require_model:
        raise ConfigError(NO_MODEL_MESSAGE)
    log.warning(EMBEDDED_MODEL_WARNING)


def find_model_dir(model_name: str | None, revision: str | None) -> Path:
    """The directory holding the model's config.json (`tgis.model_files`); None or "" is the
    embedded model, which must be there."""
    try:
        model_dir = resolve_model_dir(model_name, revision)
    except ModelNotFoundError as e:
        raise ConfigError(str(e)) from None
    if not model_name and not (model_dir / "config.json").is_file():
        raise ConfigError(f"the embedded model is missing from {model_dir} (no config.json)")
    return model_dir


def speculator_heads(name: str) -> int | None:
    """The ``n_predict`` of the MLP speculator ``name`` names (its config.json's
    ``MLPSpeculatorPreTrainedModel``); None where it is a draft model or not found here."""
    try:
        raw = json.loads((resolve_model_dir(name) / "config.json").read_text(encoding="utf-8"))
    except (ModelNotFoundError, OSError, ValueError):
        return None
    if not isinstance(raw, dict):
        return None
    mlp = raw.get("model_type") == "mlp_speculator" or "MLPSpeculatorPreTrainedModel" in (
        raw.get("architectures") or ()
    )
    heads = raw.get("n_predict")
    return heads if mlp and isinstance(heads, int) and heads > 0 else None


def read_model_config(model_dir: Path) -> dict[str, Any]:
    """Parse `<model_dir>/config.json`: the language model's part, as the shard reads it."""
    path = model_dir / "config.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"model config not found: {path}") from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read model config {path}: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"model config {path} is not a JSON object")
    return text_model_config(data)


def model_max_sequence_length(model_config: Mapping[str, Any]) -> int | None:
    """The first integer among the known context-length keys of a config.json, if any."""
    for key in MAX_SEQUENCE_LENGTH_KEYS:
        value = model_config.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
    return None


def native_rope_limit(model_config: Mapping[str, Any]) -> int | None:
    """The longest sequence the native engine's rope is exact for, where a config.json sets
    one: LongRoPE's (``longrope``, formerly ``su``; Phi-3 also calls it ``yarn``)
    ``original_max_position_embeddings``, past which transformers switches to the long
    factors and recomputes a sequence's keys, which the paged cache cannot (the shard
    refuses a longer --max-sequence-length: ``rotary.check_rope_length``)."""
    rope = model_config.get("rope_parameters") or model_config.get("rope_scaling")
    if not isinstance(rope, Mapping):
        return None
    rope_type = rope.get("rope_type") or rope.get("type")
    longrope = ("longrope", "su", "yarn") if model_config.get("model_type") == "phi3" else ()
    if rope_type not in (*longrope, "longrope", "su"):
        return None
    original = model_config.get("original_max_position_embeddings")  # wins, as in transformers
    if original is None:
        original = rope.get("original_max_position_embeddings")
    if isinstance(original, int) and not isinstance(original, bool) and original > 0:
        return original
    return None


def resolve_max_sequence_length(
    user_value: int | None,
    model_config: Mapping[str, Any],
    log: logging.Logger,
    engine: str = "auto",
) -> int:
    """User value, else the model's (config.json), else 2048; logged with its source.

    The model's value is capped at ``native_rope_limit`` unless ``engine`` (TGIS_ENGINE) is
    the transformers fallback (``hf``), so that a LongRoPE model (Phi-3 128k) starts on the
    native engine with no flags instead of being refused (TGIS_ENGINE=native) or sent to
    the fallback (auto)."""
    model_value = model_max_sequence_length(model_config)
    limit = native_rope_limit(model_config)
    fallback = engine.strip().lower() == "hf"
    if user_value is None and model_value and limit and limit < model_value and not fallback:
        log.info(
            "max_sequence_length: %d, the model's longrope original_max_position_embeddings, "
            "not its max_position_embeddings (%d): the native engine serves only the short "
            "rope factors; a longer --max-sequence-length is served by the transformers "
            "fallback (TGIS_ENGINE=hf or auto)",
            limit,
            model_value,
        )
        model_value = limit
    if user_value is not None:
        if model_value is not None and user_value > model_value:
            log.warning(
                "max_sequence_length (%d) is larger than the model's (%d)", user_value, model_value
            )
        source, value = "user-defined", user_value
    elif model_value is not None:
        source, value = "model", model_value
    else:
        source, value = "default", DEFAULT_MAX_SEQUENCE_LENGTH
    log.info("Using %s max_sequence_length: %d", source, value)
    if value < 2:
        raise ConfigError(f"max_sequence_length ({value}) must be at least 2 (1 input + 1 output)")
    return value
