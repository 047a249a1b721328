"""/metrics against the real tools: `promtool check metrics`, then a real Prometheus server
scraping the launched server and answering PromQL the way the OpenShift AI dashboards ask
(plain counter names, spec ecosystem §0.5 and §1.6).

The promtool and Prometheus tests need Debian's `prometheus` package (`make
prometheus-tools`): skipped without it on a developer machine, failed under CI=true (which
`.ci/run` sets); the exposition's values are checked without any tool.
"""

from __future__ import annotations

import json
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from tests.e2e.server import LauncherProcess, free_port, start_launcher
from tests.prometheus_tools import Exposition, parse_exposition, promtool_check, require_tool
from tgis.pb import generation_pb2 as pb
from tgis.pb import generation_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow

PROMPT = "Return the number of"


def greedy(max_new_tokens: int, min_new_tokens: int = 0) -> pb.Parameters:
    return pb.Parameters(
        method=pb.GREEDY,
        stopping=pb.StoppingCriteria(max_new_tokens=max_new_tokens, min_new_tokens=min_new_tokens),
    )


def scrape(server: LauncherProcess) -> tuple[bytes, Exposition]:
    status, body = server.http_get("/metrics")
    assert status == 200
    return body, parse_exposition(body.decode())


def send_traffic(server: LauncherProcess) -> None:
    """Successes of every kind, a validation error, a Tokenize call and a cancelled stream."""
    with grpc.insecure_channel(server.grpc_target) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        single = stub.Generate(
            pb.BatchedGenerationRequest(
                requests=[pb.GenerationRequest(text=PROMPT)], params=greedy(4, 4)
            ),
            timeout=60,
        )
        assert single.responses[0].stop_reason == pb.MAX_TOKENS
        batch = stub.Generate(
            pb.BatchedGenerationRequest(
                requests=[pb.GenerationRequest(text=PROMPT), pb.GenerationRequest(text="The")],
                params=greedy(3, 3),
            ),
            timeout=60,
        )
        assert [r.stop_reason for r in batch.responses] == [pb.MAX_TOKENS] * 2
        messages = list(
            stub.GenerateStream(
                pb.SingleGenerationRequest(
                    request=pb.GenerationRequest(text=PROMPT), params=greedy(3, 3)
                ),
                timeout=60,
            )
        )
        assert messages[-1].stop_reason == pb.MAX_TOKENS
        with pytest.raises(grpc.RpcError) as excinfo:
            stub.Generate(
                pb.BatchedGenerationRequest(
                    requests=[pb.GenerationRequest(text="x")], params=greedy(100_000)
                ),
                timeout=30,
            )
        assert excinfo.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        stub.Tokenize(
            pb.BatchedTokenizeRequest(
                requests=[pb.TokenizeRequest(text="Hello world"), pb.TokenizeRequest(text="é")]
            ),
            timeout=30,
        )
        call = stub.GenerateStream(
            pb.SingleGenerationRequest(
                request=pb.GenerationRequest(text=PROMPT), params=greedy(400, 400)
            ),
            timeout=120,
        )
        assert [next(call) for _ in range(3)][-1].generated_token_count >= 1
        call.cancel()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        _, exp = scrape(server)
        if exp.value("tgi_request_failure", err="cancelled") >= 1:
            return
        time.sleep(0.1)
    raise AssertionError("the cancelled stream was never counted")


def wait_until_settled(server: LauncherProcess, timeout: float = 30.0) -> None:
    """Until every step the engine started has been answered: after a cancellation the
    step planned on top of it may still be running (more so on a busy machine), and the
    step counters are read at one moment."""
    deadline = time.monotonic() + timeout
    while True:
        _, exp = scrape(server)
        started = sum(s.value for s in exp.of("tgi_batch_inference_count_total"))
        answered = sum(
            s.value
            for name in ("tgi_batch_inference_success_total", "tgi_batch_inference_failure_total")
            for s in exp.of(name)
        )
        if started == answered:
            return
        assert time.monotonic() < deadline, f"{started} steps started, {answered} answered"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LauncherProcess]:
    launcher = start_launcher(tmp_path_factory.mktemp("prometheus-e2e"))
    try:
        launcher.wait_healthy()
        send_traffic(launcher)
        wait_until_settled(launcher)
        yield launcher
    finally:
        launcher.stop()


# Every counter TGIS's dashboards and our traffic touch: (name, labels) -> value.
EXPECTED = {
    ("tgi_request_count", (("kind", "single"),)): 2.0,
    ("tgi_request_count", (("kind", "batch"),)): 1.0,
    ("tgi_request_count", (("kind", "stream"),)): 2.0,
    ("tgi_request_input_count", ()): 6.0,
    ("tgi_request_success", (("kind", "single"), ("stop_reason", "MAX_TOKENS"))): 1.0,
    ("tgi_request_success", (("kind", "batch"), ("stop_reason", "MAX_TOKENS"))): 2.0,
    ("tgi_request_success", (("kind", "stream"), ("stop_reason", "MAX_TOKENS"))): 1.0,
    ("tgi_request_failure", (("err", "validation"),)): 1.0,
    ("tgi_request_failure", (("err", "cancelled"),)): 1.0,
    ("tgi_request_failure", (("err", "generate"),)): 0.0,
    ("tgi_tokenize_request_count", ()): 1.0,
    ("tgi_tokenize_request_input_count", ()): 2.0,
}


def test_exposition_passes_promtool(server: LauncherProcess) -> None:
    body, _ = scrape(server)
    promtool_check(body)


def test_exposition_values(server: LauncherProcess) -> None:
    """Needs no tool: runs (and fails on a wrong value) wherever promtool is missing."""
    _, exp = scrape(server)
    for (name, labels), value in EXPECTED.items():
        assert exp.value(name, **dict(labels)) == value, (name, labels)
        assert exp.value(f"{name}_total", **dict(labels)) == value, (name, labels)
        assert exp.types[name] == "untyped" and exp.types[f"{name}_total"] == "counter"
    assert exp.value("tgi_request_duration_count") == 4  # one per successful input
    assert exp.value("tgi_request_inference_duration_count") == 4
    assert exp.value("tgi_request_generated_tokens_sum") == 4 + 3 + 3 + 3
    assert exp.value("tgi_request_validation_duration_count") == 4  # the 4 valid RPCs
    assert exp.value("tgi_request_raw_input_length_count") == 5  # not the rejected "x"
    assert exp.value("tgi_request_input_length_count") == 5
    assert exp.value("tgi_request_max_new_tokens_sum") == 4 + 3 + 3 + 3 + 400
    assert exp.value("tgi_tokenize_request_duration_count") == 1
    steps = sum(s.value for s in exp.of("tgi_batch_inference_count_total"))
    assert steps > 0
    assert steps == sum(s.value for s in exp.of("tgi_batch_inference_success_total"))
    assert sum(s.value for s in exp.of("tgi_batch_inference_duration_count")) == steps


# ---- a real Prometheus server ---------------------------------------------------------------


class PrometheusServer:
    def __init__(self, tmp: Path, target: str) -> None:
        self.port = free_port()
        config = tmp / "prometheus.yml"
        config.write_text(
            "global:\n"
            "  scrape_interval: 1s\n"
            "  evaluation_interval: 1s\n"
            "scrape_configs:\n"
            "  - job_name: tgis\n"
            "    scrape_interval: 1s\n"
            "    scrape_timeout: 1s\n"
            "    metrics_path: /metrics\n"
            "    static_configs:\n"
            f"      - targets: ['{target}']\n"
        )
        self.log_path = tmp / "prometheus.log"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [
                    require_tool("prometheus"),
                    f"--config.file={config}",
                    f"--storage.tsdb.path={tmp / 'tsdb'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                    "--log.level=warn",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def get(self, path: str) -> Any:
        url = f"http://127.0.0.1:{self.port}{path}"
        with urllib.request.urlopen(url, timeout=10) as resp:
            return json.loads(resp.read()) if path.startswith("/api/") else resp.status

    def query(self, promql: str) -> list[dict[str, Any]]:
        answer = self.get("/api/v1/query?" + urllib.parse.urlencode({"query": promql}))
        assert answer["status"] == "success", answer
        return list(answer["data"]["result"])

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited:\n{self.log_tail()}")
            try:
                if self.get("/-/ready") == 200:
                    return
            except OSError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"prometheus not ready:\n{self.log_tail()}")

    def wait_for(self, promql: str, timeout: float = 30.0) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            result = self.query(promql)
            if result:
                return result
            time.sleep(0.5)
        raise TimeoutError(f"no result for {promql}:\n{self.log_tail()}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def prometheus(
    server: LauncherProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[PrometheusServer]:
    prom = PrometheusServer(tmp_path_factory.mktemp("prometheus"), f"127.0.0.1:{server.http_port}")
    try:
        prom.wait_ready()
        yield prom
    finally:
        prom.stop()


def by_labels(result: list[dict[str, Any]]) -> dict[tuple[tuple[str, str], ...], float]:
    """Series of one metric keyed by their labels (without __name__, job, instance)."""
    skip = {"__name__", "job", "instance"}
    return {
        tuple(sorted((k, v) for k, v in r["metric"].items() if k not in skip)): float(r["value"][1])
        for r in result
    }


def test_prometheus_scrapes_and_answers_plain_counter_names(
    server: LauncherProcess, prometheus: PrometheusServer
) -> None:
    result = prometheus.wait_for("tgi_request_success")
    (up,) = prometheus.wait_for('up{job="tgis"}')
    assert up["value"][1] == "1"
    targets = prometheus.get("/api/v1/targets")["data"]["activeTargets"]
    assert [(t["health"], t["lastError"]) for t in targets] == [("up", "")]

    instance = f"127.0.0.1:{server.http_port}"
    assert {r["metric"]["__name__"] for r in result} == {"tgi_request_success"}
    assert {(r["metric"]["job"], r["metric"]["instance"]) for r in result} == {("tgis", instance)}
    success = by_labels(result)
    assert len(success) == 15  # every stop_reason x kind
    for (name, labels), value in EXPECTED.items():
        if name == "tgi_request_success":
            assert success[labels] == value, labels
    assert set(success) == set(by_labels(prometheus.query("tgi_request_success_total")))
    assert by_labels(prometheus.query("tgi_request_success_total")) == success

    for (name, labels), value in EXPECTED.items():
        selector = ",".join(f'{k}="{v}"' for k, v in labels)
        for exported in (name, f"{name}_total"):
            (series,) = prometheus.query(f"{exported}{{{selector}}}")
            assert float(series["value"][1]) == value, (exported, labels)

    # The OpenShift AI TGIS dashboard's queries (ecosystem §1.6).
    (total,) = prometheus.query("sum(tgi_request_success)")
    assert float(total["value"][1]) == 4
    (failures,) = prometheus.query("sum(tgi_request_failure)")
    assert float(failures["value"][1]) == 2
    for name in ("tgi_request_duration", "tgi_request_inference_duration"):
        (count,) = prometheus.query(f"{name}_count")
        assert float(count["value"][1]) == 4
        (mean,) = prometheus.query(f"{name}_sum / {name}_count")
        assert float(mean["value"][1]) > 0

    # increase() on the plain (untyped) name sees a new success, as on the dashboard.
    prometheus.wait_for('count_over_time(up{job="tgis"}[1m]) >= 2')
    with grpc.insecure_channel(server.grpc_target) as channel:
        pb_grpc.GenerationServiceStub(channel).Generate(
            pb.BatchedGenerationRequest(
                requests=[pb.GenerationRequest(text=PROMPT)], params=greedy(2, 2)
            ),
            timeout=60,
        )
    selector = '{kind="single",stop_reason="MAX_TOKENS"}'
    for name in ("tgi_request_success", "tgi_request_success_total"):
        (increase,) = prometheus.wait_for(f"increase({name}{selector}[1m]) > 0")
        assert float(increase["value"][1]) > 0
