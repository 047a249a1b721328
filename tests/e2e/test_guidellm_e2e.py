"""guidellm (the benchmark Red Hat ships for its inference server) run as its users run it,
``guidellm run`` with a scenario file, against the shared embedded server: synthetic prompts,
a fixed concurrency, a few dozen requests, on ``/v1/completions`` and on
``/v1/chat/completions``. Its JSON report is read back: every request succeeded and there
were as many as asked; each request's output is gRPC's greedy Generate of the same prompt
(the chat's as transformers renders it) with EOS ignored, as guidellm's ``ignore_eos`` asks;
its output tokens are that many, and their sum is what the server's
``tgi_request_generated_tokens`` counted; its prompt tokens are gRPC's Tokenize count.

guidellm lives in a venv of its own, ``.venv-guidellm`` (``make guidellm``, which ``make
test`` runs): without it this module skips, or fails under CI=true.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from transformers import AutoTokenizer

from tests.e2e.probes import wait_until
from tests.e2e.server import LauncherProcess
from tests.prometheus_tools import Exposition, parse_exposition
from tgis.embedded_model import MODEL_DIR
from tgis.pb import generation_pb2 as pb
from tgis.pb import generation_pb2_grpc as pb_grpc

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        bool(os.environ.get("TGIS_E2E_MODEL")), reason="guidellm tokenizes with the embedded model"
    ),
]

ROOT = Path(__file__).resolve().parents[2]
GUIDELLM = ROOT / ".venv-guidellm" / "bin" / "guidellm"
REQUESTS = 16
STREAMS = 4
PROMPT_TOKENS = 16
OUTPUT_TOKENS = 8


def guidellm() -> Path:
    if GUIDELLM.exists():
        return GUIDELLM
    message = f"{GUIDELLM.relative_to(ROOT)} not found: `make guidellm` installs it"
    if os.environ.get("CI") == "true":
        pytest.fail(message)
    pytest.skip(message)


def scenario(server: LauncherProcess, request_format: str, report: Path) -> dict[str, Any]:
    """guidellm's scenario file: its OpenAI backend on the server (greedy, so the outputs
    can be compared), a fixed concurrency, synthetic prompts tokenized by the model's own
    tokenizer, a JSON report."""
    backend = {
        "kind": "openai_http",
        "target": server.http_base,
        "request_format": request_format,
        "extras": {"body": {"temperature": 0}},
    }
    data = {
        "kind": "synthetic_text",
        "prompt_tokens": PROMPT_TOKENS,
        "output_tokens": OUTPUT_TOKENS,
    }
    return {
        "spec": {
            "backend": backend,
            "profile": {"kind": "concurrent", "streams": [STREAMS]},
            "constraints": [{"kind": "max_requests", "count": REQUESTS}],
            "tokenizer": {"kind": "hf_auto", "model": str(MODEL_DIR)},
            "data": [data],
            "outputs": [{"kind": "json", "path": str(report)}],
        }
    }


def start_guidellm(
    server: LauncherProcess, request_format: str, work: Path
) -> subprocess.Popen[bytes]:
    config = work / "scenario.json"
    config.write_text(json.dumps(scenario(server, request_format, work / "report.json")))
    # Offline: the tokenizer is a local directory. One worker process is enough for four
    # streams; guidellm reads a .env of the working directory, so it runs in its own.
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "GUIDELLM__MAX_WORKER_PROCESSES": "1"}
    with open(work / "output.txt", "wb") as output:
        return subprocess.Popen(
            [str(guidellm()), "run", "--scenario", str(config), "--disable-console"],
            cwd=work,
            env=env,
            stdout=output,
            stderr=subprocess.STDOUT,
        )


def report_of(process: subprocess.Popen[bytes], work: Path) -> dict[str, Any]:
    """The benchmark's only result in guidellm's JSON report."""
    code = process.wait(timeout=300)
    assert code == 0, (work / "output.txt").read_text(errors="replace")[-4000:]
    (benchmark,) = json.loads((work / "report.json").read_text())["benchmarks"]
    return benchmark


def idle(server: LauncherProcess) -> bool:
    exposition = scrape(server)
    return exposition.value("tgi_batch_current_size") == exposition.value("tgi_queue_size") == 0


def scrape(server: LauncherProcess) -> Exposition:
    status, body = server.http_get("/metrics")
    assert status == 200
    return parse_exposition(body.decode())


SUCCESS = {"kind": "stream", "stop_reason": "MAX_TOKENS"}


def settled_after(server: LauncherProcess, before: Exposition, requests: int) -> Exposition:
    """The metrics once ``requests`` more streams have been counted as done (a stream's
    last bytes may reach the client just before its metrics are recorded)."""
    want = before.value("tgi_request_success", **SUCCESS) + requests
    deadline = time.monotonic() + 10
    while True:
        after = scrape(server)
        if after.value("tgi_request_success", **SUCCESS) >= want or time.monotonic() > deadline:
            return after
        time.sleep(0.1)


def prompt_of(body: dict[str, Any], tokenizer: Any) -> str:
    """The text gRPC is given for a request guidellm sent: a completion's prompt, or the
    chat rendered as transformers renders it (text parts joined as the server joins them),
    less the BOS the template writes (gRPC adds its own)."""
    if "prompt" in body:
        return str(body["prompt"])
    messages = [
        {**m, "content": "\n".join(part["text"] for part in m["content"])}
        if isinstance(m["content"], list)
        else m
        for m in body["messages"]
    ]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered.startswith(tokenizer.bos_token)
    return str(rendered.removeprefix(tokenizer.bos_token))


def grpc_oracle(server: LauncherProcess, prompts: list[str]) -> tuple[list[Any], list[int]]:
    """Greedy Generate with EOS masked for exactly OUTPUT_TOKENS tokens (``ignore_eos``),
    and Tokenize's counts, for each prompt."""
    stopping = pb.StoppingCriteria(max_new_tokens=OUTPUT_TOKENS, min_new_tokens=OUTPUT_TOKENS)
    with grpc.insecure_channel(server.grpc_target) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        generated = stub.Generate(
            pb.BatchedGenerationRequest(
                requests=[pb.GenerationRequest(text=p) for p in prompts],
                params=pb.Parameters(method=pb.GREEDY, stopping=stopping),
            ),
            timeout=60,
        ).responses
        tokenized = stub.Tokenize(
            pb.BatchedTokenizeRequest(requests=[pb.TokenizeRequest(text=p) for p in prompts]),
            timeout=60,
        ).responses
    return list(generated), [t.token_count for t in tokenized]


FORMATS = ("/v1/completions", "/v1/chat/completions")


@dataclass(frozen=True)
class Runs:
    reports: dict[str, dict[str, Any]]  # by request format: its benchmark
    before: Exposition  # the server's metrics before the runs
    after: Exposition  # and after


@pytest.fixture(scope="module")
def runs(embedded_server: LauncherProcess, tmp_path_factory: pytest.TempPathFactory) -> Runs:
    """Both formats' runs, side by side: most of a run is guidellm's own start-up (imports,
    a spawned worker, its start delay), little of it the server's work."""
    wait_until(lambda: idle(embedded_server))  # the server is shared: nothing else running
    before = scrape(embedded_server)
    works = {f: tmp_path_factory.mktemp("guidellm") for f in FORMATS}
    processes = {f: start_guidellm(embedded_server, f, works[f]) for f in FORMATS}
    try:
        reports = {f: report_of(processes[f], works[f]) for f in FORMATS}
    finally:
        for process in processes.values():
            process.kill()  # a no-op for one that ended
    after = settled_after(embedded_server, before, REQUESTS * len(FORMATS))
    return Runs(reports, before, after)


@pytest.mark.parametrize("request_format", FORMATS)
def test_every_request_succeeded_and_equals_grpc(
    runs: Runs, embedded_server: LauncherProcess, request_format: str
) -> None:
    benchmark = runs.reports[request_format]
    requests = benchmark["requests"]
    assert (len(requests["errored"]), len(requests["incomplete"])) == (0, 0)
    successful = requests["successful"]
    assert len(successful) == REQUESTS
    assert benchmark["metrics"]["request_totals"] == {
        "successful": REQUESTS,
        "errored": 0,
        "incomplete": 0,
        "total": REQUESTS,
    }
    # What guidellm sent: streams, greedy, EOS ignored, OUTPUT_TOKENS at most.
    bodies = [json.loads(r["request_args"])["body"] for r in successful]
    for body in bodies:
        assert body["stream"] and body["ignore_eos"] and body["temperature"] == 0
        assert body.get("max_tokens", body.get("max_completion_tokens")) == OUTPUT_TOKENS
    tokenizer = AutoTokenizer.from_pretrained(MODEL_DIR)
    prompts = [prompt_of(body, tokenizer) for body in bodies]
    want, prompt_tokens = grpc_oracle(embedded_server, prompts)
    assert [r["output"] for r in successful] == [w.text for w in want]
    assert [r["output_tokens"] for r in successful] == [OUTPUT_TOKENS] * REQUESTS
    assert [w.generated_token_count for w in want] == [OUTPUT_TOKENS] * REQUESTS
    assert [r["prompt_tokens"] for r in successful] == prompt_tokens
    assert [w.input_token_count for w in want] == prompt_tokens


def test_the_server_counted_what_guidellm_reports(runs: Runs) -> None:
    successful = [r for b in runs.reports.values() for r in b["requests"]["successful"]]

    def grew(name: str, **labels: str) -> float:
        return runs.after.value(name, **labels) - runs.before.value(name, **labels)

    assert grew("tgi_request_success", **SUCCESS) == len(successful) == REQUESTS * len(FORMATS)
    assert grew("tgi_request_generated_tokens_count") == len(successful)
    assert grew("tgi_request_generated_tokens_sum") == sum(r["output_tokens"] for r in successful)
    assert grew("tgi_request_input_length_sum") == sum(r["prompt_tokens"] for r in successful)
