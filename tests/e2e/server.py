"""Start the real `text-generation-launcher` as a subprocess on free loopback ports."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from tgis.procinfo import descendants, free_port, is_alive

__all__ = ["LauncherProcess", "descendants", "free_port", "is_alive", "start_launcher"]

BIN_DIR = Path(sys.executable).parent


@dataclass
class LauncherProcess:
    proc: subprocess.Popen[bytes]
    grpc_port: int
    http_port: int
    log_path: Path
    socket_dir: Path
    args: list[str] = field(default_factory=list)

    @property
    def grpc_target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def log_tail(self, chars: int = 6000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return "<no log>"

    def http_get(self, path: str, timeout: float = 70.0) -> tuple[int, bytes]:
        url = f"http://127.0.0.1:{self.http_port}{path}"
        try:
            with urllib.request.urlopen(url, timeout=timeout) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as err:
            return err.code, err.read()

    def wait_healthy(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"launcher exited with {self.proc.returncode}:\n{self.log_tail()}"
                )
            try:
                status, _ = self.http_get("/health", timeout=5.0)
                if status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"server not healthy after {timeout}s:\n{self.log_tail()}")

    def stop(self, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        shutil.rmtree(self.socket_dir, ignore_errors=True)
        return self.proc.returncode


def start_launcher(
    log_dir: Path, extra_args: list[str] | None = None, env: dict[str, str] | None = None
) -> LauncherProcess:
    grpc_port, http_port = free_port(), free_port()
    # Unix socket paths are limited to 108 bytes: keep them short.
    socket_dir = Path(tempfile.mkdtemp(prefix="tgis-", dir="/tmp"))
    args = [
        str(BIN_DIR / "text-generation-launcher"),
        "--grpc-port",
        str(grpc_port),
        "--port",
        str(http_port),
        "--shard-uds-path",
        str(socket_dir / "shard"),
        "--master-port",
        str(free_port()),
        "--max-batch-size",
        "16",
        *(extra_args or []),
    ]
    # Run the suite against another local model (e.g. on a GPU machine); default: embedded.
    if os.environ.get("TGIS_E2E_MODEL"):
        args += ["--model-name", os.environ["TGIS_E2E_MODEL"]]
    log_path = log_dir / f"launcher-{grpc_port}.log"
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    for var in ("MODEL_NAME", "NUM_GPUS", "CUDA_VISIBLE_DEVICES", "NUM_SHARD"):
        if env is None or var not in env:
            full_env.pop(var, None)
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(
            args,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env=full_env,
            start_new_session=True,
        )
    return LauncherProcess(proc, grpc_port, http_port, log_path, socket_dir, args)
