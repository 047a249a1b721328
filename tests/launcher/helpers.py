"""Helpers for the launcher tests: a clean environment, model directories, the launcher
console script, fake child processes, and process liveness via /proc."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from tgis.launcher.children import ChildSpec
from tgis.procinfo import is_alive
from tgis.settings.catalogue import SETTINGS

# Every variable of a setting (tgis/settings), and what the launcher reads besides them;
# removed from the environment of launched test processes.
LAUNCHER_ENV_VARS = [
    *(name for setting in SETTINGS for name in setting.env),
    "NUM_GPUS",
    "CUDA_VISIBLE_DEVICES",
    "NVIDIA_VISIBLE_DEVICES",
    "HF_HUB_CACHE",
    "HUGGINGFACE_HUB_CACHE",
    "TRANSFORMERS_CACHE",
    "HF_HOME",
    "PYTORCH_CUDA_ALLOC_CONF",
    "MAX_BATCH_WEIGHT",
    "MAX_PREFILL_WEIGHT",
    "TGIS_TERMINATION_LOG",
    "LOG_LEVEL",
    "GIT_COMMIT_HASH",
]


def launcher_command() -> list[str]:
    """The installed console script, else the module (a checkout without `pip install -e`)."""
    script = Path(sys.executable).parent / "text-generation-launcher"
    if script.is_file():
        return [str(script)]
    return [sys.executable, "-m", "tgis.launcher"]


def clean_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """os.environ without any launcher setting, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV_VARS}
    env.update(extra or {})
    return env


def write_model(directory: Path, config: Mapping[str, object], tokenizer: bool = True) -> Path:
    """A model directory: config.json and (unless told not to) a tokenizer.json."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    if tokenizer:
        (directory / "tokenizer.json").write_text("{}")
    return directory


@dataclass
class LauncherRun:
    """A finished launcher process and its termination log."""

    returncode: int
    stdout: str
    stderr: str
    termination_log: str | None

    @property
    def error_line(self) -> str:
        """The `error: ...` line fail_startup printed (the last one)."""
        errors = [line for line in self.stderr.splitlines() if line.startswith("error: ")]
        assert errors, f"no error line in stderr:\n{self.stderr}"
        return errors[-1].removeprefix("error: ")


alive = is_alive  # the name these tests use


def gone(*pids: int, timeout: float = 5.0) -> bool:
    """Whether every process in ``pids`` has exited within ``timeout`` seconds: a signal
    is delivered asynchronously, and a loaded host may run the target a moment later."""
    deadline = time.monotonic() + timeout
    while any(alive(pid) for pid in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


RunLauncher = Callable[..., LauncherRun]


FAKE_CHILD = Path(__file__).with_name("fake_child.py")


def wait_for(path: Path, timeout: float = 10.0) -> Path:
    """Wait until `path` exists (a child wrote it)."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise AssertionError(f"{path} did not appear within {timeout} s")
        time.sleep(0.02)
    return path


def read_pid(path: Path, timeout: float = 10.0) -> int:
    """The pid a fake child wrote (waiting for the file)."""
    wait_for(path, timeout)
    deadline = time.monotonic() + timeout
    while True:
        text = path.read_text()
        if text:
            return int(text)
        if time.monotonic() > deadline:
            raise AssertionError(f"{path} stayed empty")
        time.sleep(0.02)


def fake(directory: Path, name: str, *behaviours: str, spec_name: str | None = None) -> ChildSpec:
    """A ChildSpec running fake_child.py."""
    argv = [sys.executable, str(FAKE_CHILD), str(directory), name, *behaviours]
    return ChildSpec(spec_name or name, argv)
