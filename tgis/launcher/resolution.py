"""The flags, the environment and the model's config.json → one validated `ResolvedConfig`.

Everything here is checked before any process is started, in a fixed order: the flags
alone, the shard count and socket path, the hub cache, the model, max_sequence_length and
the batching flags against it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from tgis.launcher.config import EMBEDDED_MODEL_NAME, LauncherConfig, ResolvedConfig
from tgis.launcher.environment import resolve_hf_hub_cache, resolve_num_shard
from tgis.launcher.model_config import (
    check_model_named,
    find_model_dir,
    read_model_config,
    resolve_max_sequence_length,
)
from tgis.launcher.nodes import resolve_placement
from tgis.launcher.validation import (
    normalize_deployment_framework,
    resolve_dtype,
    resolve_load_format,
    validate_batching,
    validate_limits,
    validate_quantize,
    validate_shard_uds_path,
    validate_tls,
)


def resolve(
    flags: LauncherConfig, environ: Mapping[str, str], log: logging.Logger
) -> ResolvedConfig:
    """Validate every flag and derive the settings the shards and the router are started with."""
    framework = normalize_deployment_framework(flags.deployment_framework, log)
    dtype = resolve_dtype(flags.dtype, flags.dtype_str)
    load_format = resolve_load_format(flags.load_format)
    validate_quantize(flags.quantize)
    validate_limits(flags)
    if flags.max_best_of > 1:
        log.warning(
            "max_best_of is %d, but each choice is one generated sequence here: requests "
            "asking for best_of above 1 are refused",
            flags.max_best_of,
        )
    validate_tls(flags)
    num_shard = resolve_num_shard(flags.num_shard, environ)
    placement = resolve_placement(num_shard, flags.nnodes, flags.node_rank)
    validate_shard_uds_path(flags.shard_uds_path, num_shard)
    hf_hub_cache = resolve_hf_hub_cache(environ, log)
    check_model_named(flags, log)
    model_dir = find_model_dir(flags.model_name, flags.revision)
    model_config = read_model_config(model_dir)
    max_sequence_length = resolve_max_sequence_length(
        flags.max_sequence_length, model_config, log, environ.get("TGIS_ENGINE", "auto")
    )
    validate_batching(flags, max_sequence_length=max_sequence_length)
    return ResolvedConfig(
        flags=flags,
        model_dir=model_dir,
        served_model_name=flags.served_model_name or flags.model_name or EMBEDDED_MODEL_NAME,
        deployment_framework=framework,
        dtype=dtype,
        num_shard=num_shard,
        max_sequence_length=max_sequence_length,
        hf_hub_cache=hf_hub_cache,
        load_format=load_format,
        placement=placement,
    )
