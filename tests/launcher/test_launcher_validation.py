"""Start-up validation through the real console script: one `error:` line on stderr, the same
line in the termination log, a non-zero exit, and no process started."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from .helpers import RunLauncher

MISSING = "/nonexistent/tgis-test/file.pem"

BOOL_HINT = "expected one of true, false, 1, 0, yes, no"
SEQ_MSG = "must be at least 2 (1 input + 1 output)"


@dataclass(frozen=True)
class Case:
    """Extra launcher args and env ("{file}" is an existing file) and the expected message."""

    id: str
    args: list[str]
    env: dict[str, str]
    message: str


CASES = [
    Case("unknown-option", ["--bogus"], {}, "No such option '--bogus'."),
    Case(
        "port-not-int", ["--port", "x"], {}, "invalid value for --port: 'x' is not a valid integer."
    ),
    Case(
        "port-env-not-int",
        [],
        {"PORT": "abc"},
        "invalid value for PORT: 'abc' is not a valid integer.",
    ),
    Case(
        "bool-env-flag",
        [],
        {"JSON_OUTPUT": "maybe"},
        "invalid value for JSON_OUTPUT: 'maybe': " + BOOL_HINT,
    ),
    Case(
        "bool-env-flag-on",
        [],
        {"OUTPUT_SPECIAL_TOKENS": "on"},
        "invalid value for OUTPUT_SPECIAL_TOKENS: 'on': " + BOOL_HINT,
    ),
    Case(
        "bool-env-value",
        [],
        {"DEFAULT_INCLUDE_STOP_SEQS": "nope"},
        "invalid value for DEFAULT_INCLUDE_STOP_SEQS: 'nope': " + BOOL_HINT,
    ),
    Case(
        "bool-cli-value",
        ["--default-include-stop-seqs", "maybe"],
        {},
        "invalid value for --default-include-stop-seqs: 'maybe': " + BOOL_HINT,
    ),
    Case(
        "framework",
        ["--deployment-framework", "vllm"],
        {},
        "unknown deployment_framework 'vllm': expected one of hf_transformers, tgis_native, "
        "hf_accelerate, hf_optimum_ort, hf_optimum_bt, ibm_fms",
    ),
    Case(
        "dtype-unknown",
        ["--dtype", "int4"],
        {},
        "unknown dtype 'int4': expected auto or one of float32, fp32, float, float16, fp16, half, "
        "bfloat16, bf16",
    ),
    Case(
        "dtype-conflict",
        ["--dtype", "float16", "--dtype-str", "bfloat16"],
        {},
        "dtype and dtype_str args both provided with different values",
    ),
    Case(
        "dtype-conflict-env",
        ["--dtype", "fp16"],
        {"DTYPE_STR": "bf16"},
        "dtype and dtype_str args both provided with different values",
    ),
    Case(
        "quantize",
        ["--quantize", "squeezellm"],
        {},
        "unknown quantize 'squeezellm': expected one of gptq, awq, compressed-tensors, fp8, "
        "int8, bitsandbytes, eetq",
    ),
    Case(
        "max-concurrent",
        ["--max-concurrent-requests", "0"],
        {},
        "max_concurrent_requests must be > 0",
    ),
    Case("max-new-tokens", ["--max-new-tokens", "0"], {}, "max_new_tokens (0) at least 1"),
    Case("max-seq-len", ["--max-sequence-length", "1"], {}, "max_sequence_length (1) " + SEQ_MSG),
    Case(
        "max-seq-len-model",
        [],
        {"MODEL_CONFIG": '{"n_positions": 1}'},
        "max_sequence_length (1) " + SEQ_MSG,
    ),
    Case("max-batch-size", ["--max-batch-size", "0"], {}, "max_batch_size (0) must be at least 1"),
    Case(
        "prefill-padding",
        ["--max-prefill-padding", "1.5"],
        {},
        "max_prefill_padding (1.5) must be in range 0 <= x <= 1",
    ),
    Case(
        "safety-margin",
        ["--batch-safety-margin", "101"],
        {},
        "batch_safety_margin (101) must be in range 0 <= x <= 100",
    ),
    Case(
        "cuda-fraction-0",
        ["-c", "0"],
        {},
        "cuda_process_memory_fraction must be in range 0 < x <= 1",
    ),
    Case(
        "cuda-fraction-env",
        [],
        {"CUDA_PROCESS_MEMORY_FRACTION": "1.5"},
        "cuda_process_memory_fraction must be in range 0 < x <= 1",
    ),
    Case(
        "cuda-fraction-alias-env",
        [],
        {"CUDA_MEMORY_FRACTION": "0"},
        "cuda_process_memory_fraction must be in range 0 < x <= 1",
    ),
    Case(
        "total-below-sequence",
        ["--max-batch-total-tokens", "200"],
        {},
        "max_batch_total_tokens (200) must be >= max_sequence_length (256): one request of the "
        "maximum length must fit",
    ),
    Case(
        "total-below-sequence-alias",
        ["--max-total-tokens", "300", "--max-batch-total-tokens", "299"],
        {},
        "max_batch_total_tokens (299) must be >= max_sequence_length (300): one request of the "
        "maximum length must fit",
    ),
    Case(
        "prefill-above-total",
        ["--max-batch-prefill-tokens", "600"],
        {"MAX_BATCH_TOTAL_TOKENS": "512"},
        "max_batch_prefill_tokens (600) must be <= max_batch_total_tokens (512)",
    ),
    Case(
        "prefill-0",
        ["--max-batch-prefill-tokens", "0"],
        {},
        "max_batch_prefill_tokens (0) must be > 0",
    ),
    Case(
        "served-ratio",
        [],
        {"WAITING_SERVED_RATIO": "-0.5"},
        "waiting_served_ratio (-0.5) must be >= 0",
    ),
    Case(
        "waiting-tokens", ["--max-waiting-tokens", "-1"], {}, "max_waiting_tokens (-1) must be >= 0"
    ),
    Case(
        "client-batch",
        ["--max-client-batch-size", "0"],
        {},
        "max_client_batch_size (0) must be > 0",
    ),
    Case(
        "input-tokens",
        ["--max-input-tokens", "256"],
        {},
        "max_input_tokens (256) must be < max_sequence_length (256)",
    ),
    Case(
        "total-tokens-env-alias-not-int",
        [],
        {"MAX_TOTAL_TOKENS": "lots"},
        "invalid value for MAX_TOTAL_TOKENS: 'lots' is not a valid integer.",
    ),
    Case("port-0", ["-p", "0"], {}, "port (0) must be in range 1..65535"),
    Case("grpc-port-big", ["-g", "70000"], {}, "grpc_port (70000) must be in range 1..65535"),
    Case(
        "master-port", [], {"MASTER_PORT": "65536"}, "master_port (65536) must be in range 1..65535"
    ),
    Case(
        "same-ports", ["-p", "9000", "-g", "9000"], {}, "port and grpc_port must differ (both 9000)"
    ),
    Case(
        "startup-timeout",
        ["--shard-startup-timeout", "0"],
        {},
        "shard_startup_timeout (0.0) must be > 0 seconds",
    ),
    Case(
        "shutdown-grace-period",
        [],
        {"SHUTDOWN_GRACE_PERIOD": "-1"},
        "shutdown_grace_period (-1.0) must be in range 0 <= x < 86400",
    ),
    Case("tls-cert-only", ["--tls-cert-path", "{file}"], {}, "tls: must provide both cert and key"),
    Case("tls-key-only", [], {"TLS_KEY_PATH": "{file}"}, "tls: must provide both cert and key"),
    Case(
        "tls-ca-only",
        ["--tls-client-ca-cert-path", "{file}"],
        {},
        "tls: cannot provide client ca cert without keypair",
    ),
    Case(
        "tls-cert-missing",
        ["--tls-cert-path", MISSING, "--tls-key-path", "{file}"],
        {},
        f"tls: cert file not found: {MISSING}",
    ),
    Case(
        "tls-key-missing",
        ["--tls-cert-path", "{file}", "--tls-key-path", MISSING],
        {},
        f"tls: key file not found: {MISSING}",
    ),
    Case(
        "tls-ca-missing",
        [
            "--tls-cert-path",
            "{file}",
            "--tls-key-path",
            "{file}",
            "--tls-client-ca-cert-path",
            MISSING,
        ],
        {},
        f"tls: client ca cert file not found: {MISSING}",
    ),
    Case(
        "load-format-unknown",
        ["--load-format", "npz"],
        {},
        "unknown load_format 'npz': expected one of auto, dummy",
    ),
    Case(
        "load-format-env-unknown",
        [],
        {"LOAD_FORMAT": "random"},
        "unknown load_format 'random': expected one of auto, dummy",
    ),
    Case("num-gpus-text", [], {"NUM_GPUS": "two"}, "NUM_GPUS must be a positive integer"),
    Case("num-gpus-negative", [], {"NUM_GPUS": "-1"}, "NUM_GPUS must be a positive integer"),
    Case(
        "num-gpus-vs-num-shard",
        ["--num-shard", "2"],
        {"NUM_GPUS": "4"},
        "NUM_GPUS and num_shard are set to different values (4 and 2)",
    ),
    Case("num-shard-0", ["--num-shard", "0"], {}, "`num_shard` / NUM_GPUS cannot be < 1"),
    Case("num-gpus-0", [], {"NUM_GPUS": "0"}, "`num_shard` / NUM_GPUS cannot be < 1"),
    Case(
        "hf-cache-conflict",
        [],
        {"HF_HUB_CACHE": "/a", "TRANSFORMERS_CACHE": "/b"},
        "TRANSFORMERS_CACHE and HF_HUB_CACHE env vars can't be set to different values",
    ),
    Case(
        "hf-cache-deprecated-conflict",
        [],
        {"HUGGINGFACE_HUB_CACHE": "/a", "TRANSFORMERS_CACHE": "/b"},
        "TRANSFORMERS_CACHE and HUGGINGFACE_HUB_CACHE env vars can't be set to different values",
    ),
    Case(
        "uds-dir-missing",
        ["--shard-uds-path", "/nonexistent/tgis-test/sock"],
        {},
        "shard_uds_path: directory /nonexistent/tgis-test does not exist",
    ),
    Case(
        "uds-too-long",
        ["--shard-uds-path", "/tmp/" + "s" * 110],
        {},
        "shard_uds_path too long for a Unix socket ('/tmp/" + "s" * 110 + "-0' is over 107 bytes)",
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_setting_fails_with_one_line(
    run_launcher: RunLauncher, model_dir: Path, tmp_path: Path, case: Case
) -> None:
    args, env, message = case.args, dict(case.env), case.message
    pem = tmp_path / "some.pem"
    pem.write_text("not checked here")
    env = {k: v.replace("{file}", str(pem)) for k, v in env.items()}
    if "MODEL_CONFIG" in env:
        (model_dir / "config.json").write_text(env.pop("MODEL_CONFIG"))
    args = [a.replace("{file}", str(pem)) for a in args]
    run = run_launcher(["--model-name", str(model_dir), *args, "--dry-run"], env)
    assert run.returncode != 0
    assert run.error_line == message
    assert run.stderr.count("error: ") == 1
    assert run.termination_log == message + "\n"
    assert "Shard 0:" not in run.stdout  # nothing was started (nor printed by --dry-run)


def test_model_not_found(run_launcher: RunLauncher, tmp_path: Path) -> None:
    env = {"HF_HUB_CACHE": str(tmp_path / "cache")}
    run = run_launcher(["--model-name", "acme/no-such-model", "--dry-run"], env)
    assert run.returncode != 0
    assert run.error_line.startswith("model 'acme/no-such-model' not found")
    assert run.termination_log == run.error_line + "\n"


def test_missing_tokenizer_that_cannot_be_converted(
    run_launcher: RunLauncher, tmp_path: Path
) -> None:
    model = tmp_path / "no-tokenizer"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama"}')
    run = run_launcher(["--model-name", str(model), "--dry-run"])
    assert run.returncode != 0
    assert run.error_line == "No existing fast tokenizer (tokenizer.json) found"
    assert run.termination_log == "No existing fast tokenizer (tokenizer.json) found\n"


def test_termination_log_not_created_under_dev(run_launcher: RunLauncher) -> None:
    """Outside Kubernetes /dev/termination-log does not exist and is not created."""
    run = run_launcher(["--port", "0"], {"TGIS_TERMINATION_LOG": "/dev/termination-log"})
    assert run.returncode != 0
    assert run.error_line == "port (0) must be in range 1..65535"
