"""Start the real `text-generation-launcher` as a subprocess on free loopback ports."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tgis.launcher.local_process import BIN_DIR, LauncherProcess, serving
from tgis.launcher.local_process import start_launcher as _start
from tgis.procinfo import descendants, free_port, free_ports, is_alive

__all__ = [
    "BIN_DIR",
    "LauncherProcess",
    "descendants",
    "free_port",
    "free_ports",
    "healthy_launcher",
    "is_alive",
    "start_launcher",
]

# Settings of the developer's shell that would change what the tests start.
ISOLATED_ENV = ("MODEL_NAME", "NUM_GPUS", "CUDA_VISIBLE_DEVICES", "NUM_SHARD")


def start_launcher(
    log_dir: Path, extra_args: list[str] | None = None, env: dict[str, str] | None = None
) -> LauncherProcess:
    args = list(extra_args or [])
    # Run the suite against another local model (e.g. on a GPU machine); default: embedded.
    if os.environ.get("TGIS_E2E_MODEL"):
        args += ["--model-name", os.environ["TGIS_E2E_MODEL"]]
    return _start(log_dir, args, env, unset_env=ISOLATED_ENV)


@contextmanager
def healthy_launcher(
    log_dir: Path, extra_args: list[str] | None = None, env: dict[str, str] | None = None
) -> Iterator[LauncherProcess]:
    """A launcher (``start_launcher``) serving for the block's duration: healthy when the
    block starts, stopped when it ends."""
    with serving(start_launcher(log_dir, extra_args, env)) as launcher:
        yield launcher
