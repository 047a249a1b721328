"""The Node.js example (`examples/node`, README "From Node.js"), run as a user would: `npm ci`
from its lockfile into a copy of the example, then `node client.js` against the launched
embedded model: its replies are the ones the Python stubs get for the same requests. Its TLS
flags are checked against an in-process server with canned replies.

Node.js (20 or later) and npm must be on PATH, and the npm registry reachable for `npm ci`;
CI has both, so a missing tool fails the module rather than skipping it.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest

from tests.e2e.certs import make_pki
from tests.e2e.server import LauncherProcess
from tgis.pb import generation_pb2 as pb
from tgis.pb import generation_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "node"
# With the embedded model (greedy) the first stops at max_new_tokens, the second at EOS.
PROMPTS = ("Return the number of", "Once upon a time")
MAX_NEW_TOKENS = 8


def tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"`{name}` is not on PATH: examples/node needs Node.js 20+ and npm")
    return path


@pytest.fixture(scope="module")
def example(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of examples/node, with the proto file where client.js looks for it
    (../../protos) and the lockfile's packages installed by `npm ci`."""
    root = tmp_path_factory.mktemp("node")
    copy = root / "examples" / "node"
    shutil.copytree(EXAMPLE, copy, ignore=shutil.ignore_patterns("node_modules"))
    (root / "protos").mkdir()
    shutil.copy(ROOT / "protos" / "generation.proto", root / "protos")
    npm = [tool("npm"), "ci", "--no-audit", "--no-fund", "--ignore-scripts"]
    result = subprocess.run(npm, cwd=copy, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    return copy


@pytest.fixture(scope="module")
def server(embedded_server: LauncherProcess) -> LauncherProcess:
    return embedded_server


def run_node(example: Path, target: str, *args: str) -> subprocess.CompletedProcess[str]:
    prompts = [arg for text in PROMPTS for arg in ("--prompt", text)]
    argv = [tool("node"), "client.js", "--target", target, *prompts, *args]
    return subprocess.run(argv, cwd=example, capture_output=True, text=True, timeout=120)


def node_json(example: Path, target: str, *args: str) -> dict[str, Any]:
    result = run_node(example, target, "--json", "--max-new-tokens", str(MAX_NEW_TOKENS), *args)
    assert result.returncode == 0, result.stderr
    replies: dict[str, Any] = json.loads(result.stdout)
    return replies


def python_replies(
    stub: pb_grpc.GenerationServiceStub,
) -> tuple[list[pb.GenerationResponse], list[pb.GenerationResponse], pb.ModelInfoResponse]:
    """What client.js asks, through the Python stubs: Generate of PROMPTS, GenerateStream of
    the first one, ModelInfo."""
    params = pb.Parameters(stopping=pb.StoppingCriteria(max_new_tokens=MAX_NEW_TOKENS))
    batch = pb.BatchedGenerationRequest(
        requests=[pb.GenerationRequest(text=text) for text in PROMPTS], params=params
    )
    single = pb.SingleGenerationRequest(
        request=pb.GenerationRequest(text=PROMPTS[0]), params=params
    )
    return (
        list(stub.Generate(batch, timeout=60).responses),
        list(stub.GenerateStream(single, timeout=60)),
        stub.ModelInfo(pb.ModelInfoRequest(model_id="default"), timeout=60),
    )


def test_node_client_matches_the_python_stubs(
    example: Path, server: LauncherProcess, stub: pb_grpc.GenerationServiceStub
) -> None:
    node = node_json(example, server.grpc_target)
    responses, messages, info = python_replies(stub)
    assert node["generate"] == [
        {
            "text": r.text,
            "input_token_count": r.input_token_count,
            "generated_token_count": r.generated_token_count,
            "stop_reason": pb.StopReason.Name(r.stop_reason),
        }
        for r in responses
    ]
    first = responses[0]
    stream = node["stream"]
    assert stream["text"] == first.text == "".join(m.text for m in messages)
    assert stream["generated_token_count"] == first.generated_token_count
    assert stream["stop_reason"] == pb.StopReason.Name(first.stop_reason)
    # The input message, then a message per token (tokens a slow reader left queued go out
    # together, README "From Python").
    assert 2 <= stream["messages"] <= first.generated_token_count + 1
    assert node["model_info"] == {
        "model_kind": pb.ModelInfoResponse.ModelKind.Name(info.model_kind),
        "max_sequence_length": info.max_sequence_length,
        "max_new_tokens": info.max_new_tokens,
    }


def test_node_client_prints_readable_lines(
    example: Path, server: LauncherProcess, stub: pb_grpc.GenerationServiceStub
) -> None:
    responses, _, info = python_replies(stub)
    result = run_node(example, server.grpc_target, "--max-new-tokens", str(MAX_NEW_TOKENS))
    assert result.returncode == 0, result.stderr

    def counts(r: pb.GenerationResponse) -> str:
        return f"[{r.generated_token_count} tokens, {pb.StopReason.Name(r.stop_reason)}]"

    lines = [
        f"model: {pb.ModelInfoResponse.ModelKind.Name(info.model_kind)}, "
        f"max sequence length {info.max_sequence_length}",
        *(f"generate: {json.dumps(r.text, ensure_ascii=False)} {counts(r)}" for r in responses),
        f"stream: {responses[0].text}",  # client.js writes the pieces as they come
        counts(responses[0]),
    ]
    assert result.stdout.splitlines() == lines


def test_node_client_reports_a_failed_call(example: Path, server: LauncherProcess) -> None:
    result = run_node(example, server.grpc_target, "--max-new-tokens", "100000")
    assert result.returncode == 1
    assert result.stderr.startswith("error: INVALID_ARGUMENT: max_new_tokens must be <= ")


class Canned(pb_grpc.GenerationServiceServicer):
    """Fixed replies (each prompt reversed), for the client's TLS settings: the server's TLS
    is tests/e2e/test_clients.py's, and a launch of its own would cost seconds."""

    def ModelInfo(self, request: Any, context: Any) -> pb.ModelInfoResponse:
        return pb.ModelInfoResponse(max_sequence_length=64, max_new_tokens=8)

    def Generate(self, request: Any, context: Any) -> pb.BatchedGenerationResponse:
        return pb.BatchedGenerationResponse(
            responses=[self.reply(r.text) for r in request.requests]
        )

    def GenerateStream(self, request: Any, context: Any) -> Iterator[pb.GenerationResponse]:
        yield self.reply(request.request.text)

    @staticmethod
    def reply(text: str) -> pb.GenerationResponse:
        return pb.GenerationResponse(
            text=text[::-1], generated_token_count=1, stop_reason=pb.EOS_TOKEN
        )


def test_node_client_over_mtls(example: Path, tmp_path: Path) -> None:
    """--ca, --cert and --key against a server that requires client certificates."""
    pki = make_pki(tmp_path / "pki")
    server = grpc.server(ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_GenerationServiceServicer_to_server(Canned(), server)
    credentials = grpc.ssl_server_credentials(
        [(pki.server_key.read_bytes(), pki.server_cert.read_bytes())],
        root_certificates=pki.ca_cert.read_bytes(),
        require_client_auth=True,
    )
    target = f"localhost:{server.add_secure_port('localhost:0', credentials)}"
    server.start()
    try:
        certs = ("--cert", str(pki.client_cert), "--key", str(pki.client_key))
        node = node_json(example, target, "--ca", str(pki.ca_cert), *certs)
        assert [g["text"] for g in node["generate"]] == [text[::-1] for text in PROMPTS]
        assert node["stream"]["text"] == PROMPTS[0][::-1]
        assert node["model_info"]["max_sequence_length"] == 64
        refused = run_node(example, target, "--ca", str(pki.ca_cert))
        assert refused.returncode == 1
        assert refused.stderr.startswith("error: UNAVAILABLE")
    finally:
        server.stop(None)
