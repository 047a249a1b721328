"""The exact command lines and environments of the shard and router processes (§5.1)."""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

from tgis.launcher.config import (
    ConfigError,
    LauncherConfig,
    ResolvedConfig,
    effective_max_batch_prefill_tokens,
)

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


def option_words(options: Iterable[tuple[str, object]]) -> list[str]:
    """The command-line words of options given only when set: `flag value`, or the bare flag
    when the value is True; nothing when it is None, False or ""."""
    words: list[str] = []
    for flag, value in options:
        if value is None or value is False or value == "":
            continue
        words += [flag] if value is True else [flag, str(value)]
    return words


def shard_socket_path(prefix: str, rank: int) -> str:
    """Where shard `rank` listens: `<shard_uds_path>-<rank>`."""
    return f"{prefix}-{rank}"


def shard_argv(program: str, cfg: ResolvedConfig) -> list[str]:
    """`text-generation-server serve ...`; the same for every rank (the rank is in the env)."""
    flags = cfg.flags
    adapters = bool(flags.adapter_cache)
    speculate = speculation_depth(flags)
    return [
        program,
        "serve",
        str(cfg.model_dir),
        cfg.deployment_framework,
        "--max-sequence-length",
        str(cfg.max_sequence_length),
        "--max-new-tokens",
        str(flags.max_new_tokens),
        "--batch-safety-margin",
        str(flags.batch_safety_margin),
        "--uds-path",
        flags.shard_uds_path,
        "--cuda-process-memory-fraction",
        str(flags.cuda_process_memory_fraction),
        *option_words(
            [
                ("--max-batch-size", flags.max_batch_size),
                ("--max-batch-prefill-tokens", effective_max_batch_prefill_tokens(flags)),
                ("--max-batch-total-tokens", flags.max_batch_total_tokens),
                ("--dtype", cfg.dtype),
                ("--quantize", flags.quantize),
                ("--sharded", cfg.num_shard > 1),
                ("--revision", flags.revision),
                ("--load-format", None if cfg.load_format == "auto" else cfg.load_format),
                ("--adapter-cache", flags.adapter_cache),
                ("--max-loras", flags.max_loras if adapters else None),
                ("--max-lora-rank", flags.max_lora_rank if adapters else None),
                ("--disable-prefix-caching", flags.disable_prefix_caching),
                ("--speculator-name", flags.speculator_name),
                ("--speculate", speculate or None),
                (
                    "--speculator-max-batch-size",
                    flags.speculator_max_batch_size if speculate else None,
                ),
            ]
        ),
    ]


def shard_env(cfg: ResolvedConfig, rank: int, base: Mapping[str, str]) -> dict[str, str]:
    """The launcher's environment plus the distributed and runtime settings of shard `rank`."""
    env = dict(base)
    world = str(cfg.num_shard)
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=world,
        LOCAL_SIZE=world,
        CROSS_SIZE="1",
        CROSS_RANK="0",
        MASTER_ADDR=cfg.flags.master_addr,
        MASTER_PORT=str(cfg.flags.master_port),
        HF_HUB_OFFLINE="1",
        HF_HUB_CACHE=str(cfg.hf_hub_cache),
        PYTHONUNBUFFERED="1",
        NCCL_ASYNC_ERROR_HANDLING="1",
        TORCH_NCCL_AVOID_RECORD_STREAMS="1",
        SAFETENSORS_FAST_GPU="1",
    )
    if cfg.flags.json_output:  # the shard has no flag for it; tgis.log reads the variable
        env["JSON_OUTPUT"] = "true"
    alloc_conf = base.get("PYTORCH_CUDA_ALLOC_CONF")
    if alloc_conf is None:
        env["PYTORCH_CUDA_ALLOC_CONF"] = DEFAULT_PYTORCH_CUDA_ALLOC_CONF
    elif not alloc_conf.strip():
        del env["PYTORCH_CUDA_ALLOC_CONF"]
    return env


DRAFT_MODEL_DEPTH = 4
"""Tokens a draft model drafts per step when only ``--speculator-name`` is given."""


def speculation_depth(flags: LauncherConfig) -> int:
    """Tokens drafted per sequence and step: ``--speculate``, else ``DRAFT_MODEL_DEPTH``
    with a draft model, else 0 (off)."""
    return flags.speculate or (DRAFT_MODEL_DEPTH if flags.speculator_name else 0)


def router_env(cfg: ResolvedConfig, base: Mapping[str, str]) -> dict[str, str] | None:
    """The router's environment: the launcher's, with ``--api-key`` as ``API_KEY`` (an
    environment variable, not a flag other users could read in the process list)."""
    if cfg.flags.api_key is None:
        return None
    return {**base, "API_KEY": cfg.flags.api_key}


def router_argv(program: str, cfg: ResolvedConfig, tokenizer_path: Path) -> list[str]:
    """`text-generation-router ...` pointing at shard 0's socket and the tokenizer.json.

    Optional flags are passed only when set, so the router's own defaults apply (batching:
    by capacity, joining at the next step)."""
    flags = cfg.flags
    tls = bool(flags.tls_cert_path and flags.tls_key_path)
    speculate = speculation_depth(flags)
    return [
        program,
        "--max-concurrent-requests",
        str(flags.max_concurrent_requests),
        "--max-sequence-length",
        str(cfg.max_sequence_length),
        "--max-new-tokens",
        str(flags.max_new_tokens),
        "--max-prefill-padding",
        str(flags.max_prefill_padding),
        "--port",
        str(flags.port),
        "--grpc-port",
        str(flags.grpc_port),
        "--master-shard-uds-path",
        shard_socket_path(flags.shard_uds_path, 0),
        "--tokenizer-path",
        str(tokenizer_path),
        "--model-name",
        cfg.served_model_name,
        *option_words(
            [
                ("--max-batch-size", flags.max_batch_size),
                ("--max-waiting-tokens", flags.max_waiting_tokens),
                ("--max-batch-prefill-tokens", flags.max_batch_prefill_tokens),
                ("--max-batch-total-tokens", flags.max_batch_total_tokens),
                ("--waiting-served-ratio", flags.waiting_served_ratio),
                ("--max-client-batch-size", flags.max_client_batch_size),
                ("--max-input-tokens", flags.max_input_tokens),
                ("--tls-cert-path", flags.tls_cert_path if tls else None),
                ("--tls-key-path", flags.tls_key_path if tls else None),
                ("--tls-client-ca-cert-path", flags.tls_client_ca_cert_path),
                ("--json-output", flags.json_output),
                ("--output-special-tokens", flags.output_special_tokens),
                ("--disable-prefix-caching", flags.disable_prefix_caching),
                ("--model-dir", str(cfg.model_dir)),
                ("--chat-template", flags.chat_template),
                ("--http-tls", flags.http_tls),
                ("--speculate", speculate or None),
                (
                    "--speculator-max-batch-size",
                    flags.speculator_max_batch_size if speculate else None,
                ),
                ("--prompt-lookup-min", flags.prompt_lookup_min if speculate else None),
                ("--prompt-lookup-max", flags.prompt_lookup_max if speculate else None),
                ("--default-include-stop-seqs", flags.default_include_stop_seqs),
                ("--shutdown-grace-period", flags.shutdown_grace_period),
                ("--otlp-endpoint", flags.otlp_endpoint),
                ("--otlp-service-name", flags.otlp_service_name if flags.otlp_endpoint else None),
            ]
        ),
    ]
