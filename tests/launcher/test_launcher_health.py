"""The shard readiness probe: socket present and a gRPC Health call answered."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

from tgis.launcher.health import shard_is_ready

from .helpers import FAKE_CHILD, read_pid


def test_no_socket_is_not_ready(tmp_path: Path) -> None:
    assert not shard_is_ready(str(tmp_path / "shard-0"))


def test_stale_socket_is_not_ready(tmp_path: Path) -> None:
    path = str(tmp_path / "shard-0")
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(path)
    stale.close()  # the file stays, nobody listens
    start = time.monotonic()
    assert not shard_is_ready(path, timeout=1.0)
    assert time.monotonic() - start < 3


def test_serving_shard_is_ready(tmp_path: Path) -> None:
    path = tmp_path / "shard-0"
    proc = subprocess.Popen(
        [sys.executable, str(FAKE_CHILD), str(tmp_path), "shard0", f"health={path}"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        read_pid(tmp_path / "shard0.pid")  # written once the server is up
        assert shard_is_ready(str(path))
    finally:
        proc.kill()
        proc.wait()
