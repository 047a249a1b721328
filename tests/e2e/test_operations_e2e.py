"""Operations conventions with the real launcher, shard and router processes: the drain on
SIGTERM, TLS certificate rotation, JSON logs with correlation ids, OTLP traces and fatal
errors in the termination log."""

from __future__ import annotations

import json
import random
import signal
import socket
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2

from tests.e2e.certs import Pki, SecretMount, make_pki, server_files
from tests.e2e.models import save_tiny_llama
from tests.e2e.probes import greedy, health_status, wait_until
from tests.e2e.server import LauncherProcess, descendants, free_port, is_alive, start_launcher
from tests.e2e.streams import long_stream, start_stream
from tests.otlp_collector import OtlpCollector
from tgis.pb import generation_pb2 as pb
from tgis.pb import generation_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow

NEW_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]  # no connection shared across channels


def generate_once(
    channel: grpc.Channel, metadata: tuple[tuple[str, str], ...] = ()
) -> pb.BatchedGenerationResponse:
    return pb_grpc.GenerationServiceStub(channel).Generate(
        pb.BatchedGenerationRequest(requests=[pb.GenerationRequest(text="hi")], params=greedy(2)),
        metadata=metadata,
        timeout=30,
    )


# ---- drain on SIGTERM -------------------------------------------------------------------------


def test_sigterm_drains_the_in_flight_stream_then_exits_0(tmp_path: Path) -> None:
    # Far beyond the stream's length, even on a busy machine (test_shutdown_e2e.py: cut short).
    launcher = start_launcher(tmp_path, ["--shutdown-grace-period", "300"])
    try:
        launcher.wait_healthy()
        children = descendants(launcher.proc.pid)
        with grpc.insecure_channel(launcher.grpc_target) as channel:
            wait_until(lambda: health_status(channel) == health_pb2.HealthCheckResponse.SERVING)
            with long_stream(channel, 600) as stream:
                launcher.proc.send_signal(signal.SIGTERM)
                # Kubernetes stops routing here: both health endpoints say so at once...
                wait_until(
                    lambda: health_status(channel) == health_pb2.HealthCheckResponse.NOT_SERVING
                )
                assert launcher.http_get("/health", timeout=5) == (
                    503,
                    b'{"error": "shutting down"}',
                )
                # ...a new request is refused, so a client retries another replica...
                with pytest.raises(grpc.RpcError) as refused:
                    generate_once(channel)
                assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
                assert refused.value.details() == "Server is shutting down"
                # ...all of it while the stream that started before the signal still runs.
                assert not stream.done.is_set(), "the stream ended before the checks"
            assert stream.error is None, stream.error
            assert (stream.tokens, stream.stop_reason) == (600, pb.MAX_TOKENS)
        assert launcher.proc.wait(30) == 0, launcher.log_tail()
        wait_until(lambda: not [p for p in children if is_alive(p)])
        assert not list(launcher.socket_dir.glob("shard-*")), "sockets left behind"
        log = launcher.log_tail(20000)
        assert "1 in flight given up to 300 s" in log
        assert "in-flight requests finished" in log
    finally:
        launcher.stop()


DRAIN_WORDS = "the quick brown fox jumps over a lazy dog while seven small birds sing"


def test_sigterm_with_64_streams_in_flight_finishes_each_as_it_would_alone(tmp_path: Path) -> None:
    """Issue 11 item 4: every stream in flight at SIGTERM completes within the grace period
    with the text it has when it runs alone, while new requests are refused."""
    tokens, streams_in_flight, grace = 120, 64, 60
    model = tmp_path / "model"
    save_tiny_llama(model)
    args = ["--model-name", str(model), "--max-sequence-length", "256"]
    args += ["--max-batch-size", str(streams_in_flight), "--shutdown-grace-period", str(grace)]
    launcher = start_launcher(tmp_path, args)
    rng = random.Random(11)
    words = DRAIN_WORDS.split()
    lengths = [1 + i % 30 for i in range(streams_in_flight)]  # words: up to ~60 tokens
    prompts = [" ".join(rng.choice(words) for _ in range(n)) for n in lengths]
    try:
        launcher.wait_healthy()
        children = descendants(launcher.proc.pid)
        with grpc.insecure_channel(launcher.grpc_target) as channel:
            stub = pb_grpc.GenerationServiceStub(channel)
            alone = [
                stub.Generate(
                    pb.BatchedGenerationRequest(
                        requests=[pb.GenerationRequest(text=prompt)], params=greedy(tokens)
                    ),
                    timeout=60,
                )
                .responses[0]
                .text
                for prompt in prompts
            ]
            started = [start_stream(channel, tokens, p, started_after=1) for p in prompts]
            for stream in started:
                assert stream.started.wait(60)
            signalled_at = time.monotonic()
            launcher.proc.send_signal(signal.SIGTERM)
            in_flight = sum(not stream.done.is_set() for stream in started)
            wait_until(lambda: health_status(channel) == health_pb2.HealthCheckResponse.NOT_SERVING)
            with pytest.raises(grpc.RpcError) as refused:
                generate_once(channel)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            for stream in started:
                stream.join(grace)
            drained_in = time.monotonic() - signalled_at
        assert in_flight == streams_in_flight, "streams ended before the signal"
        for stream, text in zip(started, alone, strict=True):
            assert stream.error is None, stream.error
            assert (stream.tokens, stream.stop_reason) == (tokens, pb.MAX_TOKENS)
            assert stream.text == text
        assert drained_in < grace
        assert launcher.proc.wait(30) == 0, launcher.log_tail()
        wait_until(lambda: not [p for p in children if is_alive(p)])
        log = launcher.log_tail(200000)
        assert f"{streams_in_flight} in flight given up to {grace} s" in log
        assert "in-flight requests finished" in log
        print(f"64 streams drained in {drained_in:.2f} s")
    finally:
        launcher.stop()


# ---- TLS certificate rotation -----------------------------------------------------------------


def tls_channel(target: str, ca: Pki) -> grpc.Channel:
    credentials = grpc.ssl_channel_credentials(ca.ca_cert.read_bytes())
    return grpc.secure_channel(target, credentials, options=NEW_CONNECTION)


def connects(target: str, ca: Pki) -> bool:
    with tls_channel(target, ca) as channel:
        try:
            return generate_once(channel).responses[0].generated_token_count == 2
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.UNAVAILABLE, err
            return False


def test_rotated_certificates_reach_new_connections_and_spare_streams(tmp_path: Path) -> None:
    one, two = make_pki(tmp_path / "ca1"), make_pki(tmp_path / "ca2")
    mount = SecretMount(tmp_path / "secret", server_files(one))
    cert, key = mount.path("tls.crt"), mount.path("tls.key")
    launcher = start_launcher(tmp_path, ["--tls-cert-path", str(cert), "--tls-key-path", str(key)])
    try:
        launcher.wait_healthy()
        target = launcher.grpc_target
        assert connects(target, one) and not connects(target, two)
        with tls_channel(target, one) as channel, long_stream(channel, 600) as stream:
            # kubelet's rotation of a Secret volume: a new ..data directory, swapped in.
            mount.update(server_files(two))
            assert connects(target, two)
            assert not connects(target, one)
            # Files rewritten in place (a hostPath, cert-manager's csi driver), the key
            # first: the mismatched pair in between is not served.
            key.resolve().write_bytes(one.server_key.read_bytes())
            assert connects(target, two)
            cert.resolve().write_bytes(one.server_cert.read_bytes())
            assert connects(target, one)
            assert not connects(target, two)
            assert not stream.done.is_set(), "the stream ended before the rotations"
        assert stream.error is None, stream.error
        assert (stream.tokens, stream.stop_reason) == (600, pb.MAX_TOKENS)
        log = launcher.log_tail(20000)
        assert log.count("TLS certificate reloaded") == 2
        assert "not usable yet" in log
    finally:
        assert launcher.stop() == 0


# ---- JSON logs and correlation ids ------------------------------------------------------------


def test_json_output_one_object_per_line_from_every_process(tmp_path: Path) -> None:
    launcher = start_launcher(tmp_path, ["--json-output"])
    try:
        launcher.wait_healthy()
        with grpc.insecure_channel(launcher.grpc_target) as channel:
            generate_once(channel, (("x-correlation-id", "e2e-corr-7"),))
            generate_once(channel)
            stream = pb_grpc.GenerationServiceStub(channel).GenerateStream(
                pb.SingleGenerationRequest(
                    request=pb.GenerationRequest(text="hi"), params=greedy(3)
                ),
                metadata=(("x-correlation-id", "e2e-stream-8"),),
                timeout=30,
            )
            assert list(stream)[-1].generated_token_count == 3
    finally:
        assert launcher.stop() == 0
    entries = []
    for line in launcher.log_path.read_text().splitlines():
        entry = json.loads(line)  # every line, whoever wrote it
        assert isinstance(entry, dict), line
        assert {"timestamp", "level", "target", "message"} <= set(entry), line
        entries.append(entry)
    sources = {e.get("source", "launcher") for e in entries}
    assert sources == {"launcher", "Shard 0", "Router"}
    # The children's own JSON (not lines the launcher had to wrap).
    assert any(e["target"].startswith("tgis.shard") for e in entries if e.get("source"))
    assert any(e["target"].startswith("tgis.router") for e in entries if e.get("source"))
    done = [e for e in entries if " generated " in str(e["message"])]
    assert [(e["message"].split(",")[0], e.get("correlation_id")) for e in done] == [
        ("Request generated 2 tokens before MAX_TOKENS", "e2e-corr-7"),
        ("Request generated 2 tokens before MAX_TOKENS", "<none>"),
        ("Streaming response generated 3 tokens before MAX_TOKENS", "e2e-stream-8"),
    ]
    assert all(e["source"] == "Router" for e in done)


# ---- OpenTelemetry ----------------------------------------------------------------------------


HTTP_TRACE_ID = "0af7651916cd43dd8448eb211c80319c"


def test_otlp_spans_of_one_generate_call(tmp_path: Path) -> None:
    trace_id, parent_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    with OtlpCollector() as collector:
        launcher = start_launcher(
            tmp_path,
            env={
                "OTLP_ENDPOINT": collector.endpoint,
                "OTLP_SERVICE_NAME": "tgis-e2e",
                "OTEL_BSP_SCHEDULE_DELAY": "100",
            },
        )
        try:
            launcher.wait_healthy()
            with grpc.insecure_channel(launcher.grpc_target) as channel:
                generate_once(
                    channel,
                    (
                        ("traceparent", f"00-{trace_id}-{parent_id}-01"),
                        ("x-correlation-id", "traced-e2e"),
                    ),
                )
                with pytest.raises(grpc.RpcError):  # fails validation
                    pb_grpc.GenerationServiceStub(channel).Generate(
                        pb.BatchedGenerationRequest(
                            requests=[pb.GenerationRequest(text="hi")], params=greedy(5000)
                        ),
                        timeout=30,
                    )
            model = json.loads(launcher.http_get("/v1/models")[1])["data"][0]["id"]
            completion = urllib.request.Request(
                f"http://127.0.0.1:{launcher.http_port}/v1/completions",
                data=json.dumps(
                    {"model": model, "prompt": "hi", "max_tokens": 2, "min_tokens": 2}
                ).encode(),
                headers={
                    "Content-Type": "application/json",
                    "traceparent": f"00-{HTTP_TRACE_ID}-{parent_id}-01",
                    "x-correlation-id": "traced-openai",
                },
            )
            with urllib.request.urlopen(completion, timeout=30) as reply:
                assert json.loads(reply.read())["usage"]["completion_tokens"] == 2
            collector.wait_for(2, "inference")
            collector.wait_for(2, "fmaas.GenerationService/Generate")
            collector.wait_for(1, "POST /v1/completions")
        finally:
            assert launcher.stop() == 0
        spans = list(collector.spans)
    root, invalid = sorted(
        (s for s in spans if s.name == "fmaas.GenerationService/Generate"),
        key=lambda s: s.start_ns,
    )
    assert (root.trace_id, root.parent_span_id) == (trace_id, parent_id)
    assert root.status_code == 0  # unset: it went well
    assert invalid.status_code == 2  # error, with the status the client got
    assert invalid.status_message == "INVALID_ARGUMENT: max_new_tokens must be <= 1023"
    assert [s.name for s in spans if s.parent_span_id == invalid.span_id] == ["validation"]
    assert root.attributes["correlation_id"] == "traced-e2e"
    assert root.service_name == "tgis-e2e"
    children = {s.name: s for s in spans if s.parent_span_id == root.span_id}
    assert set(children) == {"validation", "queue", "inference"}
    validation, queue, inference = (children[n] for n in ("validation", "queue", "inference"))
    assert root.start_ns == validation.start_ns <= validation.end_ns <= queue.start_ns
    assert queue.end_ns <= inference.start_ns <= inference.end_ns <= root.end_ns
    assert inference.attributes["generated_tokens"] == 2
    assert inference.attributes["stop_reason"] == "MAX_TOKENS"
    # An OpenAI request's span: the same parts, under the HTTP client's trace.
    (http_root,) = (s for s in spans if s.name == "POST /v1/completions")
    assert (http_root.trace_id, http_root.parent_span_id) == (HTTP_TRACE_ID, parent_id)
    assert http_root.attributes == {
        "http.request.method": "POST",
        "http.route": "/v1/completions",
        "correlation_id": "traced-openai",
    }
    http_children = {s.name for s in spans if s.parent_span_id == http_root.span_id}
    assert http_children == {"validation", "queue", "inference"}


# ---- fatal errors -----------------------------------------------------------------------------


def termination_lines(launcher: LauncherProcess, path: Path) -> list[str]:
    assert launcher.proc.wait(60) == 1, launcher.log_tail()
    return path.read_text().splitlines()


def test_a_router_fatal_error_reaches_the_termination_log(tmp_path: Path) -> None:
    log = tmp_path / "termination-log"
    port = free_port()
    with socket.create_server(("0.0.0.0", port)):  # the HTTP port is taken
        launcher = start_launcher(
            tmp_path, ["--port", str(port)], env={"TGIS_TERMINATION_LOG": str(log)}
        )
        try:
            router, launcher_reason = termination_lines(launcher, log)
        finally:
            launcher.stop()
    assert router.startswith("OSError: ") and str(port) in router, router
    assert "address already in use" in router
    assert launcher_reason == "Router exited unexpectedly: exit status: 1"


def test_a_shard_fatal_error_reaches_the_termination_log(tmp_path: Path) -> None:
    log = tmp_path / "termination-log"
    launcher = start_launcher(
        tmp_path, ["--quantize", "gptq"], env={"TGIS_TERMINATION_LOG": str(log)}
    )
    try:
        shard, launcher_reason = termination_lines(launcher, log)
    finally:
        launcher.stop()
    assert shard == (
        "--quantize gptq needs a gptq checkpoint, and this one is dense (no "
        "quantization_config in config.json, no quantize_config.json); int8 and fp8 "
        "quantize a dense checkpoint at load"
    )
    assert launcher_reason == "Shard 0 failed: exit status: 1"
