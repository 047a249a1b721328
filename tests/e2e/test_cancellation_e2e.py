"""Cancellation, connection churn and the concurrency limit, end to end (issue 11, items 2
and 5): the real launcher serving a tiny random Llama with a KV cache far too small for
its batch, so requests queue, prefill in chunks and are preempted all the time.

* A storm of 1,000 GenerateStream calls cancelled at seeded random points (before the
  first message, after it while queued or prefilling, after k tokens while decoding, and
  so while sequences are being preempted), with unary Generate calls cancelled by their
  deadline or by ``cancel()`` mixed in.
* 200 connections opened and closed at once: idle channels, channels closed mid-stream
  and mid-call, raw sockets that send garbage or half an HTTP/2 preface.
* Requests just under, at and just over ``--max-concurrent-requests``, and a mix of
  failing requests after which the whole limit is available again.

After each: no KV block, batch slot or queue entry is left, no concurrency permit leaked
(exactly ``--max-concurrent-requests`` concurrent inputs are accepted and one more is
refused), and greedy requests give the text they gave before.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import random
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from tests.e2e.models import save_tiny_llama
from tests.e2e.server import LauncherProcess, healthy_launcher
from tgis.pb import generation_pb2 as pb
from tgis.pb import generation_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow

LIMIT = 32
"""--max-concurrent-requests."""
MAX_SEQUENCE_LENGTH = 256
HOLD_TOKENS = 240
"""A holding stream's length: its KV (16 blocks) fills the whole cache, so holders run
one at a time and the first one needs 240 steps (about a second) to finish."""
STORM_STREAMS = 1000
STORM_UNARY = 60
PREFILL_CANCELS = 40
STORM_CLIENT_CONCURRENCY = 20
"""Inputs the storm keeps in flight: below LIMIT, so that a permit released a little
after its client cancelled never causes a refusal."""
OVERLOADED = "Model is overloaded"
WORDS = ("the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven")
REFERENCE_PROMPTS = ("Return the number of", "seven ducks swim over the lazy dog")
IDLE_GAUGES = ("tgi_batch_current_size", "tgi_queue_size", "tgi_kv_cache_used_blocks")
PREEMPTIONS = "tgi_request_preemption_count_total"
CANCELLED = 'tgi_request_failure_total{err="cancelled"}'
GENERATE_FAILED = 'tgi_request_failure_total{err="generate"}'
CONC_LIMIT = 'tgi_request_failure_total{err="conc_limit"}'
VALIDATION_FAILED = 'tgi_request_failure_total{err="validation"}'
RECEIVED = "tgi_request_input_count_total"
VALIDATED = "tgi_request_input_length_count"
ADMITTED = "tgi_request_queue_duration_count"
FIRST_TOKEN = "tgi_request_time_to_first_token_duration_count"
COMPLETED = "tgi_request_duration_count"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LauncherProcess]:
    """The tiny Llama with 16 KV blocks of 16 tokens for up to 8 sequences, prompts
    prefilled 32 tokens a step, and a limit of LIMIT concurrent inputs."""
    model = tmp_path_factory.mktemp("cancel-llama")
    save_tiny_llama(model)
    flags = [
        "--model-name", str(model),
        "--max-sequence-length", str(MAX_SEQUENCE_LENGTH),
        "--max-batch-size", "8",
        "--max-batch-total-tokens", "256",
        "--max-batch-prefill-tokens", "32",
        "--max-concurrent-requests", str(LIMIT),
    ]  # fmt: skip
    with healthy_launcher(tmp_path_factory.mktemp("cancellation"), flags) as launcher:
        yield launcher


# ---- helpers ------------------------------------------------------------------------------


def greedy(tokens: int, min_tokens: int | None = None) -> pb.Parameters:
    """Greedy decoding of ``tokens`` tokens (at least ``min_tokens``, default all)."""
    least = tokens if min_tokens is None else min_tokens
    return pb.Parameters(
        method=pb.GREEDY,
        stopping=pb.StoppingCriteria(max_new_tokens=tokens, min_new_tokens=least),
    )


def stream_request(text: str, params: pb.Parameters) -> pb.SingleGenerationRequest:
    return pb.SingleGenerationRequest(request=pb.GenerationRequest(text=text), params=params)


def batch_request(texts: list[str], params: pb.Parameters) -> pb.BatchedGenerationRequest:
    return pb.BatchedGenerationRequest(
        requests=[pb.GenerationRequest(text=t) for t in texts], params=params
    )


def scrape(server: LauncherProcess) -> dict[str, float]:
    """Every sample of /metrics by its name and labels as exposed (``name{k="v"}``)."""
    status, body = server.http_get("/metrics", timeout=30)
    assert status == 200, body[:200]
    samples = {}
    for line in body.decode().splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


def delta(after: dict[str, float], before: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def wait_idle(server: LauncherProcess, timeout: float = 60.0) -> None:
    """Wait until nothing is queued or running and no KV block is in use; fail otherwise
    with the gauges' last values."""
    deadline = time.monotonic() + timeout
    while True:
        samples = scrape(server)
        values = {g: samples.get(g) for g in IDLE_GAUGES}
        if all(v == 0.0 for v in values.values()):
            return
        assert time.monotonic() < deadline, f"not idle after {timeout:.0f} s: {values}"
        time.sleep(0.1)


def assert_overloaded(err: BaseException) -> None:
    assert isinstance(err, grpc.aio.AioRpcError), repr(err)
    assert (err.code(), err.details()) == (grpc.StatusCode.RESOURCE_EXHAUSTED, OVERLOADED)


def hold_request(index: int) -> pb.SingleGenerationRequest:
    """A stream that runs for HOLD_TOKENS tokens: it keeps its permit until cancelled."""
    return stream_request(f"hold {index}", greedy(HOLD_TOKENS))


async def open_holders(stub: Any, count: int, first: int = 0) -> list[Any]:
    """Start ``count`` holding streams and wait for each one's first message (sent once
    the server has taken its permit and queued it)."""
    holders = [stub.GenerateStream(hold_request(first + i), timeout=120) for i in range(count)]
    try:
        for holder in holders:
            header = await asyncio.wait_for(holder.read(), 60)
            assert header is not grpc.aio.EOF and header.generated_token_count == 0, header
    except BaseException:
        cancel_all(holders)
        raise
    return holders


def cancel_all(calls: list[Any]) -> None:
    for call in calls:
        call.cancel()


def assert_still_holding(holders: list[Any]) -> None:
    """The refusals just seen happened while every holder was in flight (else they prove
    nothing: the holders are far too long for this to fail by chance)."""
    finished = [i for i, h in enumerate(holders) if h.done()]
    assert not finished, f"holders {finished} ended before the probe: inconclusive"


async def assert_limit_is_exact(stub: Any, server: LauncherProcess) -> None:
    """Exactly LIMIT concurrent streams are accepted and one more stream, or a Generate of
    one input, is refused with RESOURCE_EXHAUSTED: no permit is leaked (nor invented)."""
    holders = await open_holders(stub, LIMIT)
    try:
        probe = stub.GenerateStream(hold_request(LIMIT), timeout=60)
        with pytest.raises(grpc.aio.AioRpcError) as excinfo:
            await probe.read()
        assert_overloaded(excinfo.value)
        with pytest.raises(grpc.aio.AioRpcError) as excinfo:
            await stub.Generate(batch_request(["one more"], greedy(2)), timeout=60)
        assert_overloaded(excinfo.value)
        assert_still_holding(holders)
    finally:
        cancel_all(holders)
    await asyncio.to_thread(wait_idle, server)


async def reference_texts(stub: Any) -> list[str]:
    """Greedy texts of the reference prompts: unary, then the same streamed."""
    params = greedy(24)
    texts = []
    for prompt in REFERENCE_PROMPTS:
        response = await stub.Generate(batch_request([prompt], params), timeout=60)
        texts.append(response.responses[0].text)
        messages = [
            m async for m in stub.GenerateStream(stream_request(prompt, params), timeout=60)
        ]
        texts.append("".join(m.text for m in messages))
    return texts


def channel(server: LauncherProcess, own_connection: bool = False) -> Any:
    """An asyncio channel to the server; ``own_connection``: not shared with any other."""
    options = [("grpc.use_local_subchannel_pool", 1)] if own_connection else []
    return grpc.aio.insecure_channel(server.grpc_target, options=options)


def prompt(rng: random.Random, words: int, tag: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words)) + f" {tag}"


# ---- A: a storm of cancellations -----------------------------------------------------------


@dataclass
class StormStream:
    """A GenerateStream of the storm: when it is cancelled, and what it saw."""

    text: str
    max_new_tokens: int
    cancel_delay: float | None
    """Cancel this many seconds after the call starts, whatever has arrived."""
    cancel_after_tokens: int | None
    """Cancel once this many tokens have arrived."""
    messages: int = 0
    tokens: int = 0
    code: Any = None
    ended_at: float = 0.0

    @property
    def planned_cancel(self) -> bool:
        return self.cancel_delay is not None or self.cancel_after_tokens is not None

    @property
    def observed_phase(self) -> str:
        """Where the client was when it cancelled (or that it completed)."""
        if self.code == grpc.StatusCode.OK and self.tokens == self.max_new_tokens:
            return "completed"
        if self.messages == 0:
            return "before the first message"
        if self.tokens == 0:
            return "queued or prefilling"
        return "decoding"


@dataclass
class StormUnary:
    """A unary Generate of the storm, ended by its deadline or by ``cancel()``."""

    texts: list[str]
    max_new_tokens: int
    delay: float
    by_deadline: bool
    code: Any = None


def plan_storm(rng: random.Random) -> tuple[list[StormStream], list[StormUnary]]:
    streams = []
    for i in range(STORM_STREAMS):
        text = prompt(rng, rng.choice([2, 6, 20, 45]), i)  # 45 words, ~100 tokens: 4 chunks
        tokens = rng.choice([16, 32, 48])
        kind = rng.random()
        if kind < 0.12:  # before the first message
            delay, after = rng.choice([0.0, 0.0005, 0.002]), None
        elif kind < 0.40:  # after the header: in the queue or in its prefill
            delay, after = rng.uniform(0.002, 0.04), None
        elif kind < 0.95:  # mid-decode, on top of preemptions
            delay, after = None, rng.randrange(1, tokens)
        else:
            delay, after = None, None
        streams.append(StormStream(text, tokens, delay, after))
    unary = []
    for i in range(STORM_UNARY):
        texts = [prompt(rng, rng.choice([3, 12, 30]), 10_000 + i) for _ in range(rng.randint(1, 3))]
        unary.append(StormUnary(texts, rng.choice([16, 48]), rng.uniform(0.005, 0.3), i % 2 == 0))
    return streams, unary


def plan_prefill_cancels(rng: random.Random) -> list[StormStream]:
    """Streams with a prompt of about 210 tokens (7 prefill chunks of 32), to be cancelled
    at a random point of their prefill: run alone, each is admitted at once, so most are
    cancelled while their prompt is being prefilled (the storm, where the queue wait is long
    and varied, hits that short window only by chance). Their ``cancel_delay`` is a fraction
    of the time a lone prompt of that length takes to its first token, which
    ``scale_to_prefill`` turns into seconds on the machine at hand."""
    return [
        StormStream(prompt(rng, 105, 20_000 + i), 16, rng.uniform(0.05, 0.9), None)
        for i in range(PREFILL_CANCELS)
    ]


async def time_to_first_token(stub: Any, text: str) -> float:
    """Seconds from the call to the first generated token of ``text`` alone on the server."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    call = stub.GenerateStream(stream_request(text, greedy(1)), timeout=60)
    async for message in call:
        if message.generated_token_count >= 1:
            return loop.time() - started
    raise AssertionError(f"no token for {text!r}")


async def scale_to_prefill(stub: Any, streams: list[StormStream]) -> float:
    """Turn the streams' cancel fractions into seconds of this machine's prefill (the
    median of three lone runs of a prompt as long as theirs); returns that time."""
    rng = random.Random(99)
    lone = sorted([await time_to_first_token(stub, prompt(rng, 105, 30_000)) for _ in range(3)])
    ttft = lone[1]
    for stream in streams:
        assert stream.cancel_delay is not None
        stream.cancel_delay *= ttft
    return ttft


class InputPermits:
    """The client's own bound on inputs in flight; a batch takes all its permits at once,
    under a lock, so that two batches never deadlock holding some each."""

    def __init__(self, limit: int) -> None:
        self._semaphore = asyncio.Semaphore(limit)
        self._lock = asyncio.Lock()

    async def acquire(self, count: int) -> None:
        async with self._lock:
            for _ in range(count):
                await self._semaphore.acquire()

    def release(self, count: int) -> None:
        for _ in range(count):
            self._semaphore.release()


async def run_storm_stream(stub: Any, stream: StormStream, permits: InputPermits) -> None:
    await permits.acquire(1)
    loop = asyncio.get_running_loop()
    try:
        call = stub.GenerateStream(
            stream_request(stream.text, greedy(stream.max_new_tokens)), timeout=120
        )
        cancel_at = None if stream.cancel_delay is None else loop.time() + stream.cancel_delay
        try:
            while stream.cancel_after_tokens is None or stream.tokens < stream.cancel_after_tokens:
                remaining = None if cancel_at is None else cancel_at - loop.time()
                if remaining is not None and remaining <= 0:
                    break
                message = await asyncio.wait_for(call.read(), remaining)
                if message is grpc.aio.EOF:
                    break
                stream.messages += 1
                stream.tokens = max(stream.tokens, message.generated_token_count)
        except TimeoutError:  # wait_for cancelled the read, and so the call
            pass
        except grpc.aio.AioRpcError:
            pass  # its code is read below
        call.cancel()
        stream.ended_at = loop.time()
        stream.code = await call.code()
    finally:
        permits.release(1)


async def run_storm_unary(stub: Any, unary: StormUnary, permits: InputPermits) -> None:
    count = len(unary.texts)
    await permits.acquire(count)
    try:
        request = batch_request(unary.texts, greedy(unary.max_new_tokens))
        if unary.by_deadline:
            try:
                await stub.Generate(request, timeout=unary.delay)
                unary.code = grpc.StatusCode.OK
            except grpc.aio.AioRpcError as err:
                unary.code = err.code()
        else:
            call = stub.Generate(request, timeout=120)
            await asyncio.sleep(unary.delay)
            call.cancel()
            unary.code = await call.code()
    finally:
        permits.release(count)


async def sample_preemptions(
    server: LauncherProcess, stop: asyncio.Event, samples: list[tuple[float, float]]
) -> None:
    """The preemption counter every 0.1 s until ``stop``: when preemptions happened."""
    loop = asyncio.get_running_loop()
    while not stop.is_set():
        value = (await asyncio.to_thread(scrape, server)).get(PREEMPTIONS, 0.0)
        samples.append((loop.time(), value))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.1)


def cancels_while_preempting(streams: list[StormStream], samples: list[tuple[float, float]]) -> int:
    """Decode-phase cancellations that fell in a sampling interval in which the server
    preempted sequences: as close as a client can see to "cancelled during preemption"."""
    busy = [(t0, t1) for (t0, v0), (t1, v1) in itertools.pairwise(samples) if v1 > v0]
    return sum(
        1
        for s in streams
        if s.observed_phase == "decoding" and any(t0 < s.ended_at <= t1 for t0, t1 in busy)
    )


def test_a_thousand_cancelled_streams_leak_nothing(server: LauncherProcess) -> None:
    """1,000 streams and 60 unary calls cancelled at random points under KV pressure: every
    phase is hit, preemptions happen meanwhile, and afterwards nothing is left over."""
    rng = random.Random(20240611)
    streams, unary = plan_storm(rng)
    prefill_streams = plan_prefill_cancels(rng)
    pids = server.process_pids()

    async def scenario() -> tuple[list[str], list[str], list[tuple[float, float]], float]:
        async with channel(server) as ch:
            stub = pb_grpc.GenerationServiceStub(ch)
            before = await reference_texts(stub)
            permits = InputPermits(STORM_CLIENT_CONCURRENCY)
            stop = asyncio.Event()
            samples: list[tuple[float, float]] = []
            sampler = asyncio.create_task(sample_preemptions(server, stop, samples))
            jobs = [run_storm_stream(stub, s, permits) for s in streams]
            jobs += [run_storm_unary(stub, u, permits) for u in unary]
            random.Random(7).shuffle(jobs)
            started = time.monotonic()
            await asyncio.wait_for(asyncio.gather(*jobs), 240)
            elapsed = time.monotonic() - started
            stop.set()
            await sampler
            await asyncio.to_thread(wait_idle, server)
            checkpoints.append(await asyncio.to_thread(scrape, server))
            await scale_to_prefill(stub, prefill_streams)
            for stream in prefill_streams:  # one at a time, each alone on the server
                await run_storm_stream(stub, stream, permits)
            await asyncio.to_thread(wait_idle, server)
            checkpoints.append(await asyncio.to_thread(scrape, server))
            await assert_limit_is_exact(stub, server)
            after = await reference_texts(stub)
        return before, after, samples, elapsed

    checkpoints = [scrape(server)]
    before, after, samples, elapsed = asyncio.run(scenario())
    start, after_storm, after_prefill = checkpoints
    end = scrape(server)

    # Every call ended as planned: cancelled (or done first), never failed or refused.
    for s in streams + prefill_streams:
        if s.planned_cancel:
            assert s.code in {grpc.StatusCode.OK, grpc.StatusCode.CANCELLED}, s
        else:
            assert (s.code, s.tokens) == (grpc.StatusCode.OK, s.max_new_tokens), s
    for u in unary:
        ended = grpc.StatusCode.DEADLINE_EXCEEDED if u.by_deadline else grpc.StatusCode.CANCELLED
        assert u.code in {grpc.StatusCode.OK, ended}, u
    assert delta(end, start, GENERATE_FAILED) == 0
    assert delta(end, start, CONC_LIMIT) == 2  # only the two probes of the limit check

    # Phases as the client saw them, and as the server counted them.
    client_phases = Counter(s.observed_phase for s in streams)
    unary_codes = Counter(u.code.name for u in unary)
    storm_phases = server_phases(after_storm, start)
    prefill_phases = server_phases(after_prefill, after_storm)
    preemptions = samples[-1][1] - samples[0][1]
    overlapping = cancels_while_preempting(streams, samples)
    print(
        f"\nstorm of {STORM_STREAMS} streams + {STORM_UNARY} unary in {elapsed:.1f} s; "
        f"client phases {dict(client_phases)}; unary {dict(unary_codes)}; server phases "
        f"{storm_phases}; engine cancellations {delta(after_storm, start, CANCELLED):.0f}; "
        f"{preemptions:.0f} preemptions, {overlapping} decode cancels while preempting; "
        f"{PREFILL_CANCELS} long prompts alone: {prefill_phases}"
    )
    for phase in ("before the first message", "queued or prefilling", "decoding"):
        assert client_phases[phase] >= 50, client_phases
    assert storm_phases["cancelled in the queue"] >= 50, storm_phases
    assert storm_phases["cancelled after a token"] >= 300, storm_phases
    assert prefill_phases["cancelled in prefill"] >= PREFILL_CANCELS // 4, prefill_phases
    assert delta(after_storm, start, CANCELLED) >= 500
    assert unary_codes["CANCELLED"] >= 5 and unary_codes["DEADLINE_EXCEEDED"] >= 5, unary_codes
    assert preemptions > 0, "the KV cache was never short: no preemption during the storm"
    assert overlapping > 0, "no cancellation while sequences were being preempted"

    # Served as before, by the same processes, with nothing amiss in the log.
    assert after == before
    assert server.process_pids() == pids
    assert_clean_log(server)


def server_phases(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    """Where the server was when inputs ended, from its counters: inputs received but
    never validated (cancelled during validation), validated but never admitted
    (cancelled in the queue), admitted without a first token (cancelled in prefill), and
    the rest (cancelled while decoding, or completed)."""
    received = delta(after, before, RECEIVED)
    validated = delta(after, before, VALIDATED)
    admitted = delta(after, before, ADMITTED)
    first_tokens = delta(after, before, FIRST_TOKEN)
    completed = delta(after, before, COMPLETED)
    return {
        "cancelled in validation": received - validated,
        "cancelled in the queue": validated - admitted,
        "cancelled in prefill": admitted - first_tokens,
        "cancelled after a token": first_tokens - completed,
        "completed": completed,
    }


def assert_clean_log(server: LauncherProcess) -> None:
    """No error line or traceback in the launcher's log (router and shard included)."""
    text = server.log_path.read_text(errors="replace")
    bad = [line for line in text.splitlines() if " ERROR " in line or "Traceback" in line]
    assert not bad, "\n".join(bad[:20])


# ---- B: connection churn -------------------------------------------------------------------

HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


def established_connections(server: LauncherProcess) -> int:
    """TCP connections the router holds on its gRPC port (its sockets found in
    /proc/net/tcp in state ESTABLISHED)."""
    (router,) = server.process_pids()["router"]
    inodes = set()
    fd_dir = Path(f"/proc/{router}/fd")
    for fd in os.listdir(fd_dir):
        try:
            target = os.readlink(fd_dir / fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    port = f"{server.grpc_port:04X}"
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local_port = fields[1].rsplit(":", 1)[1]
            if local_port == port and fields[3] == "01" and fields[9] in inodes:
                count += 1
    return count


async def churn_channel(server: LauncherProcess, kind: str, rng: random.Random) -> str:
    """One connection of its own: opened, used as ``kind`` says, closed; returns how the
    call ended (or ``kind`` when there was none)."""
    ch = channel(server, own_connection=True)
    try:
        await asyncio.wait_for(ch.channel_ready(), 60)
        stub = pb_grpc.GenerationServiceStub(ch)
        if kind == "idle":
            await asyncio.sleep(rng.uniform(0, 0.2))
            return "idle"
        if kind == "mid-stream":
            call = stub.GenerateStream(stream_request(prompt(rng, 8, 0), greedy(48)), timeout=60)
            for _ in range(rng.randint(1, 4)):
                await call.read()
            return "closed mid-stream"
        call = stub.Generate(batch_request([prompt(rng, 8, 1)], greedy(48)), timeout=60)
        await asyncio.sleep(rng.uniform(0, 0.05))
        if call.done():
            return "unary done before the close"
        return "closed mid-unary"
    except grpc.aio.AioRpcError as err:
        return err.code().name
    finally:
        await ch.close()  # cancels whatever is in flight


async def churn_socket(server: LauncherProcess, kind: str, rng: random.Random) -> str:
    """A raw TCP connection that sends ``kind`` of bytes and closes."""
    _reader, writer = await asyncio.open_connection("127.0.0.1", server.grpc_port)
    if kind == "garbage":
        writer.write(rng.randbytes(rng.randint(1, 300)))
    elif kind == "half preface":
        writer.write(HTTP2_PREFACE[: rng.randint(1, len(HTTP2_PREFACE) - 1)])
    else:  # the preface and half a SETTINGS frame
        writer.write(HTTP2_PREFACE + b"\x00\x00\x0c\x04\x00\x00\x00\x00\x00\x00\x03")
    await writer.drain()
    await asyncio.sleep(rng.uniform(0, 0.1))
    writer.close()
    with contextlib.suppress(OSError):  # the server may reset a connection sent garbage
        await writer.wait_closed()
    return kind


def test_connection_churn_leaves_the_server_healthy(server: LauncherProcess) -> None:
    """200 connections opened and closed at once, many of them mid-call or malformed: the
    server keeps serving, closes every connection, and leaks no permit or block."""
    rng = random.Random(99)
    # 32 calls, LIMIT at most: a refusal (a permit still held by the previous test's
    # cancelled holders) stays rare, so most calls are closed mid-call.
    kinds = ["idle"] * 88 + ["mid-stream"] * 16 + ["mid-unary"] * 16
    raw = ["garbage"] * 30 + ["half preface"] * 30 + ["half settings"] * 20
    pids = server.process_pids()

    async def scenario() -> tuple[Counter[str], int, int]:
        async with channel(server) as ch:
            stub = pb_grpc.GenerationServiceStub(ch)
            before = await reference_texts(stub)
            baseline = established_connections(server)
            jobs = [churn_channel(server, k, random.Random(rng.random())) for k in kinds]
            jobs += [churn_socket(server, k, random.Random(rng.random())) for k in raw]
            rng.shuffle(jobs)
            outcomes = Counter(await asyncio.wait_for(asyncio.gather(*jobs), 120))
            await asyncio.to_thread(wait_idle, server)
            deadline = time.monotonic() + 30
            while (left := established_connections(server)) != baseline:
                assert time.monotonic() < deadline, f"{left} connections, {baseline} before"
                await asyncio.sleep(0.1)
            await assert_limit_is_exact(stub, server)
            assert await reference_texts(stub) == before
        return outcomes, baseline, left

    start = scrape(server)
    outcomes, baseline, left = asyncio.run(scenario())
    end = scrape(server)
    print(f"\nchurn outcomes {dict(outcomes)}; router connections {baseline} -> {left}")
    assert outcomes["closed mid-stream"] >= 12 and outcomes["closed mid-unary"] >= 8, outcomes
    assert set(outcomes) <= {
        "idle",
        "closed mid-stream",
        "closed mid-unary",
        "unary done before the close",
        "RESOURCE_EXHAUSTED",  # a permit the previous test's cancels had not yet released
        *raw,
    }, outcomes
    assert delta(end, start, GENERATE_FAILED) == 0
    assert server.http_get("/health")[0] == 200
    assert server.process_pids() == pids
    assert_clean_log(server)


# ---- C: the concurrency limit --------------------------------------------------------------


def test_inputs_under_at_and_over_the_limit(server: LauncherProcess) -> None:
    """LIMIT-1 and LIMIT concurrent inputs are accepted, LIMIT+1 refused with TGIS's
    RESOURCE_EXHAUSTED, whether the inputs come as streams or as one batch Generate."""

    async def scenario() -> None:
        async with channel(server) as ch:
            stub = pb_grpc.GenerationServiceStub(ch)
            # LIMIT-1 streams held: a Generate of two inputs is refused, one of one input
            # is accepted (queued: LIMIT inputs in flight), and then a stream is refused.
            holders = await open_holders(stub, LIMIT - 1)
            try:
                with pytest.raises(grpc.aio.AioRpcError) as excinfo:
                    await stub.Generate(batch_request(["a", "b"], greedy(2)), timeout=60)
                assert_overloaded(excinfo.value)
                holders.append(stub.Generate(batch_request(["a"], greedy(2)), timeout=120))
                await asyncio.to_thread(wait_until_in_flight, server, LIMIT)
                probe = stub.GenerateStream(hold_request(LIMIT), timeout=60)
                with pytest.raises(grpc.aio.AioRpcError) as excinfo:
                    await probe.read()
                assert_overloaded(excinfo.value)
                assert_still_holding(holders)
            finally:
                cancel_all(holders)
            await asyncio.to_thread(wait_idle, server)

            # A batch of LIMIT inputs is served; LIMIT+1 is refused before anything runs.
            texts = [f"input {i}" for i in range(LIMIT)]
            response = await stub.Generate(batch_request(texts, greedy(3)), timeout=120)
            assert [r.generated_token_count for r in response.responses] == [3] * LIMIT
            with pytest.raises(grpc.aio.AioRpcError) as excinfo:
                await stub.Generate(batch_request([*texts, "over"], greedy(3)), timeout=60)
            assert_overloaded(excinfo.value)

            # A batch of LIMIT long inputs in flight holds every permit.
            batch = stub.Generate(batch_request(texts, greedy(HOLD_TOKENS)), timeout=120)
            await asyncio.to_thread(wait_until_in_flight, server, LIMIT)
            probe = stub.GenerateStream(hold_request(0), timeout=60)
            with pytest.raises(grpc.aio.AioRpcError) as excinfo:
                await probe.read()
            assert_overloaded(excinfo.value)
            assert not batch.done()
            batch.cancel()
            assert await batch.code() == grpc.StatusCode.CANCELLED
            await asyncio.to_thread(wait_idle, server)
            await assert_limit_is_exact(stub, server)

    asyncio.run(scenario())
    assert_clean_log(server)


def wait_until_in_flight(server: LauncherProcess, count: int, timeout: float = 60.0) -> None:
    """Wait until ``count`` inputs are queued or running."""
    deadline = time.monotonic() + timeout
    while True:
        samples = scrape(server)
        total = samples.get("tgi_queue_size", 0.0) + samples.get("tgi_batch_current_size", 0.0)
        if total == count:
            return
        assert time.monotonic() < deadline, f"{total} inputs in flight, not {count}"
        time.sleep(0.05)


async def failing_call(stub: Any, kind: str, index: int) -> str:
    """One call that takes a permit (or asks for too many) and fails; returns its code."""
    long_text = " ".join(["fox"] * (MAX_SEQUENCE_LENGTH + 10))
    calls: dict[str, Any] = {
        "max_new_tokens too large": lambda: stub.Generate(
            batch_request(["x"], greedy(10_000)), timeout=60
        ),
        "one input too long": lambda: stub.Generate(
            batch_request(["short", long_text, "short"], greedy(4)), timeout=60
        ),
        "unknown prefix": lambda: stub.Generate(
            pb.BatchedGenerationRequest(
                prefix_id=f"no-such-prefix-{index}",
                requests=[pb.GenerationRequest(text="x")],
                params=greedy(4),
            ),
            timeout=60,
        ),
        "adapter without a store": lambda: stub.Generate(
            pb.BatchedGenerationRequest(
                adapter_id="some-adapter",
                requests=[pb.GenerationRequest(text="x")],
                params=greedy(4),
            ),
            timeout=60,
        ),
        "too many inputs": lambda: stub.Generate(
            batch_request(["x"] * (LIMIT + 1), greedy(4)), timeout=60
        ),
        "deadline": lambda: stub.Generate(
            batch_request([f"deadline {index}"], greedy(HOLD_TOKENS)), timeout=0.05
        ),
    }
    if kind in calls:
        try:
            await calls[kind]()
        except grpc.aio.AioRpcError as err:
            return str(err.code().name)
        return "OK"
    if kind == "stream with bad params":
        call = stub.GenerateStream(stream_request("x", greedy(2, min_tokens=5)), timeout=60)
    else:  # a stream cancelled after its first message
        call = stub.GenerateStream(hold_request(1000 + index), timeout=60)
    try:
        await call.read()
        call.cancel()
    except grpc.aio.AioRpcError:
        pass
    return str((await call.code()).name)


def test_permits_come_back_after_failures(server: LauncherProcess) -> None:
    """Three times LIMIT failing calls at once (validation errors at every stage,
    refusals, deadlines, cancellations): afterwards the whole limit is free again."""
    expected = {
        "max_new_tokens too large": "INVALID_ARGUMENT",
        "one input too long": "INVALID_ARGUMENT",
        "unknown prefix": "INVALID_ARGUMENT",
        "adapter without a store": "INVALID_ARGUMENT",
        "too many inputs": "RESOURCE_EXHAUSTED",
        "deadline": "DEADLINE_EXCEEDED",
        "stream with bad params": "INVALID_ARGUMENT",
        "cancelled stream": "CANCELLED",
    }
    kinds = sorted(expected) * (3 * LIMIT // len(expected))
    start = scrape(server)

    async def scenario() -> list[str]:
        async with channel(server) as ch:
            stub = pb_grpc.GenerationServiceStub(ch)
            codes = []
            # In rounds of fewer than LIMIT calls, so that only "too many inputs" is refused.
            for first in range(0, len(kinds), LIMIT // 2):
                round_kinds = kinds[first : first + LIMIT // 2]
                codes += await asyncio.gather(
                    *(failing_call(stub, k, first + i) for i, k in enumerate(round_kinds))
                )
            await asyncio.to_thread(wait_idle, server)
            await assert_limit_is_exact(stub, server)
        return codes

    codes = asyncio.run(scenario())
    end = scrape(server)
    wrong = {(k, c) for k, c in zip(kinds, codes, strict=True) if c != expected[k]}
    assert not wrong, wrong
    assert delta(end, start, VALIDATION_FAILED) >= len(kinds) // 2
    assert_clean_log(server)
