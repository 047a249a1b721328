"""The whole server, end to end: real launcher, shard and router processes on loopback.

Calls every RPC through stubs generated from protos/generation.proto and through the
real grpcurl binary (server reflection, no proto file).
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import grpc
import pytest

from tests.e2e.probes import metric_sample
from tests.e2e.server import BIN_DIR, LauncherProcess, start_launcher
from tests.e2e.streams import GrpcStream, stream_request
from tgis.pb import generation_pb2 as pb
from tgis.pb import generation_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow

GRPCURL = str(BIN_DIR / "grpcurl")
PROMPT = "Return the number of"


@pytest.fixture(scope="module")
def server(embedded_server: LauncherProcess) -> LauncherProcess:
    return embedded_server


def greedy(max_new_tokens: int, min_new_tokens: int = 0, **response: bool) -> pb.Parameters:
    return pb.Parameters(
        method=pb.GREEDY,
        stopping=pb.StoppingCriteria(max_new_tokens=max_new_tokens, min_new_tokens=min_new_tokens),
        response=pb.ResponseOptions(**response),
    )


def grpcurl(target: str, method: str, body: dict | None = None) -> dict:
    args = [GRPCURL, "-plaintext"]
    if body is not None:
        args += ["-d", json.dumps(body)]
    result = subprocess.run(
        [*args, target, method], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


# ---- unary, streaming, tokenize, model info through generated stubs ---------------------------


def test_generate_batch_of_inputs(stub: pb_grpc.GenerationServiceStub) -> None:
    request = pb.BatchedGenerationRequest(
        requests=[pb.GenerationRequest(text=PROMPT), pb.GenerationRequest(text="The file is")],
        params=greedy(12, min_new_tokens=12, input_text=True),
    )
    response = stub.Generate(request, timeout=60)
    assert len(response.responses) == 2
    for sent, got in zip(request.requests, response.responses, strict=True):
        assert got.generated_token_count == 12
        assert got.stop_reason == pb.MAX_TOKENS
        assert got.input_token_count > 1  # BOS + the words
        assert got.text.startswith(sent.text)
        assert len(got.text) > len(sent.text)
        assert got.seed == 0
    assert response.responses[0].text != response.responses[1].text


def test_greedy_output_is_english_like(stub: pb_grpc.GenerationServiceStub) -> None:
    response = stub.Generate(
        pb.BatchedGenerationRequest(
            requests=[pb.GenerationRequest(text=PROMPT)], params=greedy(16, min_new_tokens=16)
        ),
        timeout=60,
    )
    words = response.responses[0].text.split()
    alphabetic = [w for w in words if w.strip(".,;:()'\"").isalpha()]
    assert len(words) >= 4
    assert len(alphabetic) >= 0.6 * len(words), response.responses[0].text


def test_stream_concatenation_equals_unary(stub: pb_grpc.GenerationServiceStub) -> None:
    params = greedy(20, generated_tokens=True, token_logprobs=True)
    unary = stub.Generate(
        pb.BatchedGenerationRequest(requests=[pb.GenerationRequest(text=PROMPT)], params=params),
        timeout=60,
    ).responses[0]
    messages = list(
        stub.GenerateStream(
            pb.SingleGenerationRequest(request=pb.GenerationRequest(text=PROMPT), params=params),
            timeout=60,
        )
    )
    first, rest = messages[0], messages[1:]
    assert first.input_token_count == unary.input_token_count
    assert first.generated_token_count == 0
    assert "".join(m.text for m in rest) == unary.text
    assert [t.text for m in rest for t in m.tokens] == [t.text for t in unary.tokens]
    assert rest[-1].generated_token_count == unary.generated_token_count
    assert rest[-1].stop_reason == unary.stop_reason
    assert all(m.stop_reason == pb.NOT_FINISHED for m in rest[:-1])
    assert len(unary.tokens) == unary.generated_token_count
    assert all(t.logprob <= 0.0 for t in unary.tokens)


def test_tokenize_and_model_info(stub: pb_grpc.GenerationServiceStub) -> None:
    tokenized = stub.Tokenize(
        pb.BatchedTokenizeRequest(
            requests=[pb.TokenizeRequest(text="Hello world"), pb.TokenizeRequest(text="é")],
            return_tokens=True,
            return_offsets=True,
        ),
        timeout=30,
    )
    first = tokenized.responses[0]
    assert first.token_count == len(first.tokens) == len(first.offsets) >= 3
    assert first.offsets[-1].end == len(b"Hello world")
    info = stub.ModelInfo(pb.ModelInfoRequest(), timeout=30)
    assert info.model_kind == pb.ModelInfoResponse.DECODER_ONLY
    assert info.max_sequence_length > 0
    assert info.max_new_tokens == min(1024, info.max_sequence_length - 1)


def test_validation_error_is_invalid_argument(stub: pb_grpc.GenerationServiceStub) -> None:
    info = stub.ModelInfo(pb.ModelInfoRequest(), timeout=30)
    with pytest.raises(grpc.RpcError) as excinfo:
        stub.Generate(
            pb.BatchedGenerationRequest(
                requests=[pb.GenerationRequest(text="x")],
                params=greedy(info.max_new_tokens + 1),
            ),
            timeout=30,
        )
    assert excinfo.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert excinfo.value.details() == f"max_new_tokens must be <= {info.max_new_tokens}"


def test_more_inputs_than_the_concurrency_limit_is_overloaded(
    stub: pb_grpc.GenerationServiceStub,
) -> None:
    too_many = [pb.GenerationRequest(text="x")] * 513  # launcher default limit: 512
    with pytest.raises(grpc.RpcError) as excinfo:
        stub.Generate(pb.BatchedGenerationRequest(requests=too_many), timeout=30)
    assert excinfo.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert excinfo.value.details() == "Model is overloaded"


def _metric(server: LauncherProcess, sample: str) -> float:
    return metric_sample(server, sample) or 0.0


def test_cancelled_stream_is_dropped_and_the_server_carries_on(
    server: LauncherProcess, stub: pb_grpc.GenerationServiceStub
) -> None:
    cancelled = 'tgi_request_failure_total{err="cancelled"}'
    before = _metric(server, cancelled)
    call = stub.GenerateStream(
        pb.SingleGenerationRequest(
            request=pb.GenerationRequest(text=PROMPT), params=greedy(400, min_new_tokens=400)
        ),
        timeout=120,
    )
    received = [next(call) for _ in range(3)]
    call.cancel()
    assert received[-1].generated_token_count >= 1
    deadline = time.monotonic() + 30
    while _metric(server, cancelled) < before + 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _metric(server, cancelled) == before + 1
    after = stub.Generate(
        pb.BatchedGenerationRequest(requests=[pb.GenerationRequest(text="ok")], params=greedy(2)),
        timeout=60,
    )
    assert after.responses[0].generated_token_count == 2


# ---- grpcurl with reflection -----------------------------------------------------------------


def test_grpcurl_all_rpcs_via_reflection(server: LauncherProcess) -> None:
    """Reflected descriptors carry json_name, so grpcurl prints camelCase names, as against
    TGIS and as with -proto (tests/e2e/test_clients.py)."""
    target = server.grpc_target
    services = subprocess.run(
        [GRPCURL, "-plaintext", target, "list"], capture_output=True, text=True, check=True
    ).stdout.split()
    assert "fmaas.GenerationService" in services
    assert "grpc.health.v1.Health" in services

    generated = grpcurl(
        target,
        "fmaas.GenerationService/Generate",
        {
            "requests": [{"text": PROMPT}],
            "params": {"stopping": {"maxNewTokens": 5, "minNewTokens": 5}},
        },
    )
    (response,) = generated["responses"]
    assert response["generatedTokenCount"] == 5
    assert response["stopReason"] == "MAX_TOKENS"
    assert response["text"]

    result = subprocess.run(
        [
            GRPCURL,
            "-plaintext",
            "-d",
            json.dumps({"request": {"text": PROMPT}, "params": {"stopping": {"maxNewTokens": 4}}}),
            target,
            "fmaas.GenerationService/GenerateStream",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    decoder = json.JSONDecoder()
    text, messages, pos = result.stdout.strip(), [], 0
    while pos < len(text):
        message, pos = decoder.raw_decode(text, pos)
        messages.append(message)
        pos += len(text[pos:]) - len(text[pos:].lstrip())
    assert messages[0]["inputTokenCount"] > 0
    assert messages[-1]["stopReason"] in ("MAX_TOKENS", "EOS_TOKEN")

    tokenized = grpcurl(
        target,
        "fmaas.GenerationService/Tokenize",
        {"requests": [{"text": "Hello world"}], "returnTokens": True},
    )
    assert tokenized["responses"][0]["tokenCount"] == len(tokenized["responses"][0]["tokens"])

    info = grpcurl(target, "fmaas.GenerationService/ModelInfo", {})
    assert info["maxSequenceLength"] > 0
    assert info.get("modelKind", "DECODER_ONLY") == "DECODER_ONLY"

    health = grpcurl(target, "grpc.health.v1.Health/Check", {})
    assert health["status"] == "SERVING"


# ---- HTTP ------------------------------------------------------------------------------------


def test_http_health_and_metrics(server: LauncherProcess) -> None:
    status, body = server.http_get("/health")
    assert (status, body) == (200, b"")
    status, body = server.http_get("/metrics")
    assert status == 200
    text = body.decode()
    assert "tgi_request_count_total" in text
    assert "tgi_request_success_total" in text
    status, _ = server.http_get("/nope")
    assert status == 404


def test_both_ports_answer_on_ipv6_loopback(server: LauncherProcess) -> None:
    with urllib.request.urlopen(f"http://[::1]:{server.http_port}/health", timeout=60) as resp:
        assert resp.status == 200
    with grpc.insecure_channel(f"[::1]:{server.grpc_port}") as channel:
        info = pb_grpc.GenerationServiceStub(channel).ModelInfo(pb.ModelInfoRequest(), timeout=30)
    assert info.max_sequence_length > 0


# ---- continuous batching -----------------------------------------------------------------------


def test_concurrent_streams_and_a_late_request_overtakes(
    stub: pb_grpc.GenerationServiceStub,
) -> None:
    lengths = [8, 16, 24, 32, 40, 48, 120, 160]
    streams = [
        GrpcStream(
            stub,
            stream_request(f"{PROMPT} items {index}", greedy(length, min_new_tokens=length)),
            started_after=2,
        )
        for index, length in enumerate(lengths)
    ]
    for stream in streams:
        stream.start()
    longest = streams[-1]  # 160 tokens
    assert longest.started.wait(60)
    # Submitted while the long streams are generating: must not wait for them to end.
    late = stub.Generate(
        pb.BatchedGenerationRequest(
            requests=[pb.GenerationRequest(text="late")], params=greedy(3, min_new_tokens=3)
        ),
        timeout=60,
    )
    late_done = time.monotonic()
    for stream in streams:
        stream.join(120)
    errors = [stream.error for stream in streams if stream.error]
    assert not errors, errors
    assert late.responses[0].generated_token_count == 3
    for stream, length in zip(streams, lengths, strict=True):
        assert (stream.tokens, stream.stop_reason) == (length, pb.MAX_TOKENS)
    assert longest.ended_at is not None
    assert late_done < longest.ended_at, (
        "a request that arrived mid-generation waited for the batch"
    )


# ---- TLS and mTLS ------------------------------------------------------------------------------


def _generate_once(channel: grpc.Channel) -> pb.BatchedGenerationResponse:
    return pb_grpc.GenerationServiceStub(channel).Generate(
        pb.BatchedGenerationRequest(requests=[pb.GenerationRequest(text="hi")], params=greedy(2)),
        timeout=30,
    )


def test_tls_and_mtls(tmp_path: Path) -> None:
    from tests.e2e.certs import make_pki

    pki = make_pki(tmp_path / "pki")
    ca = pki.ca_cert.read_bytes()
    client_cert, client_key = pki.client_cert.read_bytes(), pki.client_key.read_bytes()

    tls = start_launcher(
        tmp_path,
        ["--tls-cert-path", str(pki.server_cert), "--tls-key-path", str(pki.server_key)],
    )
    try:
        tls.wait_healthy()
        target = tls.grpc_target
        with grpc.secure_channel(target, grpc.ssl_channel_credentials(ca)) as channel:
            assert _generate_once(channel).responses[0].generated_token_count == 2
        with grpc.insecure_channel(target) as channel, pytest.raises(grpc.RpcError) as plain:
            _generate_once(channel)
        assert plain.value.code() == grpc.StatusCode.UNAVAILABLE
        other = pki.other_ca_cert.read_bytes()
        with (
            grpc.secure_channel(target, grpc.ssl_channel_credentials(other)) as channel,
            pytest.raises(grpc.RpcError),
        ):
            _generate_once(channel)
    finally:
        assert tls.stop() == 0

    mtls = start_launcher(
        tmp_path,
        [
            "--tls-cert-path",
            str(pki.server_cert),
            "--tls-key-path",
            str(pki.server_key),
            "--tls-client-ca-cert-path",
            str(pki.ca_cert),
        ],
    )
    try:
        mtls.wait_healthy()
        target = mtls.grpc_target
        with (
            grpc.secure_channel(target, grpc.ssl_channel_credentials(ca)) as channel,
            pytest.raises(grpc.RpcError) as no_cert,
        ):
            _generate_once(channel)
        assert no_cert.value.code() == grpc.StatusCode.UNAVAILABLE
        credentials = grpc.ssl_channel_credentials(ca, client_key, client_cert)
        with grpc.secure_channel(target, credentials) as channel:
            assert _generate_once(channel).responses[0].generated_token_count == 2
        # A client certificate signed by a CA the server does not trust is refused.
        stranger = grpc.ssl_channel_credentials(
            ca, pki.other_client_key.read_bytes(), pki.other_client_cert.read_bytes()
        )
        with (
            grpc.secure_channel(target, stranger) as channel,
            pytest.raises(grpc.RpcError) as untrusted,
        ):
            _generate_once(channel)
        assert untrusted.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        assert mtls.stop() == 0


# ---- process handling ------------------------------------------------------------------------


def test_sigterm_leaves_no_child_behind(tmp_path: Path) -> None:
    from tests.e2e.server import descendants, is_alive

    launcher = start_launcher(tmp_path)
    try:
        launcher.wait_healthy()
        children = descendants(launcher.proc.pid)
        assert len(children) >= 2, "expected at least a shard and a router"
        launcher.proc.send_signal(signal.SIGTERM)
        code = launcher.proc.wait(60)
        assert code == 0, launcher.log_tail()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(is_alive(p) for p in children):
            time.sleep(0.1)
        assert not [p for p in children if is_alive(p)]
        assert not list(launcher.socket_dir.glob("shard-*")), "shard sockets left behind"
    finally:
        launcher.stop()
