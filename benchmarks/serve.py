"""End-to-end serving benchmark: streaming GenerateStream over gRPC, like vLLM's benchmark_serving.

Starts ``text-generation-launcher`` itself (default: the embedded tiny model on free
loopback ports) or targets a running server (``--target host:port``). It builds one fixed
list of ``--num-requests`` requests and sends that same list at every level of a sweep:

* ``--concurrency 1,8,32``: closed loop, ``c`` clients each send the next request as soon as
  their previous one finished;
* ``--request-rate 2,8,inf``: open loop, requests are released at Poisson arrival times of the
  given rate (requests/s; ``inf`` sends them all at once), optionally capped by
  ``--max-concurrency`` (as in vLLM, a request's clock starts when it is actually sent);
* ``--sequential``: first a baseline that sends the same list one request at a time; every
  level then reports its speedup over it.

Workload (one of):

* synthetic: a prompt of one word (``--word``) repeated to exactly ``--input-tokens`` tokens
  (calibrated with the Tokenize RPC), and ``--output-tokens`` tokens out. With
  ``--input-range r`` / ``--output-range r`` each request draws its lengths uniformly from
  ``[n·(1−r), n·(1+r)]`` (seeded by ``--seed``). Every prompt of a length is the same
  text, which a server with prefix caching (vLLM's default) computes once; with
  ``--distinct-prompts`` each starts with its request number, so none shares a block;
* ``--dataset FILE``: JSON lines with ``prompt`` and optional ``output_tokens`` (default
  ``--output-tokens``, with ``--output-range``); rows are used in file order, cycled when the
  file has fewer than ``--num-requests`` rows.

Decoding is greedy with ``min_new_tokens = max_new_tokens`` (vLLM's ``ignore_eos``), so
every request produces exactly its output length; the script checks that and the prompt
lengths, and exits 1 when a request failed or had a wrong length.

Reported per level (the metric set of ``/work/shared/spec/performance.md`` §4.2-4.3): request
throughput, input/output/total tokens/s, and mean/median/p99 of TTFT (request sent → first
generated token), TPOT (per request (E2EL − TTFT) / (tokens − 1)), ITL (every gap between
token-carrying messages, divided by the tokens that message added, pooled over requests) and
E2EL. When the server's ``/metrics`` is reachable (always for a launched server), a breakdown
per shard step follows, and for a launched server the CPU time per output token of the router,
the shard and this client, read from ``/proc``.

Output: a Markdown report on stdout (environment header and tables), ``--json FILE`` with
everything, and ``--plot FILE.png`` (needs matplotlib, which is not a project dependency)
with latency against output throughput over the sweep.

Example::

    .venv/bin/python benchmarks/serve.py                       # embedded model, c = 1, 4, 16
    .venv/bin/python benchmarks/serve.py --sequential --concurrency 1,8,32,128 \\
        --num-requests 256 --input-tokens 128 --input-range 0.5 --output-tokens 64 \\
        --json out.json --plot out.png -- --max-batch-size 128
    .venv/bin/python benchmarks/serve.py --request-rate 1,4,inf --dataset prompts.jsonl
    .venv/bin/python benchmarks/serve.py --target 10.0.0.5:8033 --model-label llama-8b

Arguments after ``--`` are passed to the launcher unchanged (after the script's own
``--max-batch-size`` if given, so a ``--max-batch-size`` there wins).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc

from tgis.launcher.local_process import LauncherProcess, start_launcher
from tgis.pb import generation_pb2 as pb
from tgis.pb import generation_pb2_grpc as pb_grpc
from tgis.procinfo import cpu_seconds, host_busy_seconds

REPO_ROOT = Path(__file__).resolve().parent.parent
SHARD_LINE = re.compile(r"shard: (\S+) on (\S+) \((\w+), (\w+) attention\)")
# Environment variables that change the server's speed, echoed in the header when set.
TUNING_ENV = ("OMP_NUM_THREADS", "TGIS_ATTENTION_BACKEND", "TGIS_ENGINE", "TGIS_KV_CACHE_BLOCKS")
# Step metrics the router exports (sums over their label sets).
STEP_METRICS = (
    "tgi_batch_inference_duration_sum",
    "tgi_batch_inference_duration_count",
    "tgi_batch_inference_forward_duration_sum",
)


# ---- the server under test ------------------------------------------------------------------


def launch(args: argparse.Namespace, log_dir: Path) -> LauncherProcess:
    """Start the launcher on free ports with the requested model and flags."""
    extra = [] if args.max_batch_size is None else ["--max-batch-size", str(args.max_batch_size)]
    if args.model_name:
        extra += ["--model-name", args.model_name]
    if args.dtype:
        extra += ["--dtype", args.dtype]
    # The embedded model unless asked otherwise; GPU settings stay as the shell has them.
    return start_launcher(
        log_dir, [*extra, *args.launcher_args], log_name="launcher.log", max_batch_size=None
    )


def scrape_step_metrics(url: str | None) -> dict[str, float] | None:
    """The router's step counters (summed over labels), or None when unreachable."""
    if not url:
        return None
    try:
        with urllib.request.urlopen(url, timeout=10.0) as resp:
            text = resp.read().decode()
    except (OSError, urllib.error.HTTPError):
        return None
    totals = dict.fromkeys(STEP_METRICS, 0.0)
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in totals:
            totals[name] += float(line.rsplit(" ", 1)[1])
    return totals


def cpu_by_role(pids: Mapping[str, Sequence[int]]) -> dict[str, float]:
    """CPU seconds used so far by each role's processes (``/proc``), and by this process
    (``client``)."""
    seconds = {role: sum(cpu_seconds(p) for p in ps) for role, ps in pids.items()}
    seconds["client"] = time.process_time()
    return seconds


def cpu_used_since(
    before: Mapping[str, float], pids: Mapping[str, Sequence[int]]
) -> dict[str, float]:
    """CPU seconds each role (and ``client``) used since ``before``, a ``cpu_by_role``
    reading of the same ``pids``."""
    return {role: now - before[role] for role, now in cpu_by_role(pids).items()}


# ---- environment header ---------------------------------------------------------------------


def device_description() -> str:
    """The GPU torch sees, else this machine's CPU model and core count."""
    try:
        import torch

        if torch.cuda.is_available():
            names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
            return f"{len(names)}x {names[0]} (GPU)"
    except ImportError:
        pass
    model, family, cpu_model, flags = "unknown CPU", "?", "?", ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key, value = key.strip(), value.strip()
            if key == "model name" and model == "unknown CPU":
                model = value
            elif key == "cpu family" and family == "?":
                family = value
            elif key == "model" and cpu_model == "?":
                cpu_model = value
            elif key == "flags" and not flags:
                flags = value
    except OSError:
        pass
    extras = [f for f in ("avx512f", "avx512_bf16", "amx_bf16") if f in flags.split()]
    return (
        f"{model} (family {family}, model {cpu_model}; {', '.join(extras) or 'no AVX-512'}), "
        f"{os.cpu_count()} cores, no GPU"
    )


def engine_commit() -> str:
    """``git rev-parse --short HEAD``, with ``-dirty`` and the changed paths when tracked files
    have uncommitted changes."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    paths = [line[3:] for line in dirty.splitlines() if line.strip()]
    if not paths:
        return head
    shown = ", ".join(paths[:4]) + (f", … ({len(paths)} files)" if len(paths) > 4 else "")
    return f"{head}-dirty (uncommitted: {shown})"


# ---- the workload -----------------------------------------------------------------------------


@dataclass(frozen=True)
class RequestSpec:
    """One request of the benchmark's fixed list."""

    prompt: str
    input_tokens: int  # as counted by the server's Tokenize RPC
    output_tokens: int

    def to_pb(self) -> pb.SingleGenerationRequest:
        """Greedy request whose output length is forced to ``output_tokens``."""
        return build_request(self.prompt, self.output_tokens)


def build_request(prompt: str, output_tokens: int) -> pb.SingleGenerationRequest:
    """Greedy request whose output length is forced to ``output_tokens``."""
    return pb.SingleGenerationRequest(
        request=pb.GenerationRequest(text=prompt),
        params=pb.Parameters(
            method=pb.GREEDY,
            stopping=pb.StoppingCriteria(
                max_new_tokens=output_tokens, min_new_tokens=output_tokens
            ),
        ),
    )


def sample_lengths(center: int, spread: float, count: int, rng: random.Random) -> list[int]:
    """``count`` lengths drawn uniformly from ``[center·(1−spread), center·(1+spread)]`` (≥ 1)."""
    low = max(1, round(center * (1 - spread)))
    high = max(low, round(center * (1 + spread)))
    return [rng.randint(low, high) for _ in range(count)]


async def token_counts(stub: pb_grpc.GenerationServiceStub, texts: Sequence[str]) -> list[int]:
    """Token counts of ``texts`` from the server's Tokenize RPC (batched, 64 per call)."""
    counts: list[int] = []
    for start in range(0, len(texts), 64):
        batch = texts[start : start + 64]
        try:
            reply = await stub.Tokenize(
                pb.BatchedTokenizeRequest(requests=[pb.TokenizeRequest(text=t) for t in batch]),
                timeout=60,
            )
        except grpc.aio.AioRpcError as err:
            raise SystemExit(f"Tokenize failed: {err.code().name}: {err.details()}") from None
        counts += [r.token_count for r in reply.responses]
    return counts


async def calibrate_prompts(
    stub: pb_grpc.GenerationServiceStub, word: str, wanted: set[tuple[str, int]]
) -> dict[tuple[str, int], str]:
    """For each wanted (head, length), ``head`` followed by ``word`` repeated so that the
    text tokenizes to exactly ``length`` tokens."""
    guesses = {key: max(1, key[1] - len(key[0].split())) for key in wanted}
    found: dict[tuple[str, int], str] = {}
    last: dict[tuple[str, int], int] = {}

    def text_of(key: tuple[str, int]) -> str:
        words = [word] * guesses[key]
        return " ".join([key[0], *words] if key[0] else words)

    for _ in range(12):
        pending = sorted(key for key in wanted if key not in found)
        if not pending:
            return found
        texts = [text_of(key) for key in pending]
        for key, text, count in zip(pending, texts, await token_counts(stub, texts), strict=True):
            n = key[1]
            last[key] = count
            if count == n:
                found[key] = text
                continue
            step = (n - count) * guesses[key] // max(count, 1)
            step = step or (1 if n > count else -1)
            guesses[key] = max(1, guesses[key] + step)
    missing = sorted(key for key in wanted if key not in found)
    raise SystemExit(
        f"could not build prompts of exactly {[n for _, n in missing[:5]]} tokens from "
        f"{word!r} (last tries: {[last.get(k) for k in missing[:5]]} tokens); pick another "
        "--word or longer prompts"
    )


def read_dataset(path: Path) -> list[tuple[str, int | None]]:
    """(prompt, output_tokens or None) per JSON line of ``path``; blank lines are skipped."""
    rows: list[tuple[str, int | None]] = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            prompt = row["prompt"]
            out = row.get("output_tokens")
            if not isinstance(prompt, str) or not prompt:
                raise ValueError("prompt must be a non-empty string")
            if out is not None and (not isinstance(out, int) or out < 1):
                raise ValueError("output_tokens must be a positive integer")
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise SystemExit(f"{path}:{number}: {err}") from None
        rows.append((prompt, out))
    if not rows:
        raise SystemExit(f"{path}: no rows")
    return rows


async def build_workload(
    stub: pb_grpc.GenerationServiceStub, args: argparse.Namespace
) -> list[RequestSpec]:
    """The fixed request list every level sends (same order, same lengths)."""
    rng = random.Random(args.seed)
    n = args.num_requests
    outputs = sample_lengths(args.output_tokens, args.output_range, n, rng)
    if args.dataset:
        rows = read_dataset(args.dataset)
        picked = [rows[i % len(rows)] for i in range(n)]
        prompts = [p for p, _ in picked]
        counts = await token_counts(stub, prompts)
        return [
            RequestSpec(p, c, out if out is not None else outputs[i])
            for i, ((p, out), c) in enumerate(zip(picked, counts, strict=True))
        ]
    inputs = sample_lengths(args.input_tokens, args.input_range, n, rng)
    # Distinct prompts start with the request's number, so no two share even their first
    # KV block: a server with prefix caching computes every prompt, as on real traffic.
    keys = [(f"{i}:" if args.distinct_prompts else "", length) for i, length in enumerate(inputs)]
    prompts = await calibrate_prompts(stub, args.word, set(keys))
    return [RequestSpec(prompts[key], key[1], out) for key, out in zip(keys, outputs, strict=True)]


def describe_lengths(values: Sequence[int]) -> str:
    """``mean m (min a, max b)`` of a list of lengths."""
    return f"mean {statistics.fmean(values):.1f} (min {min(values)}, max {max(values)})"


# ---- one request ----------------------------------------------------------------------------


@dataclass
class RequestResult:
    """Client-side timings of one streaming request (seconds)."""

    expected_input: int = 0
    expected_output: int = 0
    ttft: float = 0.0
    e2el: float = 0.0
    input_tokens: int = 0
    output_tokens: int = 0
    itls: list[float] = field(default_factory=list)  # per token, normalised
    messages: int = 0  # token-carrying stream messages
    stop_reason: str = ""
    error: str = ""

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first, or None with fewer than two tokens."""
        if self.output_tokens < 2:
            return None
        return (self.e2el - self.ttft) / (self.output_tokens - 1)

    @property
    def wrong_length(self) -> bool:
        """The server counted a different prompt, or generated a different number of tokens."""
        return (
            self.input_tokens != self.expected_input or self.output_tokens != self.expected_output
        )


async def stream_one(
    stub: pb_grpc.GenerationServiceStub,
    request: pb.SingleGenerationRequest,
    timeout: float,
    result: RequestResult | None = None,
) -> RequestResult:
    """Send one GenerateStream request and time every token-carrying message."""
    result = result if result is not None else RequestResult()
    sent = time.perf_counter()
    last_time, last_count = 0.0, 0
    try:
        async for message in stub.GenerateStream(request, timeout=timeout):
            now = time.perf_counter()
            if message.input_token_count and not result.input_tokens:
                result.input_tokens = message.input_token_count
            count = message.generated_token_count  # cumulative in the stream
            if count > last_count:
                if last_count == 0:
                    result.ttft = now - sent
                else:
                    gap = (now - last_time) / (count - last_count)
                    result.itls.extend([gap] * (count - last_count))
                last_time, last_count = now, count
                result.messages += 1
            if message.stop_reason:
                result.stop_reason = pb.StopReason.Name(message.stop_reason)
    except grpc.aio.AioRpcError as err:
        result.error = f"{err.code().name}: {err.details()}"
        return result
    result.e2el = last_time - sent
    result.output_tokens = last_count
    if last_count == 0:
        result.error = "no tokens generated"
    return result


# ---- one level ------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolation percentile (numpy's default); NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def mean(values: Sequence[float]) -> float:
    """Arithmetic mean; NaN for no values."""
    return statistics.fmean(values) if values else math.nan


@dataclass
class Level:
    """One point of the sweep: how requests arrive."""

    label: str  # "seq", "c=8", "rate=4/s", "rate=inf"
    concurrency: int | None = None  # closed loop clients
    request_rate: float | None = None  # open loop, requests/s (inf = all at once)
    max_concurrency: int | None = None  # open loop cap


@dataclass
class LevelStats:
    """Aggregates of one level (latencies in ms, throughputs per second of level wall time)."""

    label: str
    concurrency: int | None
    request_rate: float | None
    max_concurrency: int | None
    requests: int
    completed: int
    errors: int
    wrong_length: int
    duration_s: float
    peak_in_flight: int
    input_tokens: int
    output_tokens: int
    ttft_mean: float
    ttft_p50: float
    ttft_p99: float
    tpot_mean: float
    tpot_p50: float
    tpot_p99: float
    itl_mean: float
    itl_p50: float
    itl_p99: float
    e2el_mean: float
    e2el_p50: float
    e2el_p99: float
    request_throughput: float
    input_throughput: float
    output_throughput: float
    total_throughput: float
    first_error: str = ""
    # Output tok/s of this level / that of the sequential baseline (with --sequential).
    speedup_vs_sequential: float | None = None
    # Server-side breakdown (None when unavailable).
    steps: int | None = None
    tokens_per_step: float | None = None
    wall_ms_per_step: float | None = None
    step_rpc_ms: float | None = None
    forward_ms: float | None = None
    cpu_ms_per_token: dict[str, float] = field(default_factory=dict)
    # Share of the host's cores busy with processes other than the server and this client.
    foreign_cpu_percent: float | None = None


def summarise(
    level: Level, results: list[RequestResult], duration: float, peak_in_flight: int
) -> LevelStats:
    """Means, percentiles and throughputs of one level's results."""
    ok = [r for r in results if not r.error]
    ms = 1000.0
    ttfts = [r.ttft * ms for r in ok]
    tpots = [t * ms for r in ok if (t := r.tpot) is not None]
    itls = [g * ms for r in ok for g in r.itls]
    e2els = [r.e2el * ms for r in ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.input_tokens for r in ok)
    errors = [r.error for r in results if r.error]
    return LevelStats(
        label=level.label,
        concurrency=level.concurrency,
        request_rate=level.request_rate,
        max_concurrency=level.max_concurrency,
        requests=len(results),
        completed=len(ok),
        errors=len(errors),
        wrong_length=sum(r.wrong_length for r in ok),
        duration_s=duration,
        peak_in_flight=peak_in_flight,
        input_tokens=in_tokens,
        output_tokens=out_tokens,
        ttft_mean=mean(ttfts),
        ttft_p50=percentile(ttfts, 50),
        ttft_p99=percentile(ttfts, 99),
        tpot_mean=mean(tpots),
        tpot_p50=percentile(tpots, 50),
        tpot_p99=percentile(tpots, 99),
        itl_mean=mean(itls),
        itl_p50=percentile(itls, 50),
        itl_p99=percentile(itls, 99),
        e2el_mean=mean(e2els),
        e2el_p50=percentile(e2els, 50),
        e2el_p99=percentile(e2els, 99),
        request_throughput=len(ok) / duration,
        input_throughput=in_tokens / duration,
        output_throughput=out_tokens / duration,
        total_throughput=(out_tokens + in_tokens) / duration,
        first_error=errors[0] if errors else "",
    )


def print_progress(label: str, stats: LevelStats) -> None:
    """One level's line on stderr: requests done, seconds, output tokens/s, first error."""
    print(
        f"{label}: {stats.completed}/{stats.requests} ok in {stats.duration_s:.1f} s, "
        f"{stats.output_throughput:.0f} out tok/s"
        + (f", first error: {stats.first_error}" if stats.first_error else ""),
        file=sys.stderr,
        flush=True,
    )


async def run_level(
    stubs: list[pb_grpc.GenerationServiceStub],
    specs: list[RequestSpec],
    level: Level,
    timeout: float,
    seed: int,
) -> tuple[list[RequestResult], float, int]:
    """Send every request of ``specs`` over GenerateStream as ``level`` says; (results, wall
    seconds, peak in flight)."""
    results = [RequestResult(s.input_tokens, s.output_tokens) for s in specs]
    requests = [s.to_pb() for s in specs]

    async def send(index: int) -> None:
        stub = stubs[index % len(stubs)]
        await stream_one(stub, requests[index], timeout, results[index])

    duration, peak = await drive_arrivals(send, len(specs), level, seed)
    return results, duration, peak


async def drive_arrivals(
    send: Callable[[int], Awaitable[None]], count: int, level: Level, seed: int
) -> tuple[float, int]:
    """Call ``send(i)`` for every request index as ``level`` says; (wall seconds, peak in
    flight).

    Closed loop (``level.concurrency``): that many clients take the next request as soon as
    their previous one finished. Open loop (``level.request_rate``): request ``i`` is released
    at the ``i``-th Poisson arrival (exponential gaps, seeded), all at once for ``inf``, and
    waits for a slot when ``level.max_concurrency`` is set.
    """
    in_flight = peak = 0

    async def counted(index: int) -> None:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        try:
            await send(index)
        finally:
            in_flight -= 1

    started = time.perf_counter()
    if level.concurrency is not None:
        next_index = 0

        async def client() -> None:
            nonlocal next_index
            while next_index < count:
                index = next_index
                next_index += 1
                await counted(index)

        await asyncio.gather(*(client() for _ in range(level.concurrency)))
    else:
        rate = level.request_rate or math.inf
        gate = asyncio.Semaphore(level.max_concurrency) if level.max_concurrency else None
        rng = random.Random(seed)

        async def gated(index: int) -> None:
            if gate is None:
                await counted(index)
                return
            async with gate:
                await counted(index)

        tasks: list[asyncio.Task[None]] = []
        release = 0.0
        for index in range(count):
            if index and not math.isinf(rate):
                release += rng.expovariate(rate)
                delay = started + release - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(gated(index)))
        await asyncio.gather(*tasks)
    return time.perf_counter() - started, peak


# ---- output -----------------------------------------------------------------------------------


def fmt(value: float | None, digits: int = 1) -> str:
    """A number for a table cell; an en dash for missing values."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return f"{value:.{digits}f}"


def markdown_tables(levels: list[LevelStats]) -> str:
    """Throughput table, latency table and, when available, the server breakdown table."""
    has_speedup = any(s.speedup_vs_sequential is not None for s in levels)
    lines = [
        "| level | ok/req | peak in flight | duration s | req/s | in tok/s | out tok/s | "
        "total tok/s |" + (" out tok/s vs seq |" if has_speedup else ""),
        "|---|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if has_speedup else ""),
    ]
    for s in levels:
        row = (
            f"| {s.label} | {s.completed}/{s.requests} | {s.peak_in_flight} | "
            f"{fmt(s.duration_s, 1)} | {fmt(s.request_throughput, 2)} | "
            f"{fmt(s.input_throughput, 0)} | {fmt(s.output_throughput, 0)} | "
            f"{fmt(s.total_throughput, 0)} |"
        )
        if has_speedup:
            row += f" {fmt(s.speedup_vs_sequential, 2)}× |"
        lines.append(row)
    lines += [
        "",
        "| level | TTFT mean | TTFT p50 | TTFT p99 | TPOT mean | TPOT p50 | TPOT p99 | "
        "ITL mean | ITL p50 | ITL p99 | E2EL mean | E2EL p50 | E2EL p99 |",
        "|---|" + "---:|" * 12,
    ]
    for s in levels:
        lines.append(
            f"| {s.label} | {fmt(s.ttft_mean)} | {fmt(s.ttft_p50)} | {fmt(s.ttft_p99)} | "
            f"{fmt(s.tpot_mean, 2)} | {fmt(s.tpot_p50, 2)} | {fmt(s.tpot_p99, 2)} | "
            f"{fmt(s.itl_mean, 2)} | {fmt(s.itl_p50, 2)} | {fmt(s.itl_p99, 2)} | "
            f"{fmt(s.e2el_mean, 0)} | {fmt(s.e2el_p50, 0)} | {fmt(s.e2el_p99, 0)} |"
        )
    lines.append("")
    lines.append(
        "Latencies in ms; p50 is the median. TPOT = (E2EL − TTFT) / (tokens − 1) per request; "
        "ITL = gap between streamed messages / tokens in the message, pooled over requests."
    )
    if any(s.steps is not None for s in levels):
        roles = sorted({r for s in levels for r in s.cpu_ms_per_token})
        head = "| level | steps | tok/step | wall ms/step | Step RPC ms | forward ms |"
        head += "".join(f" {r} CPU ms/tok |" for r in roles) + " other load % |"
        lines += ["", head, "|---|" + "---:|" * (6 + len(roles))]
        for s in levels:
            row = (
                f"| {s.label} | {s.steps if s.steps is not None else '–'} | "
                f"{fmt(s.tokens_per_step, 2)} | {fmt(s.wall_ms_per_step, 2)} | "
                f"{fmt(s.step_rpc_ms, 2)} | {fmt(s.forward_ms, 2)} |"
            )
            row += "".join(f" {fmt(s.cpu_ms_per_token.get(r), 3)} |" for r in roles)
            row += f" {fmt(s.foreign_cpu_percent, 0)} |"
            lines.append(row)
        lines.append("")
        lines.append(
            "Per shard step (router metrics): wall = level time / steps; Step RPC = router-timed "
            "Step call; forward = shard-timed flatten + attention prepare + model + sampling. "
            "CPU ms/tok = process CPU time / output tokens. Other load = share of all cores "
            "busy with processes other than the server and this client (noise indicator)."
        )
    return "\n".join(lines)


def json_safe(value: Any) -> Any:
    """``value`` with infinite floats as ``"inf"`` and NaN as ``None`` (strict JSON)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value


def header_lines(env: dict[str, Any]) -> str:
    """The environment header as Markdown bullet points."""
    return "\n".join(f"- **{key}**: {value}" for key, value in env.items())


def plot_available() -> bool:
    """Whether matplotlib can be imported (it is not a dependency of the project)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def write_plot(levels: list[LevelStats], path: Path, title: str) -> None:
    """Latency against output throughput, one point per level, to a PNG file."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    panels = (
        ("TTFT (ms)", (("p50", "ttft_p50"), ("p99", "ttft_p99"))),
        ("TPOT (ms)", (("mean", "tpot_mean"), ("p99", "tpot_p99"))),
        ("ITL (ms)", (("p50", "itl_p50"), ("p99", "itl_p99"))),
    )
    sweep = [s for s in levels if s.label != "seq"]
    baseline = [s for s in levels if s.label == "seq"]
    for ax, (ylabel, series) in zip(axes, panels, strict=True):
        for name, attr in series:
            xs = [s.output_throughput for s in sweep]
            ys = [getattr(s, attr) for s in sweep]
            (line,) = ax.plot(xs, ys, marker="o", label=name)
            for s, x, y in zip(sweep, xs, ys, strict=True):
                ax.annotate(s.label, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
            for s in baseline:
                ax.plot(
                    [s.output_throughput],
                    [getattr(s, attr)],
                    marker="s",
                    markerfacecolor="none",
                    color=line.get_color(),
                    ls="",
                    label=f"{name}, sequential",
                )
        ax.set_xlabel("output tokens/s")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- main -------------------------------------------------------------------------------------


def parse_rates(text: str) -> list[float]:
    """``"1,4.5,inf"`` → ``[1.0, 4.5, inf]``; every rate must be positive."""
    rates = [float(r) for r in text.split(",") if r.strip()]
    if not rates or min(rates) <= 0 or any(math.isnan(r) for r in rates):
        raise ValueError(text)
    return rates


def effective_batch_size(args: argparse.Namespace) -> str:
    """The launched server's ``--max-batch-size``: the last one given after ``--`` wins;
    "by capacity" when none is given (the launcher's default)."""
    value = args.max_batch_size
    extra = args.launcher_args
    for i, arg in enumerate(extra):
        if arg == "--max-batch-size" and i + 1 < len(extra):
            value = int(extra[i + 1])
        elif arg.startswith("--max-batch-size="):
            value = int(arg.split("=", 1)[1])
    return "by capacity (launcher default)" if value is None else str(value)


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Command line; everything after ``--`` goes to the launcher."""
    launcher_args: list[str] = []
    if "--" in argv:
        split = argv.index("--")
        argv, launcher_args = argv[:split], argv[split + 1 :]
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n", 1)[0] if __doc__ else None,
        epilog="Arguments after `--` are passed to text-generation-launcher unchanged.",
    )
    server = parser.add_argument_group("server")
    server.add_argument("--target", help="host:port of a running server (default: launch one)")
    server.add_argument("--metrics-url", help="/metrics URL of --target (for the breakdown)")
    server.add_argument("--model-name", help="model for the launched server (default: embedded)")
    server.add_argument("--model-label", help="model name to print (default: derived)")
    server.add_argument("--dtype", help="--dtype for the launched server (default: its own)")
    server.add_argument(
        "--max-batch-size",
        type=int,
        default=None,
        help="launched server's batch size (default: the launcher's, by capacity)",
    )
    server.add_argument(
        "--startup-timeout", type=float, default=600.0, help="seconds to wait for /health"
    )
    sweep = parser.add_argument_group("arrival (one of --concurrency / --request-rate)")
    sweep.add_argument(
        "--concurrency", help="closed loop: comma-separated client counts (default 1,4,16)"
    )
    sweep.add_argument(
        "--request-rate",
        help="open loop: comma-separated Poisson rates in requests/s, `inf` = all at once",
    )
    sweep.add_argument(
        "--max-concurrency", type=int, help="open loop: at most this many requests in flight"
    )
    sweep.add_argument(
        "--sequential",
        action="store_true",
        help="first send the same requests one at a time, as the baseline of every level",
    )
    sweep.add_argument("--num-requests", type=int, default=32, help="requests per level (32)")
    sweep.add_argument("--warmup", type=int, default=2, help="warm-up requests (2)")
    sweep.add_argument(
        "--request-timeout", type=float, default=300.0, help="seconds per request (300)"
    )
    work = parser.add_argument_group("workload")
    work.add_argument("--input-tokens", type=int, default=128, help="prompt tokens (128)")
    work.add_argument(
        "--input-range", type=float, default=0.0, help="uniform ±fraction of --input-tokens (0)"
    )
    work.add_argument("--output-tokens", type=int, default=128, help="output tokens (128)")
    work.add_argument(
        "--output-range", type=float, default=0.0, help="uniform ±fraction of --output-tokens (0)"
    )
    work.add_argument(
        "--dataset", type=Path, help="JSONL with `prompt` and optional `output_tokens` per line"
    )
    work.add_argument("--word", default="the", help="word repeated to build prompts (the)")
    work.add_argument(
        "--distinct-prompts",
        action="store_true",
        help="start each synthetic prompt with its request number (no prefix shared between "
        "requests; without it every prompt of a length is the same text)",
    )
    work.add_argument("--seed", type=int, default=0, help="seed of lengths and arrivals (0)")
    out = parser.add_argument_group("output")
    out.add_argument("--json", type=Path, help="also write the results here")
    out.add_argument("--plot", type=Path, help="latency-vs-throughput PNG (needs matplotlib)")
    args = parser.parse_args(argv)
    args.launcher_args = launcher_args
    if args.concurrency and args.request_rate:
        parser.error("--concurrency and --request-rate are alternatives; give one")
    levels: list[Level] = []
    if args.request_rate:
        try:
            rates = parse_rates(args.request_rate)
        except ValueError:
            parser.error("--request-rate takes comma-separated positive numbers or `inf`")
        if args.max_concurrency is not None and args.max_concurrency < 1:
            parser.error("--max-concurrency must be positive")
        for rate in rates:
            label = "rate=inf" if math.isinf(rate) else f"rate={rate:g}/s"
            if args.max_concurrency:
                label += f" (max {args.max_concurrency})"
            levels.append(Level(label, request_rate=rate, max_concurrency=args.max_concurrency))
    else:
        if args.max_concurrency is not None:
            parser.error("--max-concurrency caps --request-rate levels only")
        try:
            counts = [int(c) for c in (args.concurrency or "1,4,16").split(",") if c.strip()]
        except ValueError:
            parser.error("--concurrency takes comma-separated integers")
        if not counts or min(counts) < 1:
            parser.error("concurrency levels must be positive")
        levels = [Level(f"c={c}", concurrency=c) for c in counts]
    args.levels = levels
    if args.num_requests < 1 or args.warmup < 0:
        parser.error("--num-requests must be positive and --warmup not negative")
    if args.output_tokens < 2 or args.input_tokens < 1:
        parser.error("--output-tokens must be >= 2 and --input-tokens >= 1")
    if not (0 <= args.input_range < 1 and 0 <= args.output_range < 1):
        parser.error("--input-range and --output-range must be in [0, 1)")
    if args.dataset and not args.dataset.is_file():
        parser.error(f"--dataset {args.dataset}: no such file")
    if args.target and (args.model_name or args.dtype or launcher_args):
        parser.error("--model-name, --dtype and launcher arguments need a launched server")
    if args.plot and not plot_available():
        parser.error(
            "--plot needs matplotlib, which is not installed in this environment (it is not a "
            "dependency of the project): install it (`.venv/bin/pip install matplotlib`) or "
            "drop --plot and plot from --json"
        )
    return args


async def benchmark(
    args: argparse.Namespace, target: str, metrics_url: str | None, server: LauncherProcess | None
) -> tuple[list[LevelStats], list[RequestSpec]]:
    """Build the workload, warm up, then run the baseline (if asked) and every level."""
    widest = max([lv.concurrency or lv.max_concurrency or args.num_requests for lv in args.levels])
    channels = [grpc.aio.insecure_channel(target) for _ in range(max(1, widest // 64))]
    try:
        stubs = [pb_grpc.GenerationServiceStub(ch) for ch in channels]
        specs = await build_workload(stubs[0], args)
        for i in range(args.warmup):
            spec = specs[i % len(specs)]
            warm = await stream_one(
                stubs[0],
                spec.to_pb(),
                args.request_timeout,
                RequestResult(spec.input_tokens, spec.output_tokens),
            )
            if warm.error:
                raise SystemExit(f"warm-up request failed: {warm.error}")
            if warm.wrong_length:
                raise SystemExit(
                    f"warm-up: server counted {warm.input_tokens} prompt / {warm.output_tokens} "
                    f"output tokens, expected {spec.input_tokens} / {spec.output_tokens}"
                )
        plan = ([Level("seq", concurrency=1)] if args.sequential else []) + args.levels
        levels: list[LevelStats] = []
        for index, level in enumerate(plan):
            pids = server.process_pids() if server else {}
            before_cpu = cpu_by_role(pids)
            before_host = host_busy_seconds()
            before = scrape_step_metrics(metrics_url)
            results, duration, peak = await run_level(
                stubs, specs, level, args.request_timeout, args.seed + index
            )
            after = scrape_step_metrics(metrics_url)
            host_used = host_busy_seconds() - before_host
            stats = summarise(level, results, duration, peak)
            out_tokens = stats.output_tokens
            if before and after:
                steps = int(after[STEP_METRICS[1]] - before[STEP_METRICS[1]])
                if steps:
                    stats.steps = steps
                    stats.tokens_per_step = out_tokens / steps
                    stats.wall_ms_per_step = duration * 1000 / steps
                    stats.step_rpc_ms = (after[STEP_METRICS[0]] - before[STEP_METRICS[0]]) * (
                        1000 / steps
                    )
                    stats.forward_ms = (after[STEP_METRICS[2]] - before[STEP_METRICS[2]]) * (
                        1000 / steps
                    )
            used = cpu_used_since(before_cpu, pids)
            if out_tokens:
                for role, seconds in used.items():
                    stats.cpu_ms_per_token[role] = seconds * 1000 / out_tokens
            if server is not None:
                foreign = max(0.0, host_used - sum(used.values()))
                stats.foreign_cpu_percent = 100 * foreign / (duration * (os.cpu_count() or 1))
            levels.append(stats)
            print_progress(level.label, stats)
        if args.sequential and levels[0].output_throughput > 0:
            for s in levels:
                s.speedup_vs_sequential = s.output_throughput / levels[0].output_throughput
        return levels, specs
    finally:
        for ch in channels:
            await ch.close()


def workload_lines(args: argparse.Namespace, specs: list[RequestSpec]) -> dict[str, str]:
    """Header entries that describe the request list actually sent."""
    ins = [s.input_tokens for s in specs]
    outs = [s.output_tokens for s in specs]
    if args.dataset:
        source = f"dataset {args.dataset} (file order, cycled)"
    else:
        source = f"synthetic {args.word!r} x N, {args.input_tokens} ± {args.input_range:.0%}"
        source += (
            ", each headed by its request number (no shared prefix)"
            if args.distinct_prompts
            else ", the same text for every prompt of a length (a prefix cache reuses it)"
        )
    return {
        "prompts": f"{source}; prompt tokens {describe_lengths(ins)}",
        "outputs": (
            f"{args.output_tokens} ± {args.output_range:.0%} (unless the dataset says); "
            f"output tokens {describe_lengths(outs)}; greedy, min_new_tokens = max_new_tokens"
        ),
    }


def arrival_line(args: argparse.Namespace) -> str:
    """Header entry describing how requests were released."""
    if args.request_rate:
        text = f"open loop, Poisson arrivals at {args.request_rate} req/s (seed {args.seed})"
        if args.max_concurrency:
            text += f", at most {args.max_concurrency} in flight"
    else:
        text = f"closed loop, c = {args.concurrency or '1,4,16'} concurrent streaming clients"
    if args.sequential:
        text += "; baseline `seq`: the same requests one at a time"
    return text + " (grpc.aio, same host)"


def main(argv: list[str] | None = None) -> int:
    """Run the sweep; exit 1 when any request failed or had the wrong length."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    server: LauncherProcess | None = None
    log_dir = Path(tempfile.mkdtemp(prefix="tgis-bench-log-"))
    env: dict[str, Any] = {}
    levels: list[LevelStats] = []
    specs: list[RequestSpec] = []
    try:
        if args.target:
            target, metrics_url = args.target, args.metrics_url
        else:
            server = launch(args, log_dir)
            print(f"launcher: {' '.join(server.args)}", file=sys.stderr, flush=True)
            started = time.monotonic()
            server.wait_healthy(args.startup_timeout)
            print(f"server healthy after {time.monotonic() - started:.1f} s", file=sys.stderr)
            target, metrics_url = server.grpc_target, server.metrics_url
        shard = SHARD_LINE.search(server.log_tail(10**9)) if server else None
        env = {
            "device": device_description()
            + (" (client host; the server is remote)" if args.target else ""),
            "model": args.model_label
            or args.model_name
            or ("embedded tiny Llama (4 layers, hidden 256, ~4M params)" if server else "?"),
            "dtype / attention / device": (
                f"{shard.group(3)} / {shard.group(4)} / {shard.group(2)}" if shard else "unknown"
            ),
            "engine commit": engine_commit(),
            "max batch size": effective_batch_size(args) if server else "server's own",
            "launcher extra args": " ".join(args.launcher_args) or "none",
            "tuning env": " ".join(f"{k}={os.environ[k]}" for k in TUNING_ENV if k in os.environ)
            or "none set",
        }
        env_time = {
            "host load average (1/5/15 min) at start": " / ".join(
                f"{x:.2f}" for x in os.getloadavg()
            ),
            "software": (
                f"Python {platform.python_version()}, grpcio {grpc.__version__}, "
                f"torch {_torch_version()}"
            ),
        }
        levels, specs = asyncio.run(benchmark(args, target, metrics_url, server))
        env |= workload_lines(args, specs)
        env |= {
            "requests per level": f"{args.num_requests} (+{args.warmup} warm-up before the sweep)",
            "arrival": arrival_line(args),
        }
        env |= env_time
    except (RuntimeError, TimeoutError) as err:  # the server died or never became healthy
        print(f"error: {err}", file=sys.stderr)
        return 1
    finally:
        if server is not None:
            code = server.stop()
            print(f"launcher stopped (exit code {code})", file=sys.stderr)
            if code != 0:
                print(server.log_tail(4000), file=sys.stderr)
        shutil.rmtree(log_dir, ignore_errors=True)
    print("## Environment\n")
    print(header_lines(env))
    print("\n## Results\n")
    print(markdown_tables(levels))
    if args.json:
        config = {k: v for k, v in vars(args).items() if k not in ("json", "levels")}
        args.json.write_text(
            json.dumps(
                json_safe(
                    {
                        "environment": env,
                        "config": config,
                        "levels": [asdict(s) for s in levels],
                        "request_lengths": [[s.input_tokens, s.output_tokens] for s in specs],
                    }
                ),
                indent=2,
                default=str,
                allow_nan=False,
            )
        )
    if args.plot:
        title = f"{env.get('model', '?')} — {env.get('device', '?')} — {env.get('engine commit')}"
        write_plot(levels, args.plot, title)
        print(f"plot written to {args.plot}", file=sys.stderr)
    failed = sum(s.errors + s.wrong_length for s in levels)
    if failed:
        print(f"{failed} request(s) failed or had the wrong length", file=sys.stderr)
    return 1 if failed else 0


def _torch_version() -> str:
    try:
        import torch

        return str(torch.__version__)
    except ImportError:
        return "not installed"


if __name__ == "__main__":
    sys.exit(main())
