"""The exact command lines and environments of the shard and router processes (§5.1)."""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tgis.launcher.config import (
    ConfigError,
    LauncherConfig,
    ResolvedConfig,
    effective_max_batch_prefill_tokens,
)
from tgis.launcher.model_config import speculator_heads
from tgis.settings.catalogue import read_by
from tgis.settings.declaration import Process
from tgis.settings.forwarding import child_argv, child_env

SHARD_PROGRAM = "text-generation-server"
ROUTER_PROGRAM = "text-generation-router"

DEFAULT_PYTORCH_CUDA_ALLOC_CONF = "expandable_segments:True"


def find_program(name: str) -> str:
    """The console script next to the running Python (same venv), else on PATH."""
    beside = Path(sys.executable).parent / name
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which(name)
    if found is None:
        raise ConfigError(f"{name} not found next to {sys.executable} or on PATH")
    return found


def shard_socket_path(prefix: str, rank: int) -> str:
    """Where shard `rank` listens: `<shard_uds_path>-<rank>`."""
    return f"{prefix}-{rank}"


def shard_values(cfg: ResolvedConfig) -> dict[str, Any]:
    """What the shards are given: the launcher's values of the settings they read, with the
    resolved ones in their place (the model's directory, the framework, the dtype, the
    sequence length, the prefill budget), and what only applies with another setting
    (LoRA limits with an adapter cache, speculation's limit with speculation) left out."""
    flags = cfg.flags
    adapters = bool(flags.adapter_cache)
    speculate = speculation_depth(flags)
    values = {
        s.name: getattr(flags, s.name) for s in read_by(Process.SHARD) if hasattr(flags, s.name)
    }
    values.update(
        model_name=str(cfg.model_dir),
        deployment_framework=cfg.deployment_framework,
        dtype=cfg.dtype,
        max_sequence_length=cfg.max_sequence_length,
        max_batch_prefill_tokens=effective_max_batch_prefill_tokens(flags),
        load_format=None if cfg.load_format == "auto" else cfg.load_format,
        sharded=cfg.num_shard > 1,
        max_loras=flags.max_loras if adapters else None,
        max_lora_rank=flags.max_lora_rank if adapters else None,
        speculate=speculate or None,
        speculator_max_batch_size=flags.speculator_max_batch_size if speculate else None,
    )
    return values


def shard_argv(program: str, cfg: ResolvedConfig) -> list[str]:
    """`text-generation-server serve ...`; the same for every rank (the rank is in the env)."""
    return [program, "serve", *child_argv(Process.SHARD, shard_values(cfg))]


def shard_env(cfg: ResolvedConfig, rank: int, base: Mapping[str, str]) -> dict[str, str]:
    """The launcher's environment plus the distributed and runtime settings of shard `rank`
    (its global rank; LOCAL_RANK, its GPU, counts from this node's first rank)."""
    env = dict(base)
    node = cfg.node
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(node.local_rank(rank)),
        WORLD_SIZE=str(cfg.num_shard),
        LOCAL_SIZE=str(node.per_node),
        CROSS_SIZE=str(node.nnodes),
        CROSS_RANK=str(node.node_rank),
        MASTER_ADDR=cfg.flags.master_addr,
        MASTER_PORT=str(cfg.flags.master_port),
        HF_HUB_OFFLINE="1",
        HF_HUB_CACHE=str(cfg.hf_hub_cache),
        PYTHONUNBUFFERED="1",
        NCCL_ASYNC_ERROR_HANDLING="1",
        TORCH_NCCL_AVOID_RECORD_STREAMS="1",
        SAFETENSORS_FAST_GPU="1",
    )
    alloc_conf = base.get("PYTORCH_CUDA_ALLOC_CONF")
    if alloc_conf is None:
        env["PYTORCH_CUDA_ALLOC_CONF"] = DEFAULT_PYTORCH_CUDA_ALLOC_CONF
    elif not alloc_conf.strip():
        del env["PYTORCH_CUDA_ALLOC_CONF"]
    return env


DRAFT_MODEL_DEPTH = 4
"""Tokens a draft model drafts per step when only ``--speculator-name`` is given."""


def speculation_depth(flags: LauncherConfig) -> int:
    """Tokens drafted per sequence and step: ``--speculate``, else an MLP speculator's
    heads (``n_predict``), else ``DRAFT_MODEL_DEPTH`` with a draft model, else 0 (off)."""
    if flags.speculate or not flags.speculator_name:
        return flags.speculate
    return speculator_heads(flags.speculator_name) or DRAFT_MODEL_DEPTH


def router_values(cfg: ResolvedConfig, tokenizer_path: Path) -> dict[str, Any]:
    """What the router is given: the launcher's values of the settings it reads, with the
    resolved and derived ones in their place (shard 0's socket, the tokenizer, the served
    model's name and directory, the sequence length), and what only applies with another
    setting left out (TLS without both files, speculation's limits without it, the tracing
    service name without an endpoint)."""
    flags = cfg.flags
    tls = bool(flags.tls_cert_path and flags.tls_key_path)
    speculate = speculation_depth(flags)
    values = {
        s.name: getattr(flags, s.name) for s in read_by(Process.ROUTER) if hasattr(flags, s.name)
    }
    values.update(
        max_sequence_length=cfg.max_sequence_length,
        master_shard_uds_path=shard_socket_path(flags.shard_uds_path, 0),
        tokenizer_path=str(tokenizer_path),
        served_model_name=cfg.served_model_name,
        model_dir=str(cfg.model_dir),
        tls_cert_path=flags.tls_cert_path if tls else None,
        tls_key_path=flags.tls_key_path if tls else None,
        speculate=speculate or None,
        speculator_max_batch_size=flags.speculator_max_batch_size if speculate else None,
        speculate_always=flags.speculate_always if speculate else None,
        prompt_lookup_min=flags.prompt_lookup_min if speculate else None,
        prompt_lookup_max=flags.prompt_lookup_max if speculate else None,
        otlp_service_name=flags.otlp_service_name if flags.otlp_endpoint else None,
    )
    return values


def router_env(cfg: ResolvedConfig, base: Mapping[str, str]) -> dict[str, str] | None:
    """The router's environment: the launcher's, with the secrets (``--api-key`` as
    ``API_KEY``: an environment variable, not a flag other users could read in the process
    list)."""
    secrets = child_env(Process.ROUTER, {"api_key": cfg.flags.api_key})
    if not secrets:
        return None
    return {**base, **secrets}


def router_argv(program: str, cfg: ResolvedConfig, tokenizer_path: Path) -> list[str]:
    """`text-generation-router ...` pointing at shard 0's socket and the tokenizer.json.

    Optional settings are passed only when set, so the router's own defaults apply
    (batching: by capacity, joining at the next step)."""
    return [program, *child_argv(Process.ROUTER, router_values(cfg, tokenizer_path))]
