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
from dataclasses import dataclass, field

import grpc
import pytest

from tests.e2e.probes import metric_sample
from tests.e2e.server import LauncherProcess, healthy_launcher
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
class Stream:
    index: int
    text: str
    max_tokens: int
    min_tokens: int
    seed: int | None  # None: greedy
    stops: list[str]
    include_stop: bool
    cancel_after: int | None  # cancel once this many tokens arrived
    received: list[str] = field(default_factory=list)
    tokens: list[str] = field(default_factory=list)
    count: int = 0
    reason: int = pb.NOT_FINISHED
    stop_sequence: str = ""
    error: BaseException | None = None

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

    def outcome(self) -> tuple[str, list[str], int, int, str]:
        return "".join(self.received), self.tokens, self.count, self.reason, self.stop_sequence


def make_streams() -> list[Stream]:
    rng = random.Random(4321)
    streams = []
    for i in range(STREAMS):
        repeat = rng.choice([1, 1, 4, 12])  # short prompts and long ones
        text = " ".join([rng.choice(PROMPTS)] * repeat)
        max_tokens = rng.choice([3, 12, 30, 60])
        min_tokens = rng.choice([0, 0, max_tokens])  # 0: EOS may end it early
        seed = rng.randrange(1, 1 << 30) if i % 3 == 0 else None
        stops = rng.choice(STOPS) if i % 4 == 1 else []
        cancel = rng.randrange(1, max_tokens) if i % 3 == 2 else None
        streams.append(Stream(i, text, max_tokens, min_tokens, seed, stops, i % 8 == 1, cancel))
    return streams


def consume(call: grpc.Call, stream: Stream) -> None:
    for message in call:
        stream.received.append(message.text)
        stream.tokens += [t.text for t in message.tokens]
        stream.count = max(stream.count, message.generated_token_count)
        if message.stop_reason != pb.NOT_FINISHED:
            stream.reason, stream.stop_sequence = message.stop_reason, message.stop_sequence
        if stream.cancel_after is not None and stream.count >= stream.cancel_after:
            call.cancel()
            return


def run_stream(stub: pb_grpc.GenerationServiceStub, stream: Stream, go: threading.Event) -> None:
    go.wait()
    request = pb.SingleGenerationRequest(
        request=pb.GenerationRequest(text=stream.text), params=stream.params()
    )
    call = stub.GenerateStream(request, timeout=120)
    try:
        consume(call, stream)
    except grpc.RpcError as err:
        if err.code() != grpc.StatusCode.CANCELLED or stream.cancel_after is None:
            stream.error = err
    except BaseException as err:
        stream.error = err


def test_64_overlapped_streams_equal_their_serial_lone_runs(
    overlapped: LauncherProcess, serial: LauncherProcess
) -> None:
    streams = make_streams()
    with grpc.insecure_channel(overlapped.grpc_target) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        go = threading.Event()
        threads = [threading.Thread(target=run_stream, args=(stub, s, go)) for s in streams]
        for thread in threads:
            thread.start()
        go.set()
        for thread in threads:
            thread.join(150)
    assert not any(t.is_alive() for t in threads), "streams still running"
    assert not [s.error for s in streams if s.error], [s.error for s in streams if s.error]
    finished = [s for s in streams if s.cancel_after is None]
    assert STREAMS - len(finished) >= STREAMS // 3
    reasons = {s.reason for s in finished}
    assert {pb.MAX_TOKENS, pb.STOP_SEQUENCE} <= reasons, reasons
    assert all(s.count == len(s.tokens) for s in finished)

    with grpc.insecure_channel(serial.grpc_target) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        for s in finished:  # one at a time, serial loop
            alone = Stream(
                s.index, s.text, s.max_tokens, s.min_tokens, s.seed, s.stops, s.include_stop, None
            )
            request = pb.SingleGenerationRequest(
                request=pb.GenerationRequest(text=s.text), params=s.params()
            )
            consume(stub.GenerateStream(request, timeout=60), alone)
            assert s.outcome() == alone.outcome(), f"stream {s.index}"

    deadline = time.monotonic() + 10
    gauges = ("tgi_batch_current_size", "tgi_queue_size", "tgi_kv_cache_used_blocks")
    while time.monotonic() < deadline:
        values = [metric_sample(overlapped, g) for g in gauges]
        if values == [0.0, 0.0, 0.0]:
            break
        time.sleep(0.1)
    assert values == [0.0, 0.0, 0.0], dict(zip(gauges, values, strict=True))
