"""The OpenAI routes under the operations conventions, with the real launcher and the real
``openai`` client: the HTTP port served over TLS (``--http-tls``), requests' own
``x-correlation-id`` on their log lines, and the drain on SIGTERM (a stream that started
before the signal runs to its end, a new request gets 503 in OpenAI's shape)."""

from __future__ import annotations

import json
import signal
import ssl
import urllib.request
from pathlib import Path

import openai
import pytest

from tests.e2e.certs import make_pki
from tests.e2e.probes import wait_until
from tests.e2e.server import start_launcher
from tests.e2e.streams import OpenAIStream

pytestmark = pytest.mark.slow

TOKENS = 1000  # long enough to outlast the checks made while it runs


def test_https_correlation_ids_and_the_drain(tmp_path: Path) -> None:
    pki = make_pki(tmp_path / "pki")
    tls = ["--tls-cert-path", str(pki.server_cert), "--tls-key-path", str(pki.server_key)]
    launcher = start_launcher(
        # A grace period far beyond the stream's length, even on a busy machine: the stream
        # must run to its end (one the grace period cuts: test_shutdown_e2e.py).
        tmp_path,
        [*tls, "--http-tls", "--json-output", "--shutdown-grace-period", "300"],
    )
    launcher.http_ca = pki.ca_cert
    try:
        launcher.wait_healthy()
        # The HTTP port speaks TLS only: a plain request gets no HTTP answer.
        with pytest.raises(OSError):
            urllib.request.urlopen(f"http://127.0.0.1:{launcher.http_port}/health", timeout=5)
        client = openai.OpenAI(
            base_url=launcher.http_base + "/v1",
            api_key="unused",
            http_client=openai.DefaultHttpxClient(
                verify=ssl.create_default_context(cafile=pki.ca_cert)
            ),
            max_retries=0,
            timeout=60,
        )
        model = client.models.list().data[0].id
        done = client.completions.create(
            model=model, prompt="Once upon a time", max_tokens=3, temperature=0,
            extra_headers={"x-correlation-id": "openai-corr-5"},
        )  # fmt: skip
        assert done.usage is not None and done.usage.completion_tokens <= 3
        # A streamed completion of exactly TOKENS tokens, consumed by its own thread.
        stream = OpenAIStream(
            client,
            model=model, prompt="Once upon a time", max_tokens=TOKENS, temperature=0,
            stream_options={"include_usage": True}, extra_body={"min_tokens": TOKENS},
            extra_headers={"x-correlation-id": "openai-stream-6"},
        )  # fmt: skip
        stream.start()
        assert stream.started.wait(60) and stream.error is None, stream.error
        launcher.proc.send_signal(signal.SIGTERM)
        wait_until(lambda: launcher.http_get("/health", timeout=5)[0] == 503)
        with pytest.raises(openai.InternalServerError) as refused:
            client.completions.create(model=model, prompt="x", max_tokens=2)
        assert refused.value.status_code == 503
        assert refused.value.body == {
            "message": "Server is shutting down",
            "type": "service_unavailable",
            "param": None,
            "code": None,
        }
        assert stream.is_alive(), "the stream ended before the checks"
        stream.join(120)
        assert stream.error is None, stream.error
        assert stream.usage is not None and stream.usage.completion_tokens == TOKENS
        assert launcher.proc.wait(30) == 0, launcher.log_tail()
    finally:
        launcher.stop()
    entries = [json.loads(line) for line in launcher.log_path.read_text().splitlines()]
    done_lines = {
        e.get("correlation_id"): e["message"] for e in entries if " generated " in str(e["message"])
    }
    assert done_lines["openai-corr-5"].startswith("Request generated")
    assert done_lines["openai-stream-6"].startswith(f"Streaming response generated {TOKENS}")
