"""The exact shard and router command lines and shard environments."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import pytest

from tgis.launcher.commands import router_argv, shard_argv, shard_env
from tgis.launcher.config import LauncherConfig, ResolvedConfig
from tgis.launcher.resolution import resolve

from .helpers import RunLauncher

LOG = logging.getLogger("test-launcher")


def resolved(model_dir: Path, **flags: object) -> ResolvedConfig:
    return resolve(LauncherConfig(model_name=str(model_dir), **flags), {}, LOG)  # type: ignore[arg-type]


def test_default_command_lines(model_dir: Path) -> None:
    cfg = resolved(model_dir)
    assert shard_argv("tgs", cfg) == [
        "tgs", "serve", str(model_dir), "hf_transformers",
        "--shard-uds-path", "/tmp/text-generation-server",
        "--max-sequence-length", "256", "--max-new-tokens", "1024",
        "--batch-safety-margin", "20", "--cuda-process-memory-fraction", "1.0",
    ]  # fmt: skip
    assert router_argv("tgr", cfg, model_dir / "tokenizer.json") == [
        "tgr", "--served-model-name", str(model_dir), "--model-dir", str(model_dir),
        "--tokenizer-path", str(model_dir / "tokenizer.json"),
        "--master-shard-uds-path", "/tmp/text-generation-server-0",
        "--shutdown-grace-period", "25.0", "--port", "3000", "--grpc-port", "8033",
        "--max-concurrent-requests", "512", "--max-sequence-length", "256",
        "--max-new-tokens", "1024", "--max-stop-sequences", "6", "--max-best-of", "1",
        "--max-prefill-padding", "0.2", "--default-include-stop-seqs", "true",
    ]  # fmt: skip


def option(argv: list[str], flag: str) -> str:
    """The value after ``flag`` in ``argv``."""
    return argv[argv.index(flag) + 1]


def test_batch_size_and_joining_rule_are_passed_only_when_set(model_dir: Path) -> None:
    cfg = resolved(model_dir, max_batch_size=12, max_waiting_tokens=24)
    shard = shard_argv("tgs", cfg)
    assert shard[shard.index("--max-batch-size") + 1] == "12"
    router = router_argv("tgr", cfg, model_dir / "tokenizer.json")
    assert router[router.index("--max-batch-size") + 1] == "12"
    assert router[router.index("--max-waiting-tokens") + 1] == "24"
    assert "--waiting-served-ratio" not in router


def test_all_optional_arguments(model_dir: Path, tmp_path: Path) -> None:
    from tests.e2e.certs import make_pki

    pki = make_pki(tmp_path / "pki")
    cert, key, ca = str(pki.server_cert), str(pki.server_key), str(pki.ca_cert)
    cfg = resolved(
        model_dir, revision="v2", dtype_str="bf16", quantize="gptq", num_shard=2,
        shard_uds_path=str(tmp_path / "sock"), tls_cert_path=cert, tls_key_path=key,
        tls_client_ca_cert_path=ca, json_output=True, output_special_tokens=True,
        default_include_stop_seqs=False, otlp_endpoint="http://otel:4317",
        otlp_service_name="svc", max_sequence_length=128, cuda_process_memory_fraction=0.5,
    )  # fmt: skip
    shard = shard_argv("tgs", cfg)
    for flag, value in (
        ("--cuda-process-memory-fraction", "0.5"), ("--dtype", "bfloat16"),
        ("--quantize", "gptq"), ("--revision", "v2"), ("--max-sequence-length", "128"),
        ("--shard-uds-path", f"{tmp_path}/sock"),
    ):  # fmt: skip
        assert option(shard, flag) == value, flag
    assert "--sharded" in shard and "--json-output" in shard
    argv = router_argv("tgr", cfg, Path("/t/tokenizer.json"))
    for flag, value in (
        ("--max-sequence-length", "128"), ("--master-shard-uds-path", f"{tmp_path}/sock-0"),
        ("--served-model-name", str(model_dir)), ("--model-dir", str(model_dir)),
        ("--tls-cert-path", cert), ("--tls-key-path", key), ("--tls-client-ca-cert-path", ca),
        ("--otlp-endpoint", "http://otel:4317"), ("--otlp-service-name", "svc"),
        ("--default-include-stop-seqs", "false"),
    ):  # fmt: skip
        assert option(argv, flag) == value, flag
    assert "--json-output" in argv and "--output-special-tokens" in argv


def test_load_format_is_passed_to_the_shard_only(model_dir: Path) -> None:
    cfg = resolved(model_dir, load_format="dummy")
    assert cfg.load_format == "dummy"
    assert option(shard_argv("tgs", cfg), "--load-format") == "dummy"
    assert "--load-format" not in router_argv("tgr", cfg, model_dir / "tokenizer.json")
    assert "--load-format" not in shard_argv("tgs", resolved(model_dir, load_format="auto"))


def test_adapter_flags_are_passed_to_the_shard_with_an_adapter_cache(
    model_dir: Path, tmp_path: Path
) -> None:
    assert "--adapter-cache" not in shard_argv("tgs", resolved(model_dir, max_loras=3))
    cfg = resolved(model_dir, adapter_cache=str(tmp_path), max_loras=3, max_lora_rank=16)
    shard = shard_argv("tgs", cfg)
    assert option(shard, "--adapter-cache") == str(tmp_path)
    assert (option(shard, "--max-loras"), option(shard, "--max-lora-rank")) == ("3", "16")
    assert "--adapter-cache" not in router_argv("tgr", cfg, model_dir / "tokenizer.json")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            {"adapter_cache": "/nonexistent/adapters"},
            "adapter_cache /nonexistent/adapters is not a directory",
        ),
        ({"max_loras": 0}, r"max_loras \(0\) must be at least 1"),
        ({"max_lora_rank": 0}, r"max_lora_rank \(0\) must be at least 1"),
    ],
)
def test_bad_adapter_flags_fail_at_start(
    model_dir: Path, flags: dict[str, object], message: str
) -> None:
    from tgis.launcher.config import ConfigError

    with pytest.raises(ConfigError, match=message):
        resolved(model_dir, **flags)


def test_shutdown_grace_period_reaches_the_router(model_dir: Path) -> None:
    assert (
        option(router_argv("tgr", resolved(model_dir), Path("/t")), "--shutdown-grace-period")
        == "25.0"
    )
    argv = router_argv("tgr", resolved(model_dir, shutdown_grace_period=110.0), Path("/t"))
    assert option(argv, "--shutdown-grace-period") == "110.0"


def test_json_output_reaches_every_child_on_its_command_line(model_dir: Path) -> None:
    assert "--json-output" not in shard_argv("tgs", resolved(model_dir))
    assert "--json-output" in shard_argv("tgs", resolved(model_dir, json_output=True))
    assert "--json-output" in router_argv("tgr", resolved(model_dir, json_output=True), Path("/t"))


def test_service_name_only_with_endpoint(model_dir: Path) -> None:
    argv = router_argv("tgr", resolved(model_dir, otlp_service_name="svc"), Path("/t"))
    assert "--otlp-service-name" not in argv


def test_embedded_model_name_for_the_router(model_dir: Path) -> None:
    cfg = replace(resolved(model_dir), served_model_name="tgis-tiny-llama (embedded)")
    argv = router_argv("tgr", cfg, Path("/t"))
    assert option(argv, "--served-model-name") == "tgis-tiny-llama (embedded)"


def test_shard_environment(model_dir: Path) -> None:
    cfg = resolved(model_dir, num_shard=2, master_addr="10.0.0.1", master_port=29600)
    env = shard_env(cfg, 1, {"PATH": "/bin", "RANK": "7", "LOG_LEVEL": "debug"})
    assert env == {
        "PATH": "/bin",
        "LOG_LEVEL": "debug",
        "RANK": "1",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "2",
        "LOCAL_SIZE": "2",
        "CROSS_SIZE": "1",
        "CROSS_RANK": "0",
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29600",
        "HF_HUB_OFFLINE": "1",
        "HF_HUB_CACHE": str(cfg.hf_hub_cache),
        "PYTHONUNBUFFERED": "1",
        "NCCL_ASYNC_ERROR_HANDLING": "1",
        "TORCH_NCCL_AVOID_RECORD_STREAMS": "1",
        "SAFETENSORS_FAST_GPU": "1",
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
    }


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        (None, "expandable_segments:True"),
        ("", None),
        (" ", None),
        ("max_split_size_mb:64", "max_split_size_mb:64"),
    ],
)
def test_pytorch_cuda_alloc_conf(model_dir: Path, given: str | None, expected: str | None) -> None:
    base = {} if given is None else {"PYTORCH_CUDA_ALLOC_CONF": given}
    env = shard_env(resolved(model_dir), 0, base)
    assert env.get("PYTORCH_CUDA_ALLOC_CONF") == expected


def test_dry_run_prints_commands(
    run_launcher: RunLauncher, model_dir: Path, tmp_path: Path
) -> None:
    run = run_launcher(
        ["--model-name", str(model_dir), "--shard-uds-path", f"{tmp_path}/s", "--dry-run"],
        {"NUM_GPUS": "2", "HF_HOME": str(tmp_path)},
    )
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert [line.split(":")[0] for line in lines] == ["Shard 0", "Shard 1", "Router"]
    assert f" HF_HUB_CACHE={tmp_path}/hub " in lines[0]  # exported: HF_HOME/hub
    assert " RANK=1 " in lines[1] and " WORLD_SIZE=2 " in lines[1]
    assert " --sharded " in lines[1] + " "
    assert (
        f" --served-model-name {model_dir} --model-dir {model_dir} --tokenizer-path "
        f"{model_dir}/tokenizer.json --master-shard-uds-path {tmp_path}/s-0 "
    ) in lines[2]
    assert "Using model max_sequence_length: 256" in run.stderr
