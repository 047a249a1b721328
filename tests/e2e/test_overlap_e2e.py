"""The overlapped step pipeline against the serial loop, end to end.

64 concurrent streams of mixed prompt and output lengths on a server with default flags
(two steps in flight): some greedy, some with seeded sampling, some with stop sequences
(kept or cut), some free to end on EOS, a third cancelled at random points. Every stream that
was not cancelled must give exactly the text, the tokens, the count and the stop reason of
the same request run alone on a server running the serial loop (``TGIS_PIPELINE_DEPTH=1``),
one request at a time; afterwards the batch, the queue and the KV cache are empty.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import pytest

from tests.e2e.probes import metric_sample
from tests.e2e.server import LauncherProcess, healthy_launcher
from tests.e2e.streams import GrpcStream, stream_request
from tgis.pb import generation_pb2 as pb
from tgis.pb import generation_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow

STREAMS = 64
PROMPTS = [
    "Return the number of",
    "the quick brown fox",
    "Create a new",
    "If the value is",
    "Raise an error when the file",
    "Write the data to",
    "Convert a string",
    "Find all the items in the list and",
]
STOPS = [[" the"], ["."], [" a", ","], [" of"]]


@pytest.fixture(scope="module")
def overlapped(embedded_server: LauncherProcess) -> LauncherProcess:
    return embedded_server


@pytest.fixture(scope="module")
def serial(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LauncherProcess]:
    with healthy_launcher(
        tmp_path_factory.mktemp("serial"), env={"TGIS_PIPELINE_DEPTH": "1"}
    ) as launcher:
        yield launcher


@dataclass
class Case:
    """One stream's request, and when its client cancels it."""

    index: int
    text: str
    max_tokens: int
    min_tokens: int
    seed: int | None  # None: greedy
    stops: list[str]
    include_stop: bool
    cancel_after: int | None  # cancel once this many tokens arrived

    def params(self) -> pb.Parameters:
        stopping = pb.StoppingCriteria(
            max_new_tokens=self.max_tokens,
            min_new_tokens=self.min_tokens,
            stop_sequences=self.stops,
            include_stop_sequence=self.include_stop,
        )
        response = pb.ResponseOptions(generated_tokens=True)
        if self.seed is None:
            return pb.Parameters(method=pb.GREEDY, stopping=stopping, response=response)
        sampling = pb.SamplingParameters(temperature=0.9, top_k=30, top_p=0.9, seed=self.seed)
        return pb.Parameters(
            method=pb.SAMPLE, sampling=sampling, stopping=stopping, response=response
        )

    def stream(
        self,
        stub: pb_grpc.GenerationServiceStub,
        *,
        cancel: bool = True,
        go: threading.Event | None = None,
        timeout: float = 120,
    ) -> GrpcStream:
        """Its stream (cancelled or not), to start."""
        return GrpcStream(
            stub,
            stream_request(self.text, self.params()),
            cancel_after=self.cancel_after if cancel else None,
            go=go,
            timeout=timeout,
        )


def make_cases() -> list[Case]:
    rng = random.Random(4321)
    cases = []
    for i in range(STREAMS):
        repeat = rng.choice([1, 1, 4, 12])  # short prompts and long ones
        text = " ".join([rng.choice(PROMPTS)] * repeat)
        max_tokens = rng.choice([3, 12, 30, 60])
        min_tokens = rng.choice([0, 0, max_tokens])  # 0: EOS may end it early
        seed = rng.randrange(1, 1 << 30) if i % 3 == 0 else None
        stops = rng.choice(STOPS) if i % 4 == 1 else []
        cancel = rng.randrange(1, max_tokens) if i % 3 == 2 else None
        cases.append(Case(i, text, max_tokens, min_tokens, seed, stops, i % 8 == 1, cancel))
    return cases


def test_64_overlapped_streams_equal_their_serial_lone_runs(
    overlapped: LauncherProcess, serial: LauncherProcess
) -> None:
    cases = make_cases()
    with grpc.insecure_channel(overlapped.grpc_target) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        go = threading.Event()
        streams = [case.stream(stub, go=go) for case in cases]
        for stream in streams:
            stream.start()
        go.set()
        for stream in streams:
            stream.join(150)
    assert not any(s.is_alive() for s in streams), "streams still running"
    assert not [s.error for s in streams if s.error], [s.error for s in streams if s.error]
    finished = [(c, s) for c, s in zip(cases, streams, strict=True) if c.cancel_after is None]
    assert STREAMS - len(finished) >= STREAMS // 3
    reasons = {s.stop_reason for _, s in finished}
    assert {pb.MAX_TOKENS, pb.STOP_SEQUENCE} <= reasons, reasons
    assert all(s.tokens == len(s.token_texts) for _, s in finished)

    with grpc.insecure_channel(serial.grpc_target) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        for case, s in finished:  # one at a time, serial loop
            alone = case.stream(stub, cancel=False, timeout=60)
            alone.start()
            alone.join(90)
            assert not alone.is_alive() and alone.error is None, alone.error
            assert s.outcome() == alone.outcome(), f"stream {case.index}"

    deadline = time.monotonic() + 10
    gauges = ("tgi_batch_current_size", "tgi_queue_size", "tgi_kv_cache_used_blocks")
    while time.monotonic() < deadline:
        values = [metric_sample(overlapped, g) for g in gauges]
        if values == [0.0, 0.0, 0.0]:
            break
        time.sleep(0.1)
    assert values == [0.0, 0.0, 0.0], dict(zip(gauges, values, strict=True))
