"""Choose the shard's engine: the native paged implementation or the transformers fallback.

``TGIS_ENGINE`` = ``auto`` (default) | ``native`` | ``hf``:

* ``auto``: the native engine when the architecture is in the native registry
  (``models.ARCHITECTURES``), else the transformers fallback, whatever the deployment
  framework (``hf_transformers``, ``hf_accelerate``, ``hf_custom_tp``, ``hf_optimum_*``,
  ``ibm_fms``), except that ``tgis_native`` (and its legacy name ``hf_custom_tp``) asks for
  the native engine, as does more than one shard;
* ``native``: the native engine, or a start-up error naming the supported architectures;
* ``hf``: always the transformers fallback.
"""

from __future__ import annotations

import logging
from typing import Literal

from tgis.shard.checkpoints.model_config import ModelConfig
from tgis.shard.errors import StartupError
from tgis.shard.native.models import check_config, model_class

log = logging.getLogger(__name__)

ENGINE_ENV = "TGIS_ENGINE"
ENGINE_CHOICES = ("auto", "native", "hf")
NATIVE_FRAMEWORKS = frozenset({"tgis_native", "hf_custom_tp"})

Engine = Literal["native", "hf"]


def select_engine(
    deployment_framework: str | None,
    model_config: ModelConfig,
    world_size: int = 1,
    requested: str = "auto",
    max_sequence_length: int = 2048,
) -> Engine:
    """The engine to load ``model_config`` with, ``requested`` by ``TGIS_ENGINE``;
    StartupError for an impossible choice."""
    requested = requested.strip().lower() or "auto"
    if requested not in ENGINE_CHOICES:
        raise StartupError(f"{ENGINE_ENV}={requested} is not one of {', '.join(ENGINE_CHOICES)}")
    if requested == "auto" and (deployment_framework in NATIVE_FRAMEWORKS or world_size > 1):
        requested = "native"
    engine: Engine
    if requested == "hf":
        engine = "hf"
    elif requested == "native":
        _require_native(model_config)
        engine = "native"
    else:
        engine = "native" if has_native(model_config, max_sequence_length) else "hf"
    log.info(
        "Engine: %s (%s=%s, deployment framework %s, architecture %s)",
        "native paged" if engine == "native" else "transformers fallback",
        ENGINE_ENV,
        requested,
        deployment_framework or "unset",
        model_config.architecture or model_config.model_type,
    )
    return engine


def _require_native(model_config: ModelConfig) -> None:
    """StartupError naming the supported architectures and the way to the fallback."""
    try:
        model_class(model_config)
    except StartupError as e:
        raise StartupError(
            f"{e}; the native engine was asked for (TGIS_ENGINE=native or deployment "
            f"framework tgis_native): use hf_transformers or TGIS_ENGINE=hf for the "
            f"transformers fallback"
        ) from None


def has_native(model_config: ModelConfig, max_sequence_length: int) -> bool:
    """Whether the native registry implements the model's architecture *and* this variant of
    it (an ALiBi Falcon or a yarn-scaled Qwen2 go to the fallback instead of failing)."""
    try:
        check_config(model_config, max_sequence_length)
    except StartupError as e:
        log.info("native engine cannot run this model (%s)", e)
        return False
    return True


def dummy_needs_native(model_config: ModelConfig, max_sequence_length: int) -> str:
    """Why ``--load-format dummy`` cannot serve a model the transformers fallback would."""
    try:
        check_config(model_config, max_sequence_length)
        reason = f"{ENGINE_ENV}=hf"  # a native model, but the fallback was asked for
    except StartupError as e:
        reason = str(e)
    name = model_config.architecture or model_config.model_type
    return (
        f"--load-format dummy needs the native engine, but {name} is served by the "
        f"transformers fallback: {reason}"
    )
