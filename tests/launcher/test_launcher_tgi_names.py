"""What users of HF TGI and vLLM bring to the launcher (issue 34): TGI's names of our
settings, its request limits, --hostname, --trust-remote-code and --lora-adapters; the
embedded demo model served only with a warning (or refused); and the variables this server
does not read named in warnings."""

from __future__ import annotations

import json
import logging
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tgis.launcher import tokenizer as launcher_tokenizer
from tgis.launcher.cli import parse_args
from tgis.launcher.config import ConfigError, LauncherConfig
from tgis.launcher.environment import alias_conflicts, unread_env
from tgis.launcher.resolution import resolve

from .helpers import LAUNCHER_ENV_VARS, RunLauncher

LOG = logging.getLogger("test")


@pytest.fixture(autouse=True)
def _no_launcher_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in LAUNCHER_ENV_VARS:
        monkeypatch.delenv(var, raising=False)


def line(stdout: str, prefix: str) -> str:
    return next(text for text in stdout.splitlines() if text.startswith(prefix))


# ---- TGI's names ------------------------------------------------------------------------------


def test_tgis_model_id_and_max_input_length_are_aliases(monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse_args(["--model-id", "/m"])[0].model_name == "/m"
    assert parse_args(["--max-input-length", "99"])[0].max_input_tokens == 99
    monkeypatch.setenv("MODEL_ID", "/env-model")
    monkeypatch.setenv("MAX_INPUT_LENGTH", "77")
    config, _ = parse_args([])
    assert (config.model_name, config.max_input_tokens) == ("/env-model", 77)
    monkeypatch.setenv("MODEL_NAME", "/tgis-model")  # TGIS's name is read first
    assert parse_args([])[0].model_name == "/tgis-model"
    assert parse_args(["--model-id", "/cli"])[0].model_name == "/cli"  # the command line wins


def test_help_says_whose_each_alias_is(run_launcher: RunLauncher) -> None:
    run = run_launcher(["--help"])
    assert run.returncode == 0
    text = " ".join(run.stdout.split())
    for phrase in (
        "--model-id is TGI's name",
        "MODEL_ID is TGI's name",
        "MAX_INPUT_LENGTH is TGI's name",
        "--hostname is TGI's name",
        "LORA_ADAPTERS is TGI's name",
    ):
        assert phrase in text, phrase
    for flag in ("--trust-remote-code", "--max-stop-sequences", "--max-top-n-tokens",
                 "--max-best-of", "--require-model", "-V, --version"):  # fmt: skip
        assert flag in run.stdout, flag


def test_tgi_flags_reach_the_children(run_launcher: RunLauncher, model_dir: Path) -> None:
    run = run_launcher(
        [
            "--model-id", str(model_dir), "--dry-run", "--hostname", "127.0.0.1",
            "--max-stop-sequences", "2", "--max-top-n-tokens", "3",
            "--max-input-length", "100", "--trust-remote-code",
        ]
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    router = line(run.stdout, "Router: ")
    for words in ("--hostname 127.0.0.1 ", "--max-stop-sequences 2 ", "--max-top-n-tokens 3 ",
                  "--max-input-tokens 100 "):  # fmt: skip
        assert words in router, words
    shard = line(run.stdout, "Shard 0: ")
    assert f" serve {model_dir} " in shard and " --trust-remote-code" in shard
    assert "--hostname" not in shard and "--trust-remote-code" not in router
    assert "No model named" not in run.stderr  # a model was named


def test_trust_remote_code_from_its_variable_reaches_the_shards(
    run_launcher: RunLauncher, model_dir: Path
) -> None:
    run = run_launcher(["--model-name", str(model_dir), "--dry-run"], {"TRUST_REMOTE_CODE": "1"})
    assert run.returncode == 0, run.stderr
    assert " --trust-remote-code" in line(run.stdout, "Shard 0: ")
    plain = run_launcher(["--model-name", str(model_dir), "--dry-run"])
    assert "--trust-remote-code" not in plain.stdout


def test_trust_remote_code_reaches_the_tokenizer_conversion(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    seen: list[list[str]] = []

    def run(argv: list[str], **_: Any) -> subprocess.CompletedProcess[str]:
        seen.append(argv)
        return subprocess.CompletedProcess(argv, 1, "", "no luck\n")

    monkeypatch.setattr(launcher_tokenizer.subprocess, "run", run)
    for trust in (False, True):
        reason = launcher_tokenizer.convert_tokenizer(tmp_path, tmp_path / "out", 5.0, trust)
        assert reason == "no luck"
    assert [argv[-1] for argv in seen] == ["no", "trust"]
    assert "trust_remote_code=sys.argv[3] == 'trust'" in seen[0][2]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"max_stop_sequences": -1}, "max_stop_sequences (-1) must not be negative"),
        ({"max_top_n_tokens": -2}, "max_top_n_tokens (-2) must not be negative"),
        ({"max_best_of": 0}, "max_best_of (0) must be at least 1"),
    ],
)
def test_request_limits_are_checked(model_dir: Path, flags: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        resolve(LauncherConfig(model_name=str(model_dir), **flags), {}, LOG)


def test_best_of_above_one_is_accepted_with_a_warning(
    model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        resolve(LauncherConfig(model_name=str(model_dir), max_best_of=2), {}, LOG)
    assert "max_best_of is 2, but each choice is one generated sequence here" in caplog.text


# ---- --lora-adapters --------------------------------------------------------------------------


def adapter(root: Path, adapter_id: str) -> None:
    (root / adapter_id).mkdir(parents=True)
    (root / adapter_id / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA"}))


def test_lora_adapters_reach_the_shards(
    run_launcher: RunLauncher, model_dir: Path, tmp_path: Path
) -> None:
    cache = tmp_path / "adapters"
    adapter(cache, "org/lora-a")
    adapter(cache, "lora-b")
    run = run_launcher(
        ["--model-name", str(model_dir), "--dry-run", "--adapter-cache", str(cache)],
        {"LORA_ADAPTERS": " org/lora-a, lora-b,"},
    )
    assert run.returncode == 0, run.stderr
    shard = line(run.stdout, "Shard 0: ")
    assert "--lora-adapters ' org/lora-a, lora-b,'" in shard
    assert "--lora-adapters" not in line(run.stdout, "Router: ")


@pytest.mark.parametrize(
    ("value", "with_cache", "message"),
    [
        ("lora-a", False, "lora_adapters needs adapter_cache: the adapters are read from "
         "--adapter-cache (ADAPTER_CACHE), each id a directory there"),
        ("lora-a,missing", True, "lora_adapters: no adapter 'missing' in adapter_cache"),
        ("../outside", True, "lora_adapters: Invalid adapter id '../outside', must contain "
         "only alphanumeric, _ and - and /"),
        ("repo/name=/path", True, "lora_adapters: Invalid adapter id 'repo/name=/path'"),
    ],
)  # fmt: skip
def test_lora_adapters_that_cannot_be_found_stop_the_start(
    run_launcher: RunLauncher,
    model_dir: Path,
    tmp_path: Path,
    value: str,
    with_cache: bool,
    message: str,
) -> None:
    cache = tmp_path / "adapters"
    adapter(cache, "lora-a")
    args = ["--model-name", str(model_dir), "--dry-run", "--lora-adapters", value]
    run = run_launcher(args + (["--adapter-cache", str(cache)] if with_cache else []))
    assert run.returncode != 0
    assert run.error_line.startswith(message), run.error_line
    assert run.termination_log is not None and message in run.termination_log


def test_blank_lora_adapters_need_no_cache(model_dir: Path) -> None:
    resolve(LauncherConfig(model_name=str(model_dir), lora_adapters=" , "), {}, LOG)


# ---- the embedded demo model ------------------------------------------------------------------


def test_no_model_named_serves_the_demo_model_with_a_warning(run_launcher: RunLauncher) -> None:
    run = run_launcher(["--dry-run"])
    assert run.returncode == 0, run.stderr
    warning = line(
        run.stderr.split(" WARNING launcher text_generation_launcher: ", 1)[1], "No model named"
    )
    assert warning.startswith(
        "No model named: serving the embedded demo model, a 4M-parameter toy that writes "
        "English-like noise. To serve a model, name it with --model-name / MODEL_NAME (or "
        "TGI's --model-id / MODEL_ID)"
    )
    assert "tgis/embedded_model/data" in line(run.stdout, "Shard 0: ")


@pytest.mark.parametrize(
    ("args", "env"),
    [
        (["--require-model"], {}),
        ([], {"TGIS_REQUIRE_MODEL": "true"}),
        (["--model-name", ""], {"TGIS_REQUIRE_MODEL": "1"}),
        ([], {"TGIS_REQUIRE_MODEL": "yes", "MODEL_NAME": ""}),  # empty: unset
    ],
)
def test_require_model_refuses_the_demo_model(
    run_launcher: RunLauncher, args: list[str], env: dict[str, str]
) -> None:
    run = run_launcher([*args, "--dry-run"], env)
    assert run.returncode != 0
    assert run.error_line.startswith(
        "no model named, and TGIS_REQUIRE_MODEL (--require-model) refuses to serve the "
        "embedded demo model: name the model with --model-name / MODEL_NAME"
    )
    assert run.termination_log is not None and run.termination_log.count("\n") == 1
    assert "Router:" not in run.stdout


def test_require_model_with_a_model_named_serves_it(
    run_launcher: RunLauncher, model_dir: Path
) -> None:
    run = run_launcher(["--model-id", str(model_dir), "--dry-run"], {"TGIS_REQUIRE_MODEL": "1"})
    assert run.returncode == 0, run.stderr
    assert "No model named" not in run.stderr


# ---- variables this server does not read ------------------------------------------------------


def test_unread_variables_are_named_with_what_to_use() -> None:
    environ = {
        "MODEL": "/models/a",
        "MODEL_PATH": "/models/b",
        "MAX_MODEL_LEN": "4096",
        "VLLM_API_KEY": "k",
        "MODEL_NAMES": "/models/c",  # a near-miss of MODEL_NAME
        "MAX_NEW_TOKEN": "5",  # of MAX_NEW_TOKENS
        "model_name": "/models/d",  # lower case
        "MODEL_DIR": "/models/e",  # the router's, which the launcher sets itself
        "TENSOR_PARALLEL_SIZE": "",  # blank: not set
        # what a container or a pod has, and what the server reads: nothing to say
        "HOSTNAME": "pod-1", "PATH": "/bin", "HF_HOME": "/tmp/hf", "NUM_GPUS": "1",
        "KUBERNETES_SERVICE_PORT": "443", "TGIS_SERVICE_PORT": "8033", "CUDA_VERSION": "13.0",
        "MODEL_NAME": "/models/f", "MODEL_ID": "/models/f", "PORTS": "1",
    }  # fmt: skip
    assert unread_env(environ) == {
        "MODEL": "MODEL_NAME (or --model-name)",
        "MODEL_PATH": "MODEL_NAME (or --model-name)",
        "MAX_MODEL_LEN": "MAX_SEQUENCE_LENGTH",
        "VLLM_API_KEY": "API_KEY",
        "MODEL_NAMES": "MODEL_NAME (a misspelling?)",
        "MAX_NEW_TOKEN": "MAX_NEW_TOKENS (a misspelling?)",
        "model_name": "MODEL_NAME (variable names are upper case)",
        "MODEL_DIR": "MODEL_NAME (or --model-name); the launcher gives the router MODEL_DIR itself",
    }


def test_alias_conflicts_name_the_variable_that_is_read() -> None:
    assert alias_conflicts({"MODEL_NAME": "/a", "MODEL_ID": "/a "}) == []  # the same value
    assert alias_conflicts(
        {"MODEL_ID": "/b", "MODEL_NAME": "/mnt/models/", "MAX_INPUT_LENGTH": "9"}
    ) == [("MODEL_NAME", "MODEL_ID")]


def test_the_launcher_warns_of_unread_and_conflicting_variables(
    run_launcher: RunLauncher, model_dir: Path
) -> None:
    """vLLM's MODEL is silently ignored no more: the demo model's warning, and this one."""
    run = run_launcher(
        ["--dry-run"], {"MODEL": str(model_dir), "MODEL_NAMES": "x", "MODEL_NAME": ""}
    )
    assert run.returncode == 0, run.stderr
    assert (
        "MODEL is set, but this server does not read it: use MODEL_NAME (or --model-name)"
        in run.stderr
    )
    assert "MODEL_NAMES is set, but this server does not read it: use MODEL_NAME" in run.stderr
    assert "No model named: serving the embedded demo model" in run.stderr
    run = run_launcher(["--dry-run"], {"MODEL_NAME": "/mnt/models/", "MODEL_ID": str(model_dir)})
    assert run.returncode != 0  # MODEL_NAME is read, and nothing is there
    assert (
        f"MODEL_NAME=/mnt/models/ and MODEL_ID={model_dir} name one setting, with different "
        "values: MODEL_NAME is read (a flag on the command line beats both)" in run.stderr
    )
    assert "model '/mnt/models/' not found" in run.error_line
