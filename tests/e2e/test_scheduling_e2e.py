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
from dataclasses import dataclass

import pytest

from tests.e2e.probes import metric_sample
from tests.e2e.server import LauncherProcess, healthy_launcher
from tests.e2e.streams import GrpcStream, stream_request
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
class Case:
    """One stream's request, and when its client cancels it."""

    index: int
    text: str
    tokens: int
    seed: int | None  # None: greedy
    cancel_after: int | None  # cancel once this many tokens arrived

    def params(self) -> pb.Parameters:
        stopping = pb.StoppingCriteria(max_new_tokens=self.tokens, min_new_tokens=self.tokens)
        if self.seed is None:
            return pb.Parameters(method=pb.GREEDY, stopping=stopping)
        sampling = pb.SamplingParameters(temperature=0.8, top_k=20, seed=self.seed)
        return pb.Parameters(method=pb.SAMPLE, sampling=sampling, stopping=stopping)


def make_cases() -> list[Case]:
    rng = random.Random(1234)
    cases = []
    for i in range(STREAMS):
        words = rng.choice([3, 8, 30, 70])  # short and long prompts (chunked at 96 tokens)
        text = " ".join(rng.choice(WORDS) for _ in range(words)) + f" {i}"
        tokens = rng.choice([4, 16, 40, 70])
        seed = None if i % 4 else rng.randrange(1, 1 << 30)
        cancel = rng.randrange(1, tokens) if i % 3 == 1 and tokens > 4 else None
        cases.append(Case(i, text, tokens, seed, cancel))
    return cases


def test_64_streams_under_kv_pressure_with_cancellations(
    server: LauncherProcess, stub: pb_grpc.GenerationServiceStub
) -> None:
    cases = make_cases()
    go = threading.Event()
    streams = [
        GrpcStream(stub, stream_request(c.text, c.params()), cancel_after=c.cancel_after, go=go)
        for c in cases
    ]
    for stream in streams:
        stream.start()
    started = time.monotonic()
    go.set()
    for stream in streams:
        stream.join(150)
    elapsed = time.monotonic() - started
    assert not any(s.is_alive() for s in streams), "streams still running"
    assert not [s.error for s in streams if s.error], [s.error for s in streams if s.error]

    cancelled = [c for c in cases if c.cancel_after is not None]
    finished = [(c, s) for c, s in zip(cases, streams, strict=True) if c.cancel_after is None]
    assert len(cancelled) >= STREAMS // 4
    for c, s in finished:
        assert (s.tokens, s.stop_reason) == (c.tokens, pb.MAX_TOKENS), (c, s.outcome())
    preemptions = metric_sample(server, "tgi_request_preemption_count_total")
    assert preemptions is not None and preemptions > 0, "the cache was never short"

    # Each greedy request alone (batch of one, no pressure) gives the same text.
    alone = [(c, s) for c, s in finished if c.seed is None]
    assert alone, "no greedy stream finished"
    for c, s in alone:
        response = stub.Generate(
            pb.BatchedGenerationRequest(
                requests=[pb.GenerationRequest(text=c.text)], params=c.params()
            ),
            timeout=60,
        ).responses[0]
        assert response.text == s.text, f"stream {c.index}"
    # Seeded sampling resumes with its generator too: same text alone.
    for c, s in [(c, s) for c, s in finished if c.seed is not None][:4]:
        response = stub.Generate(
            pb.BatchedGenerationRequest(
                requests=[pb.GenerationRequest(text=c.text)], params=c.params()
            ),
            timeout=60,
        ).responses[0]
        assert response.text == s.text, f"seeded stream {c.index}"

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
