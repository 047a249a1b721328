"""The inference gateway's model-server protocol (Gateway API Inference Extension, proposal
003) on a real launcher under load: the gauges its endpoint picker reads
(deployment/gateway/ names them) move as the protocol says.

A tiny Llama with two LoRA adapters, `--max-batch-size 2 --max-loras 1`: two `sql-lora`
streams fill the batch and two `team/tone` streams wait (one adapter per step); when the
sql-lora ones end, the team/tone ones run, and a plain stream waits for a free place in the
batch. The streams are long and are cancelled by the test, so each state lasts until the
test has read it. The oracle is the test's own bookkeeping of which streams it started
and cancelled.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest

from tests.e2e.models import save_tiny_llama
from tests.e2e.probes import greedy
from tests.e2e.server import LauncherProcess, healthy_launcher
from tests.e2e.streams import CallThread, stream_request
from tests.lora_oracle import save_random_lora
from tests.prometheus_tools import Exposition, parse_exposition, promtool_check
from tgis.pb import generation_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow

# Far more tokens than the test waits for: every stream is cancelled by the test.
SEQUENCE_LENGTH = 4096
STREAM_TOKENS = 4000
LORA = "tgi_lora_requests_info"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LauncherProcess]:
    model = tmp_path_factory.mktemp("gateway-llama")
    save_tiny_llama(model)
    config = json.loads((model / "config.json").read_text())
    config["max_position_embeddings"] = SEQUENCE_LENGTH  # plain RoPE: any length works
    (model / "config.json").write_text(json.dumps(config))
    cache = tmp_path_factory.mktemp("gateway-adapters")
    save_random_lora(model, cache / "sql-lora", seed=1, r=4, alpha=8)
    save_random_lora(model, cache / "team" / "tone", seed=2, r=4, alpha=8)
    flags = [
        "--model-name", str(model),
        "--max-sequence-length", str(SEQUENCE_LENGTH),
        "--max-batch-size", "2",
        "--max-loras", "1",
        "--max-new-tokens", str(STREAM_TOKENS),
    ]  # fmt: skip
    with healthy_launcher(
        tmp_path_factory.mktemp("gateway-e2e"), flags, env={"ADAPTER_CACHE": str(cache)}
    ) as launcher:
        yield launcher


class HeldStream(CallThread):
    """A long greedy GenerateStream that runs until ``release``, then is cancelled."""

    def __init__(self, stub: pb_grpc.GenerationServiceStub, adapter_id: str) -> None:
        super().__init__(started_after=1)
        self.stub = stub
        self.request = stream_request("Return the number of", greedy(STREAM_TOKENS))
        self.request.adapter_id = adapter_id
        self.released = threading.Event()
        self.tokens = 0

    def consume(self) -> None:
        call = self.stub.GenerateStream(self.request, timeout=120)
        try:
            for message in call:
                self.tokens = message.generated_token_count
                self.progressed(self.tokens)
                if self.released.is_set():
                    call.cancel()
                    return
        except grpc.RpcError as err:
            if err.code() != grpc.StatusCode.CANCELLED or not self.released.is_set():
                raise


def release(streams: list[HeldStream]) -> None:
    """Cancel running streams, each at its next token (all at once), and wait for their end."""
    for stream in streams:
        stream.released.set()
    for stream in streams:
        assert stream.done.wait(60), "the stream did not end"
        assert stream.error is None, stream.error
        assert stream.tokens < STREAM_TOKENS, "it ended by itself before the test released it"


def scrape(server: LauncherProcess) -> tuple[bytes, Exposition]:
    status, body = server.http_get("/metrics")
    assert status == 200
    return body, parse_exposition(body.decode())


def gauges(exp: Exposition) -> dict[str, Any]:
    (lora,) = exp.of(LORA)
    return {
        "queued": exp.value("tgi_queue_size"),
        "running": exp.value("tgi_batch_current_size"),
        "kv": exp.value("tgi_kv_cache_usage_ratio"),
        "lora": lora.labels,
        "stamp": lora.value,
    }


def wait_for(
    server: LauncherProcess, condition: Callable[[dict[str, Any]], bool]
) -> tuple[bytes, dict[str, Any]]:
    """Scrape until the gauges meet ``condition`` (within 60 s), then once more a few steps
    later (the queue gauge moves on arrival, the others before each step): that scrape,
    which must still meet it (the held streams keep the state)."""
    deadline = time.monotonic() + 60
    while True:
        _, exp = scrape(server)
        if condition(gauges(exp)):
            break
        assert time.monotonic() < deadline, f"never met; last seen {gauges(exp)}"
        time.sleep(0.02)
    time.sleep(0.2)
    body, exp = scrape(server)
    seen = gauges(exp)
    assert condition(seen), seen
    return body, seen


def lora(max_lora: str, running: str, waiting: str) -> dict[str, str]:
    return {
        "max_lora": max_lora,
        "running_lora_adapters": running,
        "waiting_lora_adapters": waiting,
    }


def test_protocol_gauges_follow_the_load(
    server: LauncherProcess, stub: pb_grpc.GenerationServiceStub
) -> None:
    _, idle = wait_for(server, lambda g: g["running"] == 0)
    assert idle == {**idle, "queued": 0, "kv": 0, "lora": lora("1", "", "")}
    _, exp = scrape(server)
    (config,) = exp.of("tgi_cache_config_info")
    assert config.value == 1
    assert int(config.labels["num_gpu_blocks"]) == exp.value("tgi_kv_cache_total_blocks")
    assert int(config.labels["block_size"]) > 0

    sql = [HeldStream(stub, "sql-lora") for _ in range(2)]
    for stream in sql:
        stream.start()
    for stream in sql:
        assert stream.started.wait(60) and stream.error is None, stream.error
    tone = [HeldStream(stub, "team/tone") for _ in range(2)]
    for stream in tone:
        stream.start()

    # The batch is full of sql-lora (max_loras 1): the team/tone requests wait.
    body, full = wait_for(server, lambda g: g["queued"] == 2)
    assert full["running"] == 2
    assert 0 < full["kv"] < 1
    assert full["lora"] == lora("1", "sql-lora", "team/tone")
    assert full["stamp"] >= idle["stamp"]
    promtool_check(body)
    assert not any(s.done.is_set() for s in [*sql, *tone])

    # Both sql-lora streams end (the first alone frees no LoRA slot): the team/tone ones run.
    release(sql)
    _, turned = wait_for(server, lambda g: g["lora"]["running_lora_adapters"] == "team/tone")
    assert (turned["queued"], turned["running"]) == (0, 2)
    assert turned["lora"] == lora("1", "team/tone", "")
    assert turned["kv"] > 0

    # A plain request waits only for a free place in the batch, and joins when one ends.
    plain = HeldStream(stub, "")
    plain.start()
    _, waiting = wait_for(server, lambda g: g["queued"] == 1)
    assert waiting["running"] == 2 and waiting["lora"] == lora("1", "team/tone", "")
    release(tone[:1])
    _, mixed = wait_for(server, lambda g: g["queued"] == 0)
    assert mixed["running"] == 2 and mixed["lora"] == lora("1", "team/tone", "")

    release([tone[1], plain])
    _, after = wait_for(server, lambda g: g["running"] == 0)
    assert after == {**after, "queued": 0, "kv": 0, "lora": lora("1", "", "")}
