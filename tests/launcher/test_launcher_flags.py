"""Flags and env vars: TGIS defaults, command line beats env beats default, boolean words."""

from __future__ import annotations

import shlex
from dataclasses import asdict
from pathlib import Path

import pytest

from tgis.launcher.cli import parse_args
from tgis.launcher.config import LauncherConfig
from tgis.settings.options import parse_bool

from .helpers import LAUNCHER_ENV_VARS, RunLauncher


@pytest.fixture(autouse=True)
def _no_launcher_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in LAUNCHER_ENV_VARS:
        monkeypatch.delenv(var, raising=False)


def test_defaults_are_tgis_defaults() -> None:
    config, dry_run = parse_args([])
    assert not dry_run
    assert asdict(config) == {
        "model_name": None,  # the embedded demo model, with a warning
        "require_model": False,  # the image sets it: no model named is an error
        "trust_remote_code": False,
        "revision": None,
        "deployment_framework": "hf_transformers",
        "dtype": None,
        "dtype_str": None,
        "quantize": None,
        "num_shard": None,
        "max_concurrent_requests": 512,
        "max_sequence_length": None,
        "max_new_tokens": 1024,
        "max_batch_size": None,  # TGIS: 12; by capacity here (README)
        "max_prefill_padding": 0.2,
        "batch_safety_margin": 20,
        "max_waiting_tokens": None,  # TGIS: 24; join at the next step here (README)
        "waiting_served_ratio": None,
        "max_batch_prefill_tokens": None,
        "max_batch_total_tokens": None,
        "max_client_batch_size": None,
        "max_input_tokens": None,
        "max_stop_sequences": 6,  # TGIS's limit (TGI: 4)
        "max_top_n_tokens": None,  # no limit, as TGIS (TGI: 5)
        "max_best_of": 1,  # one sequence per choice (TGI: 2)
        "hostname": None,  # every interface
        "port": 3000,
        "grpc_port": 8033,
        "shard_uds_path": "/tmp/text-generation-server",
        "master_addr": "localhost",
        "master_port": 29500,
        "nnodes": 1,
        "node_rank": 0,
        "json_output": False,
        "tls_cert_path": None,
        "tls_key_path": None,
        "tls_client_ca_cert_path": None,
        "output_special_tokens": False,
        "disable_prefix_caching": False,
        "served_model_name": None,
        "chat_template": None,
        "tool_call_parser": None,  # vLLM's flag; unset: the chat template's, else hermes
        "api_key": None,
        "cors_allow_origin": (),  # no CORS headers
        "http_tls": False,
        "speculate": 0,
        "speculator_name": None,
        "speculator_max_batch_size": 16,
        "speculate_always": False,  # the policy drafts what should pay
        "prompt_lookup_min": 1,
        "prompt_lookup_max": 3,
        "cuda_process_memory_fraction": 1.0,
        "default_include_stop_seqs": True,
        "otlp_endpoint": None,
        "otlp_service_name": "text-generation-inference.router",
        "shard_startup_timeout": 600.0,
        "load_format": "auto",
        "shutdown_grace_period": 25.0,  # TGIS has no such flag
        "adapter_cache": None,  # vllm-tgis-adapter's flag; unset: adapter_id refused
        "lora_adapters": None,  # TGI's: none loaded at start
        "max_loras": 8,
        "max_lora_rank": 64,
    }


def test_every_flag_from_the_command_line() -> None:
    config, dry_run = parse_args(
        shlex.split(
            "--model-name m --revision r --deployment-framework tgis_native --dtype fp16 "
            "--dtype-str half --quantize gptq --num-shard 2 --max-concurrent-requests 5 "
            "--max-sequence-length 100 --max-new-tokens 50 --max-batch-size 3 "
            "--max-prefill-padding 0.5 --batch-safety-margin 10 --max-waiting-tokens 7 -p 4000 "
            "-g 9033 --shard-uds-path /tmp/x --master-addr h --master-port 1234 --json-output "
            "--tls-cert-path c --tls-key-path k --tls-client-ca-cert-path ca "
            "--output-special-tokens -c 0.5 --default-include-stop-seqs false "
            "--otlp-endpoint e --otlp-service-name s --shard-startup-timeout 30 "
            "--load-format dummy --shutdown-grace-period 12.5 --dry-run"
        )
    )
    assert dry_run
    assert config == LauncherConfig(
        model_name="m", revision="r", deployment_framework="tgis_native", dtype="fp16",
        dtype_str="half", quantize="gptq", num_shard=2, max_concurrent_requests=5,
        max_sequence_length=100, max_new_tokens=50, max_batch_size=3, max_prefill_padding=0.5,
        batch_safety_margin=10, max_waiting_tokens=7, port=4000, grpc_port=9033,
        shard_uds_path="/tmp/x", master_addr="h", master_port=1234, json_output=True,
        tls_cert_path="c", tls_key_path="k", tls_client_ca_cert_path="ca",
        output_special_tokens=True, cuda_process_memory_fraction=0.5,
        default_include_stop_seqs=False, otlp_endpoint="e", otlp_service_name="s",
        shard_startup_timeout=30.0, load_format="dummy", shutdown_grace_period=12.5,
    )  # fmt: skip


ENV = {
    "MODEL_NAME": "env-model",
    "REVISION": "env-rev",
    "DEPLOYMENT_FRAMEWORK": "hf_accelerate",
    "DTYPE": "bfloat16",
    "DTYPE_STR": "bf16",
    "QUANTIZE": "bitsandbytes",
    "NUM_SHARD": "4",
    "MAX_CONCURRENT_REQUESTS": "64",
    "MAX_SEQUENCE_LENGTH": "512",
    "MAX_NEW_TOKENS": "128",
    "MAX_BATCH_SIZE": "8",
    "MAX_PREFILL_PADDING": "0.3",
    "BATCH_SAFETY_MARGIN": "15",
    "MAX_WAITING_TOKENS": "12",
    "PORT": "3001",
    "GRPC_PORT": "8034",
    "SHARD_UDS_PATH": "/tmp/env-sock",
    "MASTER_ADDR": "env-host",
    "MASTER_PORT": "29501",
    "JSON_OUTPUT": "true",
    "TLS_CERT_PATH": "env-cert",
    "TLS_KEY_PATH": "env-key",
    "TLS_CLIENT_CA_CERT_PATH": "env-ca",
    "OUTPUT_SPECIAL_TOKENS": "yes",
    "CUDA_PROCESS_MEMORY_FRACTION": "0.8",
    "DEFAULT_INCLUDE_STOP_SEQS": "0",
    "OTLP_ENDPOINT": "env-otlp",
    "OTLP_SERVICE_NAME": "env-svc",
    "SHARD_STARTUP_TIMEOUT": "45",
    "LOAD_FORMAT": "dummy",
    "SHUTDOWN_GRACE_PERIOD": "40",
}


def test_every_flag_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for var, value in ENV.items():
        monkeypatch.setenv(var, value)
    config, _ = parse_args([])
    assert config == LauncherConfig(
        model_name="env-model", revision="env-rev", deployment_framework="hf_accelerate",
        dtype="bfloat16", dtype_str="bf16", quantize="bitsandbytes", num_shard=4,
        max_concurrent_requests=64, max_sequence_length=512, max_new_tokens=128,
        max_batch_size=8, max_prefill_padding=0.3, batch_safety_margin=15,
        max_waiting_tokens=12, port=3001, grpc_port=8034, shard_uds_path="/tmp/env-sock",
        master_addr="env-host", master_port=29501, json_output=True, tls_cert_path="env-cert",
        tls_key_path="env-key", tls_client_ca_cert_path="env-ca", output_special_tokens=True,
        cuda_process_memory_fraction=0.8, default_include_stop_seqs=False,
        otlp_endpoint="env-otlp", otlp_service_name="env-svc", shard_startup_timeout=45.0,
        load_format="dummy", shutdown_grace_period=40.0,
    )  # fmt: skip


def test_command_line_beats_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PORT", "3001")
    monkeypatch.setenv("MAX_BATCH_SIZE", "8")
    monkeypatch.setenv("DEFAULT_INCLUDE_STOP_SEQS", "false")
    monkeypatch.setenv("MODEL_NAME", "env-model")
    config, _ = parse_args(
        ["-p", "4000", "--max-batch-size", "2", "--default-include-stop-seqs", "true"]
    )
    assert config.port == 4000
    assert config.max_batch_size == 2
    assert config.default_include_stop_seqs is True
    assert config.model_name == "env-model"  # not on the command line: env beats default
    assert config.grpc_port == 8033  # neither: default


@pytest.mark.parametrize(
    ("word", "value"),
    [("true", True), ("TRUE", True), ("1", True), ("Yes", True), ("false", False),
     ("False", False), ("0", False), ("NO", False)],
)  # fmt: skip
def test_boolean_env_words(monkeypatch: pytest.MonkeyPatch, word: str, value: bool) -> None:
    assert parse_bool(word) is value
    monkeypatch.setenv("JSON_OUTPUT", word)
    monkeypatch.setenv("DEFAULT_INCLUDE_STOP_SEQS", word)
    config, _ = parse_args([])
    assert config.json_output is value
    assert config.default_include_stop_seqs is value


def test_flag_on_command_line_beats_false_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OUTPUT_SPECIAL_TOKENS", "false")
    config, _ = parse_args(["--output-special-tokens"])
    assert config.output_special_tokens is True


def test_blank_env_is_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TLS_CERT_PATH", "")
    monkeypatch.setenv("JSON_OUTPUT", "")
    config, _ = parse_args([])
    assert config.tls_cert_path is None
    assert config.json_output is False


def test_help_exits_zero(run_launcher: RunLauncher) -> None:
    run = run_launcher(["--help"])
    assert run.returncode == 0
    assert "--shard-startup-timeout" in run.stdout
    assert "SHARD_STARTUP_TIMEOUT" in run.stdout


def test_command_line_beats_env_end_to_end(run_launcher: RunLauncher, model_dir: Path) -> None:
    run = run_launcher(
        ["--model-name", str(model_dir), "--max-new-tokens", "7", "--dry-run"],
        {"MAX_NEW_TOKENS": "99", "MAX_BATCH_SIZE": "5"},
    )
    assert run.returncode == 0, run.stderr
    router = next(line for line in run.stdout.splitlines() if line.startswith("Router: "))
    assert "--max-new-tokens 7 " in router
    assert "--max-batch-size 5 " in router


def test_ignored_weight_env_vars_are_logged(run_launcher: RunLauncher, model_dir: Path) -> None:
    run = run_launcher(
        ["--model-name", str(model_dir), "--dry-run"],
        {"MAX_BATCH_WEIGHT": "1000", "MAX_PREFILL_WEIGHT": " "},
    )
    assert run.returncode == 0, run.stderr
    assert "MAX_BATCH_WEIGHT is set to 1000 but this parameter will be ignored." in run.stderr
    assert "MAX_PREFILL_WEIGHT" not in run.stderr  # blank


def test_speculation_flags_reach_the_router_and_a_draft_model_the_shard(
    run_launcher: RunLauncher, model_dir: Path
) -> None:
    run = run_launcher(
        ["--model-name", str(model_dir), "--dry-run", "--prompt-lookup-max", "4"],
        {"SPECULATE": "5", "SPECULATE_ALWAYS": "true"},
    )
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    router = next(line for line in lines if line.startswith("Router: "))
    for words in ("--speculate 5 ", "--speculator-max-batch-size 16 ", "--prompt-lookup-min 1 ",
                  "--prompt-lookup-max 4", "--speculate-always"):  # fmt: skip
        assert words in router
    # The shard captures CUDA graphs for the verify steps of that depth and batch size.
    shard = next(line for line in lines if line.startswith("Shard 0: "))
    assert "--speculate 5 " in shard and "--speculator-max-batch-size 16" in shard
    assert "--speculate-always" not in shard  # the router alone decides what to draft
    # TGIS's variable names the draft model; the depth then defaults to 4.
    run = run_launcher(
        ["--model-name", str(model_dir), "--dry-run"], {"SPECULATOR_NAME": "/models/draft"}
    )
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    shard = next(line for line in lines if line.startswith("Shard 0: "))
    router = next(line for line in lines if line.startswith("Router: "))
    assert "--speculator-name /models/draft " in shard and "--speculate 4 " in shard
    assert "--speculate 4 " in router
    plain = run_launcher(["--model-name", str(model_dir), "--dry-run"])
    assert "--speculate" not in plain.stdout
    # An MLP speculator (its config.json's architecture): as many as its heads.
    mlp = model_dir.parent / "mlp-speculator"
    mlp.mkdir(exist_ok=True)
    (mlp / "config.json").write_text(
        '{"architectures": ["MLPSpeculatorPreTrainedModel"], "n_predict": 3}'
    )
    run = run_launcher(["--model-name", str(model_dir), "--dry-run"], {"SPECULATOR_NAME": str(mlp)})
    assert run.returncode == 0, run.stderr
    assert "--speculate 3 " in run.stdout and "--speculate 4" not in run.stdout
    bad = run_launcher(["--model-name", str(model_dir), "--dry-run", "--prompt-lookup-min", "5"])
    assert bad.returncode != 0
    assert "prompt_lookup_min (5) and prompt_lookup_max (3) must satisfy" in bad.stderr


def test_legacy_deployment_framework_warns(run_launcher: RunLauncher, model_dir: Path) -> None:
    run = run_launcher(
        ["--model-name", str(model_dir), "--deployment-framework", "hf_custom_tp", "--dry-run"]
    )
    assert run.returncode == 0, run.stderr
    assert "hf_custom_tp is deprecated" in run.stderr
    assert f" serve {model_dir} tgis_native " in run.stdout


def shard_lines(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if line.startswith("Shard ")]


@pytest.mark.parametrize(
    ("args", "env"),
    [
        (["--load-format", "dummy"], {}),
        ([], {"LOAD_FORMAT": "dummy"}),
        ([], {"LOAD_FORMAT": " Dummy"}),
    ],
)
def test_load_format_reaches_every_shard(
    run_launcher: RunLauncher, model_dir: Path, args: list[str], env: dict[str, str]
) -> None:
    run = run_launcher(
        ["--model-name", str(model_dir), "--num-shard", "2", *args, "--dry-run"], env
    )
    assert run.returncode == 0, run.stderr
    shards = shard_lines(run.stdout)
    assert len(shards) == 2
    assert all(" --sharded " in line and " --load-format dummy " in line for line in shards)
    router = next(line for line in run.stdout.splitlines() if line.startswith("Router: "))
    assert "load-format" not in router  # the router needs only the tokenizer


def test_load_format_auto_is_the_default_and_not_passed(
    run_launcher: RunLauncher, model_dir: Path
) -> None:
    run = run_launcher(["--model-name", str(model_dir), "--dry-run"], {"LOAD_FORMAT": "auto"})
    assert run.returncode == 0, run.stderr
    assert "--load-format" not in shard_lines(run.stdout)[0]


def test_openai_flags_reach_the_router_and_the_key_stays_out_of_argv(
    run_launcher: RunLauncher, model_dir: Path
) -> None:
    run = run_launcher(
        [
            "--model-name", str(model_dir), "--dry-run", "--served-model-name", "granite",
            "--chat-template", "/templates/chat.jinja", "--api-key", "s3cret",
        ]
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    router = next(line for line in run.stdout.splitlines() if line.startswith("Router: "))
    assert "--served-model-name granite " in router
    assert f"--model-dir {model_dir} " in router
    assert "--chat-template /templates/chat.jinja" in router
    assert "--api-key" not in router and "API_KEY=s3cret" in router  # its environment
    assert "s3cret" not in run.stderr  # the Args: log line leaves it out
    bad = run_launcher(["--model-name", str(model_dir), "--dry-run", "--http-tls"])
    assert bad.returncode != 0 and "http_tls" in bad.stderr
