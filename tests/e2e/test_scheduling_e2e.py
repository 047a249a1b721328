"""Scheduling under KV pressure, end to end: the real launcher with a KV cache far too small
for the load, so running sequences are preempted and resumed all the time.

64 concurrent streams of mixed prompt and output lengths; a third are cancelled mid-way.
The rest must finish with their exact token counts and, for greedy requests, the same text
as when each runs alone; afterwards the batch, the queue and the KV cache are empty.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc
import pytest

from tests.e2e.probes import metric_sample
from tests.e2e.server import LauncherProcess, healthy_launcher
from tgis.pb import generation_pb2 as pb
from tgis.pb import generation_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow

STREAMS = 64
WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "while",
    "seven",
    "ducks",
    "swim",
]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LauncherProcess]:
    # 320 KV tokens (20 blocks) for up to 16 sequences of up to ~150 tokens each.
    flags = [
        "--max-sequence-length", "256",
        "--max-batch-total-tokens", "320",
        "--max-batch-prefill-tokens", "96",
        "--max-waiting-tokens", "4",
    ]  # fmt: skip
    with healthy_launcher(tmp_path_factory.mktemp("scheduling"), flags) as launcher:
        yield launcher


@dataclass
class Stream:
    index: int
    text: str
    tokens: int
    seed: int | None  # None: greedy
    cancel_after: int | None  # cancel once this many tokens arrived
    received: list[str] = field(default_factory=list)
    count: int = 0
    reason: int = pb.NOT_FINISHED
    error: BaseException | None = None

    def params(self) -> pb.Parameters:
        stopping = pb.StoppingCriteria(max_new_tokens=self.tokens, min_new_tokens=self.tokens)
        if self.seed is None:
            return pb.Parameters(method=pb.GREEDY, stopping=stopping)
        sampling = pb.SamplingParameters(temperature=0.8, top_k=20, seed=self.seed)
        return pb.Parameters(method=pb.SAMPLE, sampling=sampling, stopping=stopping)


def make_streams() -> list[Stream]:
    rng = random.Random(1234)
    streams = []
    for i in range(STREAMS):
        words = rng.choice([3, 8, 30, 70])  # short and long prompts (chunked at 96 tokens)
        text = " ".join(rng.choice(WORDS) for _ in range(words)) + f" {i}"
        tokens = rng.choice([4, 16, 40, 70])
        seed = None if i % 4 else rng.randrange(1, 1 << 30)
        cancel = rng.randrange(1, tokens) if i % 3 == 1 and tokens > 4 else None
        streams.append(Stream(i, text, tokens, seed, cancel))
    return streams


def run_stream(stub: pb_grpc.GenerationServiceStub, stream: Stream, go: threading.Event) -> None:
    go.wait()
    request = pb.SingleGenerationRequest(
        request=pb.GenerationRequest(text=stream.text), params=stream.params()
    )
    call = stub.GenerateStream(request, timeout=120)
    try:
        for message in call:
            stream.received.append(message.text)
            stream.count = max(stream.count, message.generated_token_count)
            stream.reason = message.stop_reason
            if stream.cancel_after is not None and stream.count >= stream.cancel_after:
                call.cancel()
                return
    except grpc.RpcError as err:
        if err.code() != grpc.StatusCode.CANCELLED or stream.cancel_after is None:
            stream.error = err
    except BaseException as err:
        stream.error = err


def test_64_streams_under_kv_pressure_with_cancellations(
    server: LauncherProcess, stub: pb_grpc.GenerationServiceStub
) -> None:
    streams = make_streams()
    go = threading.Event()
    threads = [threading.Thread(target=run_stream, args=(stub, s, go)) for s in streams]
    for thread in threads:
        thread.start()
    started = time.monotonic()
    go.set()
    for thread in threads:
        thread.join(150)
    elapsed = time.monotonic() - started
    assert not any(t.is_alive() for t in threads), "streams still running"
    assert not [s.error for s in streams if s.error], [s.error for s in streams if s.error]

    cancelled = [s for s in streams if s.cancel_after is not None]
    finished = [s for s in streams if s.cancel_after is None]
    assert len(cancelled) >= STREAMS // 4
    for s in finished:
        assert (s.count, s.reason) == (s.tokens, pb.MAX_TOKENS), s
    preemptions = metric_sample(server, "tgi_request_preemption_count_total")
    assert preemptions is not None and preemptions > 0, "the cache was never short"

    # Each greedy request alone (batch of one, no pressure) gives the same text.
    alone = [s for s in finished if s.seed is None]
    responses = stub.Generate(
        pb.BatchedGenerationRequest(
            requests=[pb.GenerationRequest(text=s.text) for s in alone[:1]],
            params=alone[0].params(),
        ),
        timeout=60,
    )
    assert responses.responses[0].text == "".join(alone[0].received)
    for s in alone[1:]:
        response = stub.Generate(
            pb.BatchedGenerationRequest(
                requests=[pb.GenerationRequest(text=s.text)], params=s.params()
            ),
            timeout=60,
        ).responses[0]
        assert response.text == "".join(s.received), f"stream {s.index}"
    # Seeded sampling resumes with its generator too: same text alone.
    for s in [s for s in finished if s.seed is not None][:4]:
        response = stub.Generate(
            pb.BatchedGenerationRequest(
                requests=[pb.GenerationRequest(text=s.text)], params=s.params()
            ),
            timeout=60,
        ).responses[0]
        assert response.text == "".join(s.received), f"seeded stream {s.index}"

    # Everything left the batch and gave its blocks back.
    deadline = time.monotonic() + 10
    gauges = ("tgi_batch_current_size", "tgi_queue_size", "tgi_kv_cache_used_blocks")
    while time.monotonic() < deadline:
        values = [metric_sample(server, g) for g in gauges]
        if values == [0.0, 0.0, 0.0]:
            break
        time.sleep(0.1)
    assert values == [0.0, 0.0, 0.0], dict(zip(gauges, values, strict=True))
    print(f"64 streams in {elapsed:.1f}s, {preemptions:.0f} preemptions")
