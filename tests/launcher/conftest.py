"""Fixtures: a tiny model directory and a runner for the real launcher console script."""

from __future__ import annotations

import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

from .helpers import (
    LauncherRun,
    RunLauncher,
    clean_env,
    launcher_command,
    write_model,
)


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    """A model directory whose config.json says max_position_embeddings 256."""
    return write_model(tmp_path / "model", {"model_type": "llama", "max_position_embeddings": 256})


@pytest.fixture
def run_launcher(tmp_path: Path) -> RunLauncher:
    """Run the real `text-generation-launcher` with args and env; it must finish within 20 s."""
    counter = [0]

    def run(args: Sequence[str], env: Mapping[str, str] | None = None) -> LauncherRun:
        counter[0] += 1
        log_file = tmp_path / f"termination-log-{counter[0]}"
        full_env = clean_env({"TGIS_TERMINATION_LOG": str(log_file), **(env or {})})
        result = subprocess.run(
            [*launcher_command(), *args],
            env=full_env,
            capture_output=True,
            text=True,
            timeout=20,
            check=False,
        )
        log = log_file.read_text() if log_file.exists() else None
        return LauncherRun(result.returncode, result.stdout, result.stderr, log)

    return run
