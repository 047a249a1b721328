"""Dockerfile.ubi without a container engine: hadolint, what it copies, what it declares, and
the entrypoint run the way the image runs it (its ENV, an arbitrary uid in group 0 when the
tests run as root, only /tmp writable)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from collections.abc import Iterator
from importlib.metadata import PackageNotFoundError, version
from importlib.util import find_spec
from pathlib import Path

import pytest
import yaml

from tests.deploy.tools import (
    DOCKERFILE,
    ROOT,
    Instruction,
    dockerignored,
    key_values,
    parse_dockerfile,
    require_binary,
)
from tests.launcher.helpers import clean_env
from tgis.embedded_model import MODEL_DIR
from tgis.launcher.local_process import BIN_DIR, LauncherProcess
from tgis.procinfo import free_ports

INSTRUCTIONS = parse_dockerfile(DOCKERFILE.read_text())
RUNTIME = INSTRUCTIONS[-1].stage
# OpenShift's restricted-v2 SCC runs pods as a uid from the namespace's range, in group 0.
ARBITRARY_UID = 1000680000


def of(keyword: str, stage: str | None = None) -> list[Instruction]:
    return [i for i in INSTRUCTIONS if i.keyword == keyword and (stage is None or i.stage == stage)]


def runtime_env() -> dict[str, str]:
    env: dict[str, str] = {}
    for instruction in of("ENV", RUNTIME):
        env.update(key_values(instruction.args))
    return env


def test_hadolint_clean() -> None:
    hadolint = require_binary("hadolint")
    result = subprocess.run(
        [hadolint, "--config", ".hadolint.yaml", "--format", "json", "Dockerfile.ubi"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0 and json.loads(result.stdout) == [], result.stdout + result.stderr


def test_hadolint_ignores_are_justified() -> None:
    """Every rule .hadolint.yaml ignores has its own comment right above it."""
    text = (ROOT / ".hadolint.yaml").read_text()
    config = yaml.safe_load(text)
    assert config["failure-threshold"] == "info"
    lines = text.splitlines()
    for rule in config.get("ignored", []):
        (index,) = [n for n, line in enumerate(lines) if line.strip() == f"- {rule}"]
        assert lines[index - 1].strip().startswith("#"), f"{rule} is ignored without a reason"


def test_stages_multi_stage_on_ubi9() -> None:
    froms = of("FROM")
    assert [i.stage for i in froms] == ["build", "runtime"]
    assert froms[0].args.startswith("registry.access.redhat.com/ubi9/ubi:")
    assert froms[1].args.startswith("registry.access.redhat.com/ubi9/ubi-minimal:")
    # the runtime stage takes only the venv from the build stage, and nothing from the context
    (copy,) = of("COPY", RUNTIME)
    assert copy.args == "--from=build /opt/tgis /opt/tgis"
    runs = " ".join(i.args for i in of("RUN", RUNTIME))
    assert "pip install" not in runs


def test_copy_sources_exist_and_are_in_the_build_context() -> None:
    ignore = (ROOT / ".dockerignore").read_text()
    copies = [i for i in of("COPY") if not i.args.startswith("--from")]
    assert copies
    for copy in copies:
        *sources, _dest = copy.args.split()
        for source in sources:
            assert (ROOT / source).exists(), f"line {copy.line}: COPY {source}: not in the repo"
            files = [ROOT / source] if (ROOT / source).is_file() else (ROOT / source).rglob("*")
            kept = [p for p in files if not dockerignored(str(p.relative_to(ROOT)), ignore)]
            assert kept, f"line {copy.line}: COPY {source}: excluded by .dockerignore"
    # the build generates the stubs and compiles the kernel: a checkout's copies stay out
    for generated in ("tgis/pb/generation_pb2.py", "tgis/pb/shard_pb2_grpc.py"):
        assert dockerignored(generated, ignore), generated
    assert dockerignored(
        "tgis/shard/native/attention/_cpu_attention.cpython-312-x86_64-linux-gnu.so", ignore
    )
    assert dockerignored(".venv/bin/python", ignore)
    assert not dockerignored("tgis/launcher/cli.py", ignore)
    assert not dockerignored("protos/generation.proto", ignore)


def build_context(ignore: str, dest: Path) -> Path:
    """The files the build stage's COPY instructions put in its WORKDIR, as podman would."""
    (workdir,) = [i.args for i in of("WORKDIR", "build")]
    for copy in of("COPY", "build"):
        *sources, target = copy.args.split()
        for source in sources:
            root = ROOT / source
            files = [root] if root.is_file() else [p for p in root.rglob("*") if p.is_file()]
            for path in files:
                relative = str(path.relative_to(ROOT))
                if dockerignored(relative, ignore):
                    continue
                inside = path.name if root.is_file() else str(path.relative_to(root))
                out = dest / Path(workdir, target).relative_to(workdir) / inside
                out.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(path, out)
    return dest


def test_build_context_builds_the_wheel(tmp_path: Path) -> None:
    """`pip install .` in the build stage: from exactly the copied files, the wheel gets the
    generated gRPC stubs, the compiled C kernel, the embedded model and the console script."""
    context = build_context((ROOT / ".dockerignore").read_text(), tmp_path / "src")
    assert not list(context.glob("tgis/pb/*_pb2*")), "generated stubs in the build context"
    try:  # the venv's own build backend when it is recent enough (fast, offline)
        isolation = int(version("setuptools").split(".")[0]) < 77 or not find_spec("grpc_tools")
    except PackageNotFoundError:
        isolation = True
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path / "dist")]
        + ([] if isolation else ["--no-build-isolation"])
        + [str(context)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    (wheel,) = (tmp_path / "dist").glob("tgis-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for expected in (
        "tgis/pb/generation_pb2.py",
        "tgis/pb/generation_pb2_grpc.py",
        "tgis/pb/shard_pb2_grpc.py",
        "tgis/embedded_model/data/model.safetensors",
    ):
        assert expected in names, expected
    assert [
        n
        for n in names
        if n.startswith("tgis/shard/native/attention/_cpu_attention.") and n.endswith(".so")
    ]
    (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    scripts = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "text-generation-launcher = tgis.launcher.cli:main" in scripts


def test_generated_stubs_are_not_committed() -> None:
    tracked = subprocess.run(
        ["git", "ls-files", "tgis/pb"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    assert tracked and not [path for path in tracked if "_pb2" in path], tracked


def test_torch_build_args() -> None:
    args = dict(i.args.split("=", 1) for i in of("ARG") if "=" in i.args)  # the defaults
    assert args["TORCH_VARIANT"].startswith("cu")  # CUDA torch unless told otherwise
    assert args["TORCH_INDEX_URL"].endswith("/${TORCH_VARIANT}")
    builds = " ".join(i.args for i in of("RUN", "build"))
    assert '--index-url "$TORCH_INDEX_URL"' in builds and '"torch==${TORCH_VERSION}"' in builds
    # CPU images skip the compiler Triton needs at run time
    assert '"$TORCH_VARIANT" != cpu' in " ".join(i.args for i in of("RUN", RUNTIME))


def test_entrypoint_is_the_launcher_console_script() -> None:
    (entrypoint,) = of("ENTRYPOINT")
    assert json.loads(entrypoint.args) == ["text-generation-launcher"]
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["text-generation-launcher"] == "tgis.launcher.cli:main"
    assert not of("CMD")  # arguments come from Kubernetes (or `podman run IMAGE --flag`)


def test_runtime_contract() -> None:
    (expose,) = of("EXPOSE")
    assert expose.args.split() == ["8033", "3000"]
    (user,) = of("USER", RUNTIME)
    assert user.args.isdigit() and int(user.args) != 0  # numeric: runAsNonRoot can check it
    env = runtime_env()
    assert env["HF_HUB_OFFLINE"] == "1"
    assert env["MODEL_NAME"] == "/mnt/models/"
    assert env["TGIS_REQUIRE_MODEL"] == "true"  # never the embedded demo model
    assert (env["PORT"], env["GRPC_PORT"]) == ("3000", "8033")
    assert "TRANSFORMERS_CACHE" not in env
    writable = ("/tmp", env["HOME"])
    for var in (
        "HF_HOME",
        "TRITON_CACHE_DIR",
        "TORCHINDUCTOR_CACHE_DIR",
        "TMPDIR",
        "XDG_CACHE_HOME",
    ):
        assert env[var].startswith(writable), f"{var}={env[var]} is not under /tmp or HOME"
    # HOME is group 0 and group-writable for an arbitrary uid
    home_setup = " ".join(i.args for i in of("RUN", RUNTIME) if "useradd" in i.args)
    assert "--gid 0" in home_setup and "chgrp -R 0 /home/tgis" in home_setup
    assert "chmod -R g=u /home/tgis" in home_setup
    labels = {k for i in of("LABEL", RUNTIME) for k in key_values(i.args)}
    assert {"name", "summary", "description", "io.openshift.expose-services"} <= labels


def _world_readable(path: Path) -> bool:
    """Every directory up to `path` is searchable by others (another uid can import from it)."""
    return all(part.stat().st_mode & stat.S_IXOTH for part in [path, *path.parents])


@pytest.fixture
def image_dirs() -> Iterator[dict[str, Path]]:
    """Stand-ins for the image's writable /tmp and its HOME (read-only, as if not mounted)."""
    base = Path(tempfile.mkdtemp(prefix="tgis-img-", dir="/tmp"))
    base.chmod(0o755)
    dirs = {"base": base, "tmp": base / "tmp", "home": base / "home"}
    dirs["tmp"].mkdir(mode=0o1777)
    dirs["tmp"].chmod(0o1777)
    dirs["home"].mkdir()
    dirs["home"].chmod(0o555)
    yield dirs
    subprocess.run(["rm", "-rf", str(base)], check=False)


def image_environment(dirs: dict[str, Path], model_name: str) -> dict[str, str]:
    """The runtime stage's ENV with /tmp and HOME moved to `dirs`, and MODEL_NAME set."""
    env = clean_env({"PYTHONUNBUFFERED": "1"})
    for var, value in runtime_env().items():
        value = value.replace("/home/tgis", str(dirs["home"]))
        env[var] = str(dirs["tmp"]) + value[4:] if value.startswith("/tmp") else value
    env["PATH"] = f"{BIN_DIR}:{os.environ['PATH']}"
    env.pop("VIRTUAL_ENV")
    env["MODEL_NAME"] = model_name
    return env


def run_as() -> dict[str, object]:
    """Popen arguments: an arbitrary uid in group 0 when root can switch to it and that uid
    can reach the interpreter, the venv and the model (else the current user)."""
    needed = (Path(os.path.realpath(sys.executable)), Path(sys.base_prefix), BIN_DIR, MODEL_DIR)
    if os.geteuid() == 0 and all(_world_readable(path) for path in needed):
        return {"user": ARBITRARY_UID, "group": 0, "extra_groups": []}
    return {}


@pytest.mark.slow
def test_entrypoint_serves_and_stops_on_sigterm(image_dirs: dict[str, Path], tmp_path: Path):
    """As in a pod: the image's env, MODEL_NAME at a model directory, ports from flags."""
    env = image_environment(image_dirs, str(MODEL_DIR) + "/")
    grpc_port, http_port, master_port = free_ports(3)
    args = [
        str(BIN_DIR / "text-generation-launcher"),
        f"--port={http_port}",
        f"--grpc-port={grpc_port}",
        f"--shard-uds-path={image_dirs['tmp']}/text-generation-server",
        f"--master-port={master_port}",
    ]
    log_path = tmp_path / "launcher.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            args,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=image_dirs["home"],
            start_new_session=True,
            **run_as(),  # type: ignore[call-overload]
        )
    server = LauncherProcess(proc, grpc_port, http_port, log_path, image_dirs["tmp"], args)
    try:
        server.wait_healthy(timeout=60)
        status, body = server.http_get("/metrics")
        assert status == 200 and b"tgi_request_count" in body
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, server.log_tail()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert list(image_dirs["home"].iterdir()) == []  # nothing written outside /tmp


def test_missing_model_is_one_line_in_the_termination_log(image_dirs: dict[str, Path]) -> None:
    """No model mounted at MODEL_NAME: one line in the termination log, a non-zero exit."""
    termination_log = image_dirs["base"] / "termination-log"
    termination_log.touch()
    termination_log.chmod(0o666)  # Kubernetes' /dev/termination-log is writable by the pod
    unmounted = image_dirs["base"] / "mnt-models"
    unmounted.mkdir()
    env = image_environment(image_dirs, f"{unmounted}/")
    env["TGIS_TERMINATION_LOG"] = str(termination_log)
    result = subprocess.run(
        [str(BIN_DIR / "text-generation-launcher")],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
        cwd=image_dirs["home"],
        **run_as(),  # type: ignore[call-overload]
    )
    assert result.returncode != 0
    message = termination_log.read_text()
    assert message.count("\n") == 1 and str(unmounted) in message, message
    assert "not found" in message
    assert result.stderr.splitlines()[-1] == "error: " + message.strip(), result.stderr


@pytest.mark.parametrize("model_args", [[], ["--model-name", ""]])
def test_no_model_named_is_refused_not_the_demo_model(
    image_dirs: dict[str, Path], model_args: list[str]
) -> None:
    """MODEL_NAME emptied (or --model-name ""): the image's TGIS_REQUIRE_MODEL stops the
    start with one line in the termination log, where the launcher alone would serve the
    embedded demo model."""
    termination_log = image_dirs["base"] / "termination-log"
    termination_log.touch()
    termination_log.chmod(0o666)
    env = image_environment(image_dirs, "")
    env["TGIS_TERMINATION_LOG"] = str(termination_log)
    result = subprocess.run(
        [str(BIN_DIR / "text-generation-launcher"), *model_args, "--dry-run"],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
        cwd=image_dirs["home"],
        **run_as(),  # type: ignore[call-overload]
    )
    assert result.returncode != 0, result.stdout
    message = termination_log.read_text()
    assert message.count("\n") == 1, message
    assert message.startswith("no model named, and TGIS_REQUIRE_MODEL"), message
    assert "--model-name / MODEL_NAME (or TGI's --model-id / MODEL_ID)" in message
    assert "Router:" not in result.stdout
