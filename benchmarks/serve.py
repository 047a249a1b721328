"""End-to-end serving benchmark: streaming GenerateStream over gRPC, concurrency sweep.

Starts ``text-generation-launcher`` itself (default: the embedded tiny model on free
loopback ports) or targets a running server (``--target host:port``), then for each
concurrency level ``c`` runs a closed loop of ``c`` clients that issue a fixed number of
streaming requests back to back. Every request has a synthetic prompt of exactly
``--input-tokens`` tokens (one word repeated, calibrated with the Tokenize RPC) and produces
exactly ``--output-tokens`` tokens (greedy, ``min_new_tokens = max_new_tokens`` so EOS cannot
end it early).

Reported per level (the metric set of ``/work/shared/spec/performance.md`` §4.3):

* TTFT p50/p99: request sent → first message carrying a generated token;
* TPOT mean/p50/p99: per request (E2EL − TTFT) / (tokens − 1);
* ITL p50/p99: every gap between consecutive token-carrying messages, divided by the
  tokens that message added, pooled over all requests;
* E2EL p50/p99: request sent → last token;
* requests/s, output tokens/s, total (prompt + output) tokens/s over the level's wall time.

When the server's ``/metrics`` is reachable (always for a launched server; ``--metrics-url``
otherwise) each level also gets a breakdown of where the time went: shard steps, tokens per
step, wall time per step, the router-observed Step RPC time and the shard-reported forward
time per step, and (launched server only) CPU milliseconds per output token spent in the
router, the shard and this client, read from ``/proc``.

Example::

    .venv/bin/python benchmarks/serve.py                       # embedded model, c = 1, 4, 16
    .venv/bin/python benchmarks/serve.py --concurrency 1,8 --num-requests 32 \\
        --input-tokens 512 --output-tokens 64 --json out.json -- --dtype bfloat16
    .venv/bin/python benchmarks/serve.py --target 10.0.0.5:8033 --model-label llama-8b

Arguments after ``--`` are passed to the launcher unchanged.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc

from tgis.pb import generation_pb2 as pb
from tgis.pb import generation_pb2_grpc as pb_grpc

REPO_ROOT = Path(__file__).resolve().parent.parent
BIN_DIR = Path(sys.executable).parent
CLK_TCK = os.sysconf("SC_CLK_TCK")
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


def free_port() -> int:
    """A TCP port on the loopback interface that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def descendants(pid: int) -> set[int]:
    """Every live descendant process of ``pid``, read from /proc."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        parents[int(entry.name)] = int(stat[stat.rindex(")") + 2 :].split()[1])
    found: set[int] = set()
    frontier = {pid}
    while frontier:
        frontier = {p for p, pp in parents.items() if pp in frontier} - found
        found |= frontier
    return found


def host_busy_seconds() -> float:
    """CPU seconds all cores of this host have spent busy since boot (/proc/stat)."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    except OSError:
        return 0.0
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(f) for f in fields[:8])
    return (user + nice + system + irq + softirq + steal) / CLK_TCK


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (all its threads); 0 if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


@dataclass
class LaunchedServer:
    """A ``text-generation-launcher`` this script started (its own session)."""

    proc: subprocess.Popen[bytes]
    grpc_port: int
    http_port: int
    log_path: Path
    socket_dir: Path
    argv: list[str]

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/metrics"

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def wait_healthy(self, timeout: float) -> None:
        """Poll ``/health`` until it answers 200; raise with the log tail otherwise."""
        deadline = time.monotonic() + timeout
        url = f"http://127.0.0.1:{self.http_port}/health"
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"launcher exited with {self.proc.returncode}:\n{self.log_text()[-4000:]}"
                )
            try:
                with urllib.request.urlopen(url, timeout=5.0) as resp:
                    if resp.status == 200:
                        return
            except (OSError, urllib.error.HTTPError):
                pass
            time.sleep(0.5)
        raise TimeoutError(f"server not healthy after {timeout:.0f} s:\n{self.log_text()[-4000:]}")

    def process_pids(self) -> dict[str, list[int]]:
        """The router and shard process ids, found by their command lines."""
        roles: dict[str, list[int]] = {"router": [], "shard": []}
        for pid in descendants(self.proc.pid):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
            except OSError:
                continue
            if b"text-generation-router" in cmdline:
                roles["router"].append(pid)
            elif b"text-generation-server" in cmdline or b"tgis.shard" in cmdline:
                roles["shard"].append(pid)
        return roles

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM the launcher (it stops router and shards); SIGKILL its group if it hangs."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        shutil.rmtree(self.socket_dir, ignore_errors=True)
        return int(self.proc.returncode)


def launch(args: argparse.Namespace, log_dir: Path) -> LaunchedServer:
    """Start the launcher on free ports with the requested model and flags."""
    grpc_port, http_port = free_port(), free_port()
    socket_dir = Path(tempfile.mkdtemp(prefix="tgis-bench-", dir="/tmp"))  # short UDS paths
    argv = [
        str(BIN_DIR / "text-generation-launcher"),
        "--grpc-port",
        str(grpc_port),
        "--port",
        str(http_port),
        "--shard-uds-path",
        str(socket_dir / "shard"),
        "--master-port",
        str(free_port()),
        "--max-batch-size",
        str(args.max_batch_size),
    ]
    if args.model_name:
        argv += ["--model-name", args.model_name]
    if args.dtype:
        argv += ["--dtype", args.dtype]
    argv += args.launcher_args
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if not args.model_name:
        env.pop("MODEL_NAME", None)  # the embedded model unless asked otherwise
    log_path = log_dir / "launcher.log"
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(
            argv, stdout=log_file, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    return LaunchedServer(proc, grpc_port, http_port, log_path, socket_dir, argv)


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
    """``git rev-parse --short HEAD``, with ``-dirty`` when tracked files have changes."""
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
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return f"{head}-dirty" if dirty else head


# ---- one request ----------------------------------------------------------------------------


@dataclass
class RequestResult:
    """Client-side timings of one streaming request (seconds)."""

    ttft: float = 0.0
    e2el: float = 0.0
    input_tokens: int = 0
    output_tokens: int = 0
    itls: list[float] = field(default_factory=list)  # per token, normalised
    stop_reason: str = ""
    error: str = ""

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2el - self.ttft) / (self.output_tokens - 1)


async def stream_one(
    stub: pb_grpc.GenerationServiceStub, request: pb.SingleGenerationRequest, timeout: float
) -> RequestResult:
    """Send one GenerateStream request and time every token-carrying message."""
    result = RequestResult()
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


# ---- one concurrency level ------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolation percentile (numpy's default); NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass
class LevelStats:
    """Aggregates of one concurrency level (latencies in ms)."""

    concurrency: int
    requests: int
    completed: int
    errors: int
    wrong_length: int
    duration_s: float
    ttft_p50: float
    ttft_p99: float
    tpot_mean: float
    tpot_p50: float
    tpot_p99: float
    itl_p50: float
    itl_p99: float
    e2el_p50: float
    e2el_p99: float
    request_throughput: float
    output_throughput: float
    total_throughput: float
    first_error: str = ""
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
    concurrency: int, results: list[RequestResult], duration: float, expected_output: int
) -> LevelStats:
    """Percentiles and throughputs of one level's results."""
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
        concurrency=concurrency,
        requests=len(results),
        completed=len(ok),
        errors=len(errors),
        wrong_length=sum(r.output_tokens != expected_output for r in ok),
        duration_s=duration,
        ttft_p50=percentile(ttfts, 50),
        ttft_p99=percentile(ttfts, 99),
        tpot_mean=statistics.fmean(tpots) if tpots else math.nan,
        tpot_p50=percentile(tpots, 50),
        tpot_p99=percentile(tpots, 99),
        itl_p50=percentile(itls, 50),
        itl_p99=percentile(itls, 99),
        e2el_p50=percentile(e2els, 50),
        e2el_p99=percentile(e2els, 99),
        request_throughput=len(ok) / duration,
        output_throughput=out_tokens / duration,
        total_throughput=(out_tokens + in_tokens) / duration,
        first_error=errors[0] if errors else "",
    )


async def run_level(
    stubs: list[pb_grpc.GenerationServiceStub],
    request: pb.SingleGenerationRequest,
    concurrency: int,
    num_requests: int,
    timeout: float,
) -> tuple[list[RequestResult], float]:
    """``concurrency`` closed-loop clients sharing ``num_requests`` requests."""
    results: list[RequestResult] = []
    issued = 0

    async def client(index: int) -> None:
        nonlocal issued
        stub = stubs[index % len(stubs)]
        while issued < num_requests:
            issued += 1
            results.append(await stream_one(stub, request, timeout))

    started = time.perf_counter()
    await asyncio.gather(*(client(i) for i in range(concurrency)))
    return results, time.perf_counter() - started


# ---- prompt -----------------------------------------------------------------------------------


async def calibrate_prompt(
    stub: pb_grpc.GenerationServiceStub, word: str, tokens: int
) -> tuple[str, int]:
    """A prompt of ``word`` repeated that tokenizes to exactly ``tokens`` tokens."""
    words = tokens
    count = 0
    for _ in range(8):
        text = " ".join([word] * max(words, 1))
        try:
            reply = await stub.Tokenize(
                pb.BatchedTokenizeRequest(requests=[pb.TokenizeRequest(text=text)]), timeout=30
            )
        except grpc.aio.AioRpcError as err:
            raise SystemExit(f"Tokenize failed: {err.code().name}: {err.details()}") from None
        count = reply.responses[0].token_count
        if count == tokens:
            return text, count
        words = max(1, words + (tokens - count) * words // max(count, 1))
    raise SystemExit(
        f"could not build a prompt of exactly {tokens} tokens from {word!r} "
        f"(last try: {count} tokens); pick another --word"
    )


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


# ---- output -----------------------------------------------------------------------------------


def fmt(value: float | None, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return f"{value:.{digits}f}"


def markdown_tables(levels: list[LevelStats]) -> str:
    """The latency/throughput table and, when available, the server breakdown table."""
    lines = [
        "| c | ok/req | TTFT p50 | TTFT p99 | TPOT mean | TPOT p50 | TPOT p99 | ITL p50 | "
        "ITL p99 | E2EL p50 | E2EL p99 | req/s | out tok/s | total tok/s |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s in levels:
        lines.append(
            f"| {s.concurrency} | {s.completed}/{s.requests} | {fmt(s.ttft_p50)} | "
            f"{fmt(s.ttft_p99)} | {fmt(s.tpot_mean, 2)} | {fmt(s.tpot_p50, 2)} | "
            f"{fmt(s.tpot_p99, 2)} | {fmt(s.itl_p50, 2)} | {fmt(s.itl_p99, 2)} | "
            f"{fmt(s.e2el_p50, 0)} | {fmt(s.e2el_p99, 0)} | {fmt(s.request_throughput, 2)} | "
            f"{fmt(s.output_throughput, 0)} | {fmt(s.total_throughput, 0)} |"
        )
    lines.append("")
    lines.append("Latencies in ms. ITL = gap between streamed messages / tokens in the message.")
    if any(s.steps is not None for s in levels):
        roles = sorted({r for s in levels for r in s.cpu_ms_per_token})
        head = "| c | steps | tok/step | wall ms/step | Step RPC ms | forward ms |"
        head += "".join(f" {r} CPU ms/tok |" for r in roles) + " other load % |"
        lines += ["", head, "|---:" * (7 + len(roles)) + "|"]
        for s in levels:
            row = (
                f"| {s.concurrency} | {s.steps if s.steps is not None else '–'} | "
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


def header_lines(env: dict[str, Any]) -> str:
    """The environment header as Markdown bullet points."""
    return "\n".join(f"- **{key}**: {value}" for key, value in env.items())


# ---- main -------------------------------------------------------------------------------------


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
    parser.add_argument("--target", help="host:port of a running server (default: launch one)")
    parser.add_argument("--metrics-url", help="/metrics URL of --target (for the breakdown)")
    parser.add_argument("--model-name", help="model for the launched server (default: embedded)")
    parser.add_argument("--model-label", help="model name to print (default: derived)")
    parser.add_argument("--dtype", help="--dtype for the launched server (default: its own)")
    parser.add_argument(
        "--max-batch-size", type=int, default=16, help="launched server's batch size (16)"
    )
    parser.add_argument(
        "--concurrency", default="1,4,16", help="comma-separated levels (default 1,4,16)"
    )
    parser.add_argument("--num-requests", type=int, default=32, help="requests per level (32)")
    parser.add_argument("--input-tokens", type=int, default=128, help="prompt tokens (128)")
    parser.add_argument("--output-tokens", type=int, default=128, help="output tokens (128)")
    parser.add_argument("--warmup", type=int, default=2, help="warm-up requests (2)")
    parser.add_argument("--word", default="the", help="word repeated to build the prompt (the)")
    parser.add_argument(
        "--request-timeout", type=float, default=300.0, help="seconds per request (300)"
    )
    parser.add_argument(
        "--startup-timeout", type=float, default=600.0, help="seconds to wait for /health"
    )
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    args.launcher_args = launcher_args
    try:
        args.levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    except ValueError:
        parser.error("--concurrency takes comma-separated integers")
    if not args.levels or min(args.levels) < 1 or args.num_requests < 1:
        parser.error("concurrency levels and --num-requests must be positive")
    if args.output_tokens < 2 or args.input_tokens < 1:
        parser.error("--output-tokens must be >= 2 and --input-tokens >= 1")
    if args.target and (args.model_name or args.dtype or launcher_args):
        parser.error("--model-name, --dtype and launcher arguments need a launched server")
    return args


async def benchmark(
    args: argparse.Namespace, target: str, metrics_url: str | None, server: LaunchedServer | None
) -> list[LevelStats]:
    """Calibrate the prompt, warm up, then run every level."""
    channels = [grpc.aio.insecure_channel(target) for _ in range(max(1, max(args.levels) // 64))]
    try:
        stubs = [pb_grpc.GenerationServiceStub(ch) for ch in channels]
        prompt, _ = await calibrate_prompt(stubs[0], args.word, args.input_tokens)
        request = build_request(prompt, args.output_tokens)
        for _ in range(args.warmup):
            warm = await stream_one(stubs[0], request, args.request_timeout)
            if warm.error:
                raise SystemExit(f"warm-up request failed: {warm.error}")
            if warm.input_tokens != args.input_tokens:
                raise SystemExit(
                    f"server counted {warm.input_tokens} prompt tokens, expected "
                    f"{args.input_tokens}"
                )
        levels: list[LevelStats] = []
        for c in args.levels:
            pids = server.process_pids() if server else {}
            before_cpu = {r: sum(cpu_seconds(p) for p in ps) for r, ps in pids.items()}
            before_client = time.process_time()
            before_host = host_busy_seconds()
            before = scrape_step_metrics(metrics_url)
            results, duration = await run_level(
                stubs, request, c, args.num_requests, args.request_timeout
            )
            after = scrape_step_metrics(metrics_url)
            host_used = host_busy_seconds() - before_host
            stats = summarise(c, results, duration, args.output_tokens)
            out_tokens = sum(r.output_tokens for r in results if not r.error)
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
            used = {
                role: sum(cpu_seconds(p) for p in ps) - before_cpu[role]
                for role, ps in pids.items()
            }
            used["client"] = time.process_time() - before_client
            if out_tokens:
                for role, seconds in used.items():
                    stats.cpu_ms_per_token[role] = seconds * 1000 / out_tokens
            if server is not None:
                foreign = max(0.0, host_used - sum(used.values()))
                stats.foreign_cpu_percent = 100 * foreign / (duration * (os.cpu_count() or 1))
            levels.append(stats)
            print(
                f"c={c}: {stats.completed}/{stats.requests} ok in {duration:.1f} s, "
                f"{stats.output_throughput:.0f} out tok/s"
                + (f", first error: {stats.first_error}" if stats.first_error else ""),
                file=sys.stderr,
                flush=True,
            )
        return levels
    finally:
        for ch in channels:
            await ch.close()


def main(argv: list[str] | None = None) -> int:
    """Run the sweep; exit 1 when any request failed or had the wrong length."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    server: LaunchedServer | None = None
    log_dir = Path(tempfile.mkdtemp(prefix="tgis-bench-log-"))
    env: dict[str, Any] = {}
    try:
        if args.target:
            target, metrics_url = args.target, args.metrics_url
        else:
            server = launch(args, log_dir)
            print(f"launcher: {' '.join(server.argv)}", file=sys.stderr, flush=True)
            started = time.monotonic()
            server.wait_healthy(args.startup_timeout)
            print(f"server healthy after {time.monotonic() - started:.1f} s", file=sys.stderr)
            target, metrics_url = server.target, server.metrics_url
        shard = SHARD_LINE.search(server.log_text()) if server else None
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
            "max batch size": args.max_batch_size if server else "server's own",
            "launcher extra args": " ".join(args.launcher_args) or "none",
            "tuning env": " ".join(f"{k}={os.environ[k]}" for k in TUNING_ENV if k in os.environ)
            or "none set",
            "prompt / output tokens": (
                f"{args.input_tokens} / {args.output_tokens} (synthetic {args.word!r} x N, "
                "greedy, min_new_tokens = max_new_tokens)"
            ),
            "requests per level": f"{args.num_requests} (+{args.warmup} warm-up before the sweep)",
            "arrival": "closed loop, c concurrent streaming clients (grpc.aio, same host)",
            "prefix caching": "none in this engine (every request has the same prompt)",
            "host load average (1/5/15 min) at start": " / ".join(
                f"{x:.2f}" for x in os.getloadavg()
            ),
            "software": (
                f"Python {platform.python_version()}, grpcio {grpc.__version__}, "
                f"torch {_torch_version()}"
            ),
        }
        levels = asyncio.run(benchmark(args, target, metrics_url, server))
    finally:
        if server is not None:
            code = server.stop()
            print(f"launcher stopped (exit code {code})", file=sys.stderr)
            if code != 0:
                print(server.log_text()[-4000:], file=sys.stderr)
        shutil.rmtree(log_dir, ignore_errors=True)
    print("## Environment\n")
    print(header_lines(env))
    print("\n## Results\n")
    print(markdown_tables(levels))
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "environment": env,
                    "config": {
                        k: v for k, v in vars(args).items() if k not in ("json", "concurrency")
                    },
                    "levels": [asdict(s) for s in levels],
                },
                indent=2,
                default=str,
            )
        )
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
