"""The clients README shows, run as a user would: `examples/python_client.py` (plaintext,
streaming, mTLS) and grpcurl through the proto file (`-proto`) and with client certificates,
against a launched server."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from tests.e2e.certs import make_pki
from tests.e2e.server import BIN_DIR, LauncherProcess, start_launcher
from tgis.pb import generation_pb2 as pb
from tgis.pb import generation_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "python_client.py"
GRPCURL = str(BIN_DIR / "grpcurl")
PROMPT = "Return the number of"


def run_example(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(EXAMPLE), *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=ROOT,
    )


def grpcurl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [GRPCURL, *args], capture_output=True, text=True, timeout=60, check=False, cwd=ROOT
    )


@pytest.fixture(scope="module")
def server(embedded_server: LauncherProcess) -> LauncherProcess:
    return embedded_server


def unary_text(target: str, max_new_tokens: int) -> pb.GenerationResponse:
    with grpc.insecure_channel(target) as channel:
        request = pb.BatchedGenerationRequest(
            requests=[pb.GenerationRequest(text=PROMPT)],
            params=pb.Parameters(stopping=pb.StoppingCriteria(max_new_tokens=max_new_tokens)),
        )
        return pb_grpc.GenerationServiceStub(channel).Generate(request, timeout=60).responses[0]


def test_python_client_generate_and_stream(server: LauncherProcess) -> None:
    expected = unary_text(server.grpc_target, 12)
    stop = pb.StopReason.Name(expected.stop_reason)
    unary = run_example("--target", server.grpc_target, "--max-new-tokens", "12", PROMPT)
    assert unary.returncode == 0, unary.stderr
    assert unary.stdout.startswith("model: DECODER_ONLY, max sequence length ")
    assert f"{expected.text!r} [{expected.generated_token_count} tokens, {stop}]" in unary.stdout
    stream = run_example(
        "--target", server.grpc_target, "--stream", "--max-new-tokens", "12", PROMPT
    )
    assert stream.returncode == 0, stream.stderr
    lines = stream.stdout.splitlines()
    assert lines[1] == expected.text  # the streamed deltas concatenate to the unary text
    assert lines[2] == f"[{expected.generated_token_count} tokens, {stop}]"


def test_python_client_reports_a_bad_request(server: LauncherProcess) -> None:
    result = run_example("--target", server.grpc_target, "--max-new-tokens", "100000", PROMPT)
    assert result.returncode == 1
    assert result.stderr.startswith("error: INVALID_ARGUMENT: max_new_tokens must be <= ")


def test_grpcurl_through_the_proto_file(server: LauncherProcess) -> None:
    """README's `-import-path protos -proto generation.proto` form: camelCase JSON names,
    the same text as the stubs get."""
    expected = unary_text(server.grpc_target, 8)
    body = {"requests": [{"text": PROMPT}], "params": {"stopping": {"maxNewTokens": 8}}}
    result = grpcurl(
        "-plaintext", "-import-path", "protos", "-proto", "generation.proto",
        "-d", json.dumps(body), server.grpc_target, "fmaas.GenerationService/Generate",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    (response,) = json.loads(result.stdout)["responses"]
    assert response["text"] == expected.text
    assert response["generatedTokenCount"] == expected.generated_token_count


def test_clients_over_mtls(tmp_path: Path) -> None:
    pki = make_pki(tmp_path / "pki")
    launcher = start_launcher(
        tmp_path,
        [
            "--tls-cert-path", str(pki.server_cert),
            "--tls-key-path", str(pki.server_key),
            "--tls-client-ca-cert-path", str(pki.ca_cert),
        ],
    )  # fmt: skip
    try:
        launcher.wait_healthy()
        target = f"localhost:{launcher.grpc_target.rsplit(':', 1)[1]}"
        certs = ["--cert", str(pki.client_cert), "--key", str(pki.client_key)]
        ok = run_example("--target", target, "--ca", str(pki.ca_cert), *certs, PROMPT)
        assert ok.returncode == 0, ok.stderr
        assert "tokens, " in ok.stdout
        refused = run_example("--target", target, "--ca", str(pki.ca_cert), PROMPT)
        assert refused.returncode == 1
        assert refused.stderr.startswith("error: UNAVAILABLE")
        info = grpcurl(
            "-cacert", str(pki.ca_cert), "-cert", str(pki.client_cert),
            "-key", str(pki.client_key), "-d", "{}", target,
            "fmaas.GenerationService/ModelInfo",
        )  # fmt: skip
        assert info.returncode == 0, info.stderr
        # DECODER_ONLY is the enum's zero value, which JSON output leaves out.
        fields = json.loads(info.stdout)
        assert "modelKind" not in fields and fields, info.stdout
    finally:
        assert launcher.stop() == 0
