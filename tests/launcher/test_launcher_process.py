"""The whole launcher (`python -m tgis.launcher`) with fake shard and router programs.

The launcher finds `text-generation-server` / `text-generation-router` next to its Python, so it
runs here from a throw-away venv (pyvenv.cfg copied, lib/ linked to the real venv's) whose bin/
holds fake programs that exec fake_child.py: each shard serves gRPC Health on its socket.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .helpers import FAKE_CHILD, alive, clean_env, read_pid

REPO = Path(__file__).resolve().parents[2]

SHARD_PROGRAM = """#!{python}
import os, sys
argv = sys.argv[1:]
rank = os.environ["RANK"]
socket = argv[argv.index("--shard-uds-path") + 1] + "-" + rank
behaviour = os.environ.get("FAKE_SHARD" + rank, "").split()
health = [] if "never-ready" in behaviour else ["health=" + socket]
os.execv(sys.executable, [sys.executable, {fake!r}, os.environ["FAKE_DIR"], "shard" + rank,
                          *health, *behaviour, "--", *argv])
"""

ROUTER_PROGRAM = """#!{python}
import os, sys
os.execv(sys.executable, [sys.executable, {fake!r}, os.environ["FAKE_DIR"], "router",
                          *os.environ.get("FAKE_ROUTER", "").split(), "--", *sys.argv[1:]])
"""


@pytest.fixture
def fake_venv(tmp_path: Path) -> Path:
    """A venv sharing the real one's packages, with fake shard and router programs."""
    if sys.prefix == sys.base_prefix:
        pytest.skip("needs to run inside a virtualenv")
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    shutil.copy(Path(sys.prefix) / "pyvenv.cfg", venv / "pyvenv.cfg")
    (venv / "lib").symlink_to(Path(sys.prefix) / "lib")
    (venv / "bin" / "python").symlink_to(sys.executable)
    for name, template in (
        ("text-generation-server", SHARD_PROGRAM),
        ("text-generation-router", ROUTER_PROGRAM),
    ):
        program = venv / "bin" / name
        program.write_text(template.format(python=sys.executable, fake=str(FAKE_CHILD)))
        program.chmod(0o755)
    return venv


def start_launcher(
    venv: Path, tmp_path: Path, model_dir: Path, args: list[str], env: dict[str, str]
) -> subprocess.Popen[str]:
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    full_env = clean_env(
        {
            "FAKE_DIR": str(out),
            "TGIS_TERMINATION_LOG": str(tmp_path / "termination-log"),
            "PYTHONPATH": str(REPO),
            **env,
        }
    )
    with open(tmp_path / "stdout", "w") as stdout, open(tmp_path / "stderr", "w") as stderr:
        return subprocess.Popen(
            [str(venv / "bin" / "python"), "-m", "tgis.launcher", "--model-name", str(model_dir),
             "--shard-uds-path", str(tmp_path / "sock"), "-p", "13000", "-g", "18033", *args],
            env=full_env,
            stdout=stdout,
            stderr=stderr,
            text=True,
        )  # fmt: skip


def finish(proc: subprocess.Popen[str], timeout: float = 20) -> int:
    """Wait for the launcher; kill it if it is still running after `timeout`."""
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise


def test_runs_shards_and_router_then_stops_on_sigterm(
    fake_venv: Path, tmp_path: Path, model_dir: Path
) -> None:
    proc = start_launcher(fake_venv, tmp_path, model_dir, ["--dtype", "half"], {"NUM_GPUS": "2"})
    out = tmp_path / "out"
    try:
        router = read_pid(out / "router.pid", timeout=20)
        shards = [read_pid(out / f"shard{rank}.pid") for rank in (0, 1)]
        assert all(alive(pid) for pid in [router, *shards])
        assert (tmp_path / "sock-0").exists() and (tmp_path / "sock-1").exists()
        proc.send_signal(signal.SIGTERM)
        assert finish(proc) == 0
    finally:
        proc.kill()
    assert not any(alive(pid) for pid in [router, *shards])
    assert not (tmp_path / "sock-0").exists() and not (tmp_path / "sock-1").exists()
    assert float((out / "router.term").read_text()) < float((out / "shard0.term").read_text())

    shard1 = json.loads((out / "shard1.json").read_text())
    assert shard1["argv"] == [
        "serve", str(model_dir), "hf_transformers", "--dtype", "float16",
        "--sharded", "--shard-uds-path", str(tmp_path / "sock"),
        "--max-sequence-length", "256", "--max-new-tokens", "1024",
        "--batch-safety-margin", "20", "--cuda-process-memory-fraction", "1.0",
    ]  # fmt: skip
    env = shard1["env"]
    assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["LOCAL_SIZE"]) == (
        "1", "1", "2", "2",
    )  # fmt: skip
    assert env["HF_HUB_OFFLINE"] == "1" and env["MASTER_PORT"] == "29500"
    router_argv = json.loads((out / "router.json").read_text())["argv"]
    assert router_argv[router_argv.index("--master-shard-uds-path") + 1] == f"{tmp_path}/sock-0"
    assert router_argv[router_argv.index("--tokenizer-path") + 1] == f"{model_dir}/tokenizer.json"

    stdout = (tmp_path / "stdout").read_text()
    stderr = (tmp_path / "stderr").read_text()
    assert "Shard 0: fake shard0 started" in stdout
    assert "Router: fake router started" in stdout
    assert "Shard 1: fake shard1 says hello on stderr" in stderr
    assert "Shard 1 ready in" in stderr
    assert "Received SIGTERM, shutting down" in stderr
    assert not (tmp_path / "termination-log").exists()


def test_shard_death_fails_the_launcher(fake_venv: Path, tmp_path: Path, model_dir: Path) -> None:
    proc = start_launcher(fake_venv, tmp_path, model_dir, [], {"FAKE_SHARD0": "exit=1.5:7"})
    assert finish(proc) == 1
    out = tmp_path / "out"
    assert (out / "router.json").exists()
    assert not alive(read_pid(out / "router.pid"))
    assert (tmp_path / "termination-log").read_text() == "Shard 0 failed: exit status: 7\n"
    assert "Shard 0 failed: exit status: 7" in (tmp_path / "stderr").read_text()


def test_startup_timeout_fails_the_launcher(
    fake_venv: Path, tmp_path: Path, model_dir: Path
) -> None:
    start = time.monotonic()
    proc = start_launcher(
        fake_venv, tmp_path, model_dir, ["--shard-startup-timeout", "1"],
        {"FAKE_SHARD0": "never-ready"},
    )  # fmt: skip
    assert finish(proc) == 1
    assert time.monotonic() - start < 15
    message = "Shard 0 was not ready after 1 s (--shard-startup-timeout / SHARD_STARTUP_TIMEOUT)"
    assert (tmp_path / "termination-log").read_text() == message + "\n"
    assert not (tmp_path / "out" / "router.json").exists()
    assert not alive(read_pid(tmp_path / "out" / "shard0.pid"))


def test_shard_message_in_termination_log_is_kept(
    fake_venv: Path, tmp_path: Path, model_dir: Path
) -> None:
    """A shard writes its exception to the termination log; the launcher adds its line after."""
    (tmp_path / "termination-log").write_text("RuntimeError: CUDA out of memory\n")
    proc = start_launcher(fake_venv, tmp_path, model_dir, [], {"FAKE_SHARD0": "exit=0.5:1"})
    assert finish(proc) == 1
    assert (tmp_path / "termination-log").read_text() == (
        "RuntimeError: CUDA out of memory\nShard 0 failed: exit status: 1\n"
    )
