"""deployment/deploy_model.sh: shellcheck, and --dry-run (no cluster: kubectl only renders)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.tools import DEPLOY_DIR, require_binary

SCRIPT = DEPLOY_DIR / "deploy_model.sh"


def test_shellcheck_clean() -> None:
    shellcheck = require_binary("shellcheck")
    result = subprocess.run(
        [shellcheck, "--format=gcc", str(SCRIPT)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def deploy(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "KUBECTL": require_binary("kubectl")}
    return subprocess.run(
        [str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=60, check=False
    )


def dry_run(*args: str) -> tuple[list[dict[str, Any]], str]:
    result = deploy("--dry-run", *args)
    assert result.returncode == 0, result.stderr
    assert not list(DEPLOY_DIR.glob(".deploy.*")), "the temporary kustomization was left behind"
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc], result.stderr


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "granite-tiny"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return directory


def test_dry_run_deployment(model_dir: Path) -> None:
    docs, steps = dry_run("-o", "gpu-2", "-n", "llm", "-i", "quay.io/me/tgis:1.2", str(model_dir))
    assert {doc["kind"] for doc in docs} == {"PersistentVolumeClaim", "Deployment", "Service"}
    assert {doc["metadata"]["namespace"] for doc in docs} == {"llm"}
    (deployment,) = [doc for doc in docs if doc["kind"] == "Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["MODEL_NAME"] == "/mnt/models/granite-tiny"
    assert env["NUM_SHARD"] == "2"
    assert container["image"] == "quay.io/me/tgis:1.2"
    assert f"copy {model_dir} to tgis-models:/granite-tiny" in steps


def test_dry_run_kserve_hub_model() -> None:
    docs, steps = dry_run("-o", "kserve", "ibm-granite/granite-3.1-8b-instruct")
    (isvc,) = [doc for doc in docs if doc["kind"] == "InferenceService"]
    name = "ibm-granite--granite-3.1-8b-instruct"
    assert isvc["spec"]["predictor"]["model"]["storageUri"] == f"pvc://tgis-models/{name}"
    assert isvc["metadata"]["namespace"] == "tgis"
    (runtime,) = [doc for doc in docs if doc["kind"] == "ServingRuntime"]
    assert runtime["spec"]["containers"][0]["image"] == "registry.example.com/tgis/tgis:0.1.0"
    assert "download ibm-granite/granite-3.1-8b-instruct" in steps


def test_dry_run_skip_copy_and_name(model_dir: Path) -> None:
    docs, steps = dry_run("--skip-copy", "--name", "m1", str(model_dir))
    (deployment,) = [doc for doc in docs if doc["kind"] == "Deployment"]
    env = deployment["spec"]["template"]["spec"]["containers"][0]["env"]
    assert {"name": "MODEL_NAME", "value": "/mnt/models/m1"} in env
    assert "copy" not in steps


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["./no/such dir"], "neither a directory nor a Hugging Face Hub id"),
        (["-o", "gpu-3", "org/model"], "no kustomization for 'gpu-3'"),
        (["-n", "Bad_NS", "org/model"], "invalid namespace"),
        (["--frobnicate", "org/model"], "unknown option --frobnicate"),
        ([], "expected one MODEL argument"),
    ],
)
def test_bad_arguments(args: list[str], message: str) -> None:
    result = deploy("--dry-run", *args)
    assert result.returncode != 0
    assert message in result.stderr and not result.stdout


def test_directory_without_config(tmp_path: Path) -> None:
    result = deploy("--dry-run", str(tmp_path))
    assert result.returncode != 0 and "has no config.json" in result.stderr


def test_help() -> None:
    result = deploy("--help")
    assert result.returncode == 0 and "--dry-run" in result.stdout
    assert not result.stdout.startswith("#")
