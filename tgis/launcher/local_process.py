"""The real ``text-generation-launcher`` as a child process on free loopback ports.

For the end-to-end tests and the benchmark scripts: start it in its own session with
short Unix-socket paths, wait for ``/health``, read its log, stop it with SIGTERM (SIGKILL
of the whole group if it hangs). No torch import.
"""

from __future__ import annotations

import os
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from tgis.procinfo import descendants, free_ports

BIN_DIR = Path(sys.executable).parent


@dataclass
class LauncherProcess:
    proc: subprocess.Popen[bytes]
    grpc_port: int
    http_port: int
    log_path: Path
    socket_dir: Path
    args: list[str] = field(default_factory=list)
    # The CA that signed the HTTP port's certificate, for a launcher started with --http-tls.
    http_ca: Path | None = None

    @property
    def grpc_target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return self.http_base + "/metrics"

    def log_tail(self, chars: int = 6000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return "<no log>"

    @property
    def http_base(self) -> str:
        """``http://`` or, with ``http_ca`` set, ``https://`` and the loopback HTTP port."""
        scheme = "https" if self.http_ca is not None else "http"
        return f"{scheme}://127.0.0.1:{self.http_port}"

    def http_get(self, path: str, timeout: float = 70.0) -> tuple[int, bytes]:
        url = self.http_base + path
        context = None
        if self.http_ca is not None:
            context = ssl.create_default_context(cafile=str(self.http_ca))
        try:
            with urllib.request.urlopen(url, timeout=timeout, context=context) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as err:
            return err.code, err.read()

    def wait_healthy(self, timeout: float = 180.0) -> None:
        """Poll ``/health`` until it answers 200; raise with the log tail otherwise."""
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
            time.sleep(0.1)
        raise TimeoutError(f"server not healthy after {timeout:.0f} s:\n{self.log_tail()}")

    def process_pids(self) -> dict[str, list[int]]:
        """The router and shard process ids, found by their command lines."""
        roles: dict[str, list[int]] = {"router": [], "shard": []}
        for pid in descendants(self.proc.pid):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
            except OSError:
                continue
            if b"text-generation-router" in cmdline:
                roles["router"].append(pid)
            elif b"text-generation-server" in cmdline or b"tgis.shard" in cmdline:
                roles["shard"].append(pid)
        return roles

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM the launcher (it stops router and shards); SIGKILL its group if it hangs."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        shutil.rmtree(self.socket_dir, ignore_errors=True)
        return int(self.proc.returncode)


def start_launcher(
    log_dir: Path,
    extra_args: Sequence[str] = (),
    env: dict[str, str] | None = None,
    *,
    unset_env: Sequence[str] = ("MODEL_NAME",),
    log_name: str | None = None,
    max_batch_size: int | None = 16,
) -> LauncherProcess:
    """Start the launcher on free ports (``--max-batch-size`` 16 unless ``extra_args`` say
    otherwise; ``max_batch_size=None`` leaves the launcher's default, by capacity).

    ``env`` is added to this process's environment; the variables in ``unset_env`` are
    removed unless ``env`` sets them (by default MODEL_NAME, so the embedded model serves).
    """
    grpc_port, http_port, master_port = free_ports(3)
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
        str(master_port),
        *(["--max-batch-size", str(max_batch_size)] if max_batch_size is not None else []),
        *extra_args,  # the launcher takes the last value of a repeated flag
    ]
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    for var in unset_env:
        if env is None or var not in env:
            full_env.pop(var, None)
    log_path = log_dir / (log_name or f"launcher-{grpc_port}.log")
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(
            args, stdout=log_file, stderr=subprocess.STDOUT, env=full_env, start_new_session=True
        )
    return LauncherProcess(proc, grpc_port, http_port, log_path, socket_dir, args)


@contextmanager
def serving(launcher: LauncherProcess, timeout: float = 180.0) -> Iterator[LauncherProcess]:
    """``launcher`` for the block's duration: healthy (within ``timeout`` seconds) when the
    block starts, stopped when it ends, also when it never became healthy."""
    try:
        launcher.wait_healthy(timeout)
        yield launcher
    finally:
        launcher.stop()
