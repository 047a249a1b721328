"""Batching flags: aliases and env vars, and how they reach the shard and the router."""

from __future__ import annotations

import logging
import shlex
from pathlib import Path

import pytest

from tgis.launcher.cli import parse_args
from tgis.launcher.commands import router_argv, shard_argv
from tgis.launcher.config import LauncherConfig
from tgis.launcher.resolution import resolve

from .helpers import LAUNCHER_ENV_VARS, RunLauncher

LOG = logging.getLogger("test-launcher")


@pytest.fixture(autouse=True)
def _no_launcher_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in LAUNCHER_ENV_VARS:
        monkeypatch.delenv(var, raising=False)


def argv_after(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv else None


def test_flags_and_aliases() -> None:
    config, _ = parse_args(
        shlex.split(
            "--max-total-tokens 300 --cuda-memory-fraction 0.5 --max-batch-prefill-tokens 128 "
            "--max-batch-total-tokens 1024 --waiting-served-ratio 0.3 --max-client-batch-size 8 "
            "--max-input-tokens 200"
        )
    )
    assert config == LauncherConfig(
        max_sequence_length=300, cuda_process_memory_fraction=0.5, max_batch_prefill_tokens=128,
        max_batch_total_tokens=1024, waiting_served_ratio=0.3, max_client_batch_size=8,
        max_input_tokens=200,
    )  # fmt: skip


def test_env_vars_and_aliases(monkeypatch: pytest.MonkeyPatch) -> None:
    for var, value in {
        "MAX_TOTAL_TOKENS": "300",
        "CUDA_MEMORY_FRACTION": "0.25",
        "MAX_BATCH_PREFILL_TOKENS": "64",
        "MAX_BATCH_TOTAL_TOKENS": "2048",
        "WAITING_SERVED_RATIO": "2",
        "MAX_CLIENT_BATCH_SIZE": "3",
        "MAX_INPUT_TOKENS": "100",
    }.items():
        monkeypatch.setenv(var, value)
    config, _ = parse_args([])
    assert (config.max_sequence_length, config.cuda_process_memory_fraction) == (300, 0.25)
    assert (config.max_batch_prefill_tokens, config.max_batch_total_tokens) == (64, 2048)
    assert (config.waiting_served_ratio, config.max_client_batch_size) == (2.0, 3)
    assert config.max_input_tokens == 100
    monkeypatch.setenv("MAX_SEQUENCE_LENGTH", "400")  # TGIS's name first
    assert parse_args([])[0].max_sequence_length == 400
    assert parse_args(["--max-sequence-length", "500"])[0].max_sequence_length == 500


def test_unset_batching_flags_leave_the_tgis_command_lines_alone(model_dir: Path) -> None:
    cfg = resolve(LauncherConfig(model_name=str(model_dir)), {}, LOG)
    router = router_argv("tgr", cfg, Path("/t"))
    shard = shard_argv("tgs", cfg)
    for flag in ("--max-batch-prefill-tokens", "--max-batch-total-tokens"):
        assert flag not in router and flag not in shard
    for flag in ("--waiting-served-ratio", "--max-client-batch-size", "--max-input-tokens"):
        assert flag not in router


def test_set_flags_reach_the_router_and_the_shard(model_dir: Path) -> None:
    flags = LauncherConfig(
        model_name=str(model_dir), max_batch_total_tokens=1024, waiting_served_ratio=0.5,
        max_client_batch_size=4, max_input_tokens=100, cuda_process_memory_fraction=0.5,
    )  # fmt: skip
    cfg = resolve(flags, {}, LOG)
    router = router_argv("tgr", cfg, Path("/t"))
    shard = shard_argv("tgs", cfg)
    assert argv_after(router, "--max-batch-total-tokens") == "1024"
    assert argv_after(router, "--waiting-served-ratio") == "0.5"
    assert argv_after(router, "--max-client-batch-size") == "4"
    assert argv_after(router, "--max-input-tokens") == "100"
    assert "--max-batch-prefill-tokens" not in router  # the router lowers its own default
    # The shard sizes its cache by the total and warms up with the router's prefill budget.
    assert argv_after(shard, "--max-batch-total-tokens") == "1024"
    assert argv_after(shard, "--max-batch-prefill-tokens") == "1024"
    assert argv_after(shard, "--cuda-process-memory-fraction") == "0.5"
    cfg = resolve(LauncherConfig(model_name=str(model_dir), max_batch_prefill_tokens=77), {}, LOG)
    assert argv_after(router_argv("tgr", cfg, Path("/t")), "--max-batch-prefill-tokens") == "77"
    assert argv_after(shard_argv("tgs", cfg), "--max-batch-prefill-tokens") == "77"


def test_dry_run_prints_them(run_launcher: RunLauncher, model_dir: Path) -> None:
    run = run_launcher(
        ["--model-name", str(model_dir), "--max-batch-total-tokens", "512", "--dry-run"],
        {"MAX_CLIENT_BATCH_SIZE": "2"},
    )
    assert run.returncode == 0, run.stderr
    router = next(line for line in run.stdout.splitlines() if line.startswith("Router: "))
    assert "--max-batch-total-tokens 512" in router and "--max-client-batch-size 2" in router
