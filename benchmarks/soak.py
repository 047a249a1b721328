"""Soak test: hours-long mixed load, watching for memory growth, throughput drift and errors.

Starts ``text-generation-launcher`` itself (default: the embedded tiny model; ``--model DIR``
for another) on free loopback ports, or targets a running server (``--target host:port``;
memory is then only watched for the processes named with ``--pid NAME=PID``). For
``--duration`` seconds, ``--clients`` concurrent clients each send one request after the
other, drawn at random (seeded by ``--seed``) from this mix:

* ``stream``: GenerateStream read to its end;
* ``stream-cancelled``: GenerateStream that the client cancels after a random number of
  tokens (the script's own cancellations are counted apart, never as errors);
* ``generate-batch``: unary Generate with 1 to 4 inputs;
* ``tokenize``: Tokenize of 1 to 4 texts, with tokens and offsets at times;
* ``model-info``: ModelInfo.

Generation requests mix greedy and seeded sampling (temperature, top-k, top-p, repetition
penalty), stop sequences, ``min_new_tokens`` (0 or the maximum), response options (tokens,
logprobs, ranks, top-n, input text), prompts from one to several hundred tokens and
``max_new_tokens`` from 1 to 64. Every finished response is checked for consistency (a stop
reason that ends it, no more tokens than asked, exactly as many at MAX_TOKENS, token details
when asked); a failed check counts as an error ``BAD_RESPONSE``.

Measured:

* resident memory (VmRSS of /proc/PID/status) of the router and every shard (and the
  launcher), sampled every ``--rss-interval`` seconds: its growth from the end of the
  warm-up (``--warmup`` seconds, default 20 % of the duration) to the end, in percent (the
  goal is < 5 %), the peak, and the least-squares slope after warm-up;
* generated tokens per ``--window``-second window (tokens of streams count when they
  arrive, those of unary calls when the call returns): mean, min, max and coefficient of
  variation, over all windows and over those after the warm-up;
* errors by gRPC status (the goal is 0) and the requests sent by kind.

Output: a summary on stdout, ``--json FILE`` with every figure and the series. The exit
code is 1 when there was any error (or a watched process disappeared), 2 when the server
could not be started.

Example::

    .venv/bin/python benchmarks/soak.py --duration 1800 --clients 8 --json soak.json
    .venv/bin/python benchmarks/soak.py --duration 120 --model /models/llama -- --dtype float32
    .venv/bin/python benchmarks/soak.py --target 127.0.0.1:8033 --http-port 3000 \\
        --pid router=4242 --pid shard=4250

Arguments after ``--`` are passed to the launcher unchanged.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from tgis.launcher.local_process import LauncherProcess, start_launcher
from tgis.pb import generation_pb2 as pb
from tgis.pb import generation_pb2_grpc as pb_grpc
from tgis.procinfo import resident_kib

# Words the prompts are made of: common English, so real tokenizers split them as in text.
# fmt: off
WORDS = (
    "the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "and", "then",
    "returns", "to", "number", "of", "items", "in", "list", "when", "file", "is", "written",
    "data", "value", "error", "string", "create", "new", "find", "all", "convert", "write",
    "raise", "if", "for", "with", "from", "into", "each", "while", "before", "after", "under",
    "about", "small", "large", "red", "blue",
)
# fmt: on
# Prompt sizes in words (about as many tokens for the embedded model's tokenizer).
PROMPT_WORDS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 400)
PROMPTS_PER_SIZE = 4
MAX_NEW_TOKENS = (1, 2, 4, 8, 16, 32, 64)
STOP_SEQUENCES = ([" the"], ["."], [" a", ","], [" of", " and"], ["\n"])
# Request kinds and their weights in the mix.
KINDS = {
    "stream": 35,
    "stream-cancelled": 15,
    "generate-batch": 25,
    "tokenize": 15,
    "model-info": 10,
}
ENDING_REASONS = {pb.MAX_TOKENS, pb.EOS_TOKEN, pb.STOP_SEQUENCE}
REQUEST_TIMEOUT_S = 300.0


# ---- what is measured ---------------------------------------------------------------------------


@dataclass
class Tally:
    """Everything the clients and the sampler record while the load runs."""

    start: float
    duration: float
    window: float
    tokens_per_window: list[int] = field(default_factory=list)
    requests: Counter[str] = field(default_factory=Counter)
    generation_inputs: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    error_examples: list[str] = field(default_factory=list)
    client_cancellations: int = 0
    rss: dict[str, list[tuple[float, int]]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.tokens_per_window = [0] * max(1, math.ceil(self.duration / self.window))

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def add_tokens(self, count: int) -> None:
        """Credit ``count`` generated tokens to the current window (none after the end)."""
        index = int(self.elapsed() // self.window)
        if count > 0 and index < len(self.tokens_per_window):
            self.tokens_per_window[index] += count

    def add_error(self, kind: str, status: str, detail: str) -> None:
        self.errors[status] += 1
        if len(self.error_examples) < 20:
            self.error_examples.append(f"{self.elapsed():.1f}s {kind}: {status}: {detail[:300]}")


# ---- the workload -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Prompt:
    text: str
    tokens: int  # as counted by the server's Tokenize RPC


async def build_prompts(
    stub: pb_grpc.GenerationServiceStub, rng: random.Random, max_input_tokens: int
) -> list[Prompt]:
    """Random word sequences of every size in ``PROMPT_WORDS`` that fit in
    ``max_input_tokens``, with their token counts."""
    texts = [
        " ".join(rng.choice(WORDS) for _ in range(size))
        for size in PROMPT_WORDS
        for _ in range(PROMPTS_PER_SIZE)
    ]
    reply = await stub.Tokenize(
        pb.BatchedTokenizeRequest(requests=[pb.TokenizeRequest(text=t) for t in texts]),
        timeout=60,
    )
    prompts = [
        Prompt(text, r.token_count)
        for text, r in zip(texts, reply.responses, strict=True)
        if r.token_count <= max_input_tokens
    ]
    if not prompts:
        raise RuntimeError(f"no prompt fits in {max_input_tokens} input tokens")
    return prompts


@dataclass(frozen=True)
class Expectation:
    """What a finished generation response must satisfy."""

    max_new_tokens: int
    min_new_tokens: int
    wants_tokens: bool

    def problem(self, response: Any, token_details: int) -> str | None:
        """Why a finished response (its last message for a stream) is wrong, or None."""
        count = response.generated_token_count
        reason = response.stop_reason
        if reason not in ENDING_REASONS:
            return f"stop reason {pb.StopReason.Name(reason)}"
        if count > self.max_new_tokens:
            return f"{count} tokens > max_new_tokens {self.max_new_tokens}"
        if reason == pb.MAX_TOKENS and count != self.max_new_tokens:
            return f"MAX_TOKENS after {count} of {self.max_new_tokens} tokens"
        if reason != pb.STOP_SEQUENCE and count < self.min_new_tokens:
            return f"{pb.StopReason.Name(reason)} after {count} < min {self.min_new_tokens}"
        if self.wants_tokens and token_details != count:
            return f"{token_details} token details for {count} tokens"
        return None


def random_params(rng: random.Random, max_new_cap: int) -> tuple[pb.Parameters, Expectation]:
    """Generation parameters drawn from the mix, and what the response must satisfy."""
    max_new = min(rng.choice(MAX_NEW_TOKENS), max_new_cap)
    min_new = rng.choice((0, 0, max_new))
    stopping = pb.StoppingCriteria(max_new_tokens=max_new, min_new_tokens=min_new)
    if rng.random() < 0.3:
        stopping.stop_sequences.extend(rng.choice(STOP_SEQUENCES))
        stopping.include_stop_sequence = rng.random() < 0.5
    wants_tokens = rng.random() < 0.4
    response = pb.ResponseOptions(input_text=rng.random() < 0.2, generated_tokens=wants_tokens)
    if wants_tokens:
        response.token_logprobs = rng.random() < 0.5
        response.token_ranks = rng.random() < 0.5
        response.top_n_tokens = rng.choice((0, 0, 2, 5))
    params = pb.Parameters(stopping=stopping, response=response)
    if rng.random() < 0.2:
        params.decoding.repetition_penalty = 1.2
    if rng.random() < 0.5:
        params.method = pb.SAMPLE
        params.sampling.temperature = rng.choice((0.5, 0.8, 1.0, 1.3))
        params.sampling.top_k = rng.choice((0, 5, 50))
        params.sampling.top_p = rng.choice((0.0, 0.9))
        params.sampling.seed = rng.randrange(1, 1 << 31)
    else:
        params.method = pb.GREEDY
    return params, Expectation(max_new, min_new, wants_tokens)


@dataclass
class Workload:
    """The load's shared state: the stub, the prompts that fit, the limits and the tally."""

    stub: pb_grpc.GenerationServiceStub
    prompts: list[Prompt]
    max_new_cap: int
    tally: Tally

    async def stream(self, rng: random.Random, cancel: bool) -> None:
        kind = "stream-cancelled" if cancel else "stream"
        params, expect = random_params(rng, self.max_new_cap)
        # Cancel after 1 .. max_new-1 tokens (or at the first message for 1-token requests).
        cancel_after = rng.randint(1, max(1, expect.max_new_tokens - 1)) if cancel else None
        request = pb.SingleGenerationRequest(
            request=pb.GenerationRequest(text=rng.choice(self.prompts).text), params=params
        )
        self.tally.requests[kind] += 1
        self.tally.generation_inputs += 1
        call = self.stub.GenerateStream(request, timeout=REQUEST_TIMEOUT_S)
        seen, details, last = 0, 0, None
        async for message in call:
            if message.generated_token_count > seen:
                self.tally.add_tokens(message.generated_token_count - seen)
                seen = message.generated_token_count
            details += len(message.tokens)
            last = message
            if message.stop_reason != pb.NOT_FINISHED:
                break
            if cancel_after is not None and seen >= cancel_after:
                call.cancel()
                self.tally.client_cancellations += 1
                return
        if last is None:
            self.tally.add_error(kind, "BAD_RESPONSE", "stream ended without a message")
        elif (problem := expect.problem(last, details)) is not None:
            self.tally.add_error(kind, "BAD_RESPONSE", problem)

    async def generate_batch(self, rng: random.Random) -> None:
        params, expect = random_params(rng, self.max_new_cap)
        inputs = [rng.choice(self.prompts).text for _ in range(rng.randint(1, 4))]
        request = pb.BatchedGenerationRequest(
            requests=[pb.GenerationRequest(text=t) for t in inputs], params=params
        )
        self.tally.requests["generate-batch"] += 1
        self.tally.generation_inputs += len(inputs)
        reply = await self.stub.Generate(request, timeout=REQUEST_TIMEOUT_S)
        self.tally.add_tokens(sum(r.generated_token_count for r in reply.responses))
        if len(reply.responses) != len(inputs):
            problem: str | None = f"{len(reply.responses)} responses for {len(inputs)} inputs"
        else:
            problem = next(
                (p for r in reply.responses if (p := expect.problem(r, len(r.tokens)))), None
            )
        if problem is not None:
            self.tally.add_error("generate-batch", "BAD_RESPONSE", problem)

    async def tokenize(self, rng: random.Random) -> None:
        chosen = [rng.choice(self.prompts) for _ in range(rng.randint(1, 4))]
        details = rng.random() < 0.5
        request = pb.BatchedTokenizeRequest(
            requests=[pb.TokenizeRequest(text=p.text) for p in chosen],
            return_tokens=details,
            return_offsets=details,
        )
        self.tally.requests["tokenize"] += 1
        reply = await self.stub.Tokenize(request, timeout=REQUEST_TIMEOUT_S)
        counts = [r.token_count for r in reply.responses]
        if counts != [p.tokens for p in chosen]:
            self.tally.add_error("tokenize", "BAD_RESPONSE", f"counts {counts}")
        elif details and any(len(r.tokens) != r.token_count for r in reply.responses):
            self.tally.add_error("tokenize", "BAD_RESPONSE", "tokens missing")

    async def model_info(self) -> None:
        self.tally.requests["model-info"] += 1
        await self.stub.ModelInfo(pb.ModelInfoRequest(), timeout=REQUEST_TIMEOUT_S)

    async def one_request(self, rng: random.Random) -> None:
        """Send one request of a kind drawn from the mix; record a failure as an error."""
        kind = rng.choices(list(KINDS), weights=list(KINDS.values()))[0]
        try:
            if kind in ("stream", "stream-cancelled"):
                await self.stream(rng, cancel=kind == "stream-cancelled")
            elif kind == "generate-batch":
                await self.generate_batch(rng)
            elif kind == "tokenize":
                await self.tokenize(rng)
            else:
                await self.model_info()
        except grpc.aio.AioRpcError as err:
            self.tally.add_error(kind, err.code().name, err.details() or "")
            await asyncio.sleep(0.1)  # a failing server is not hammered in a tight loop

    async def client(self, seed: int) -> None:
        rng = random.Random(seed)
        while self.tally.elapsed() < self.tally.duration:
            await self.one_request(rng)


async def sample_rss(tally: Tally, pids: dict[str, int], interval: float, warmup: float) -> None:
    """Read every watched process's RSS every ``interval`` s, and exactly at the end of the
    warm-up and of the run; a process that disappears is an error."""
    times = sorted({*(i * interval for i in range(int(tally.duration // interval) + 1)), warmup})
    times = [t for t in times if t < tally.duration] + [tally.duration]
    gone: set[str] = set()
    for at in times:
        await asyncio.sleep(max(0.0, at - tally.elapsed()))
        for name, pid in pids.items():
            kib = resident_kib(pid)
            if kib is None:
                if name not in gone:
                    gone.add(name)
                    tally.add_error("process", "PROCESS_EXITED", f"{name} (pid {pid})")
                continue
            tally.rss.setdefault(name, []).append((round(tally.elapsed(), 2), kib))


async def run_load(
    target: str, pids: dict[str, int], args: argparse.Namespace
) -> tuple[Tally, dict[str, Any]]:
    """Build the prompts, then run the clients and the sampler for ``args.duration`` s."""
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        info = await stub.ModelInfo(pb.ModelInfoRequest(), timeout=60)
        max_new_cap = min(max(MAX_NEW_TOKENS), info.max_new_tokens)
        prompts = await build_prompts(
            stub, random.Random(args.seed), info.max_sequence_length - max_new_cap
        )
        tally = Tally(time.monotonic(), args.duration, args.window)
        workload = Workload(stub, prompts, max_new_cap, tally)
        sampler = asyncio.create_task(sample_rss(tally, pids, args.rss_interval, args.warmup))
        await asyncio.gather(*(workload.client(args.seed * 1000 + i) for i in range(args.clients)))
        await sampler
        server = {
            "max_sequence_length": info.max_sequence_length,
            "max_new_tokens": info.max_new_tokens,
            "prompt_tokens": sorted({p.tokens for p in prompts}),
        }
    return tally, server


# ---- figures ------------------------------------------------------------------------------------


def window_stats(values: Sequence[int], window: float) -> dict[str, float] | None:
    """Mean, min, max and coefficient of variation of tokens per window (and per second)."""
    if not values:
        return None
    mean = statistics.fmean(values)
    stdev = statistics.pstdev(values) if len(values) > 1 else 0.0
    return {
        "windows": len(values),
        "mean": round(mean, 1),
        "min": min(values),
        "max": max(values),
        "cv": round(stdev / mean, 4) if mean else math.inf,
        "mean_tokens_per_s": round(mean / window, 2),
    }


def rss_figures(series: list[tuple[float, int]], warmup: float) -> dict[str, Any]:
    """RSS at the end of the warm-up and at the end, the growth between them in percent,
    the peak, and the least-squares slope after the warm-up in KiB per minute."""
    after = [(t, kib) for t, kib in series if t >= warmup] or series[-1:]
    base, end = after[0][1], series[-1][1]
    slope = None
    if len(after) >= 3:
        ts = [t for t, _ in after]
        ks = [k for _, k in after]
        mean_t, mean_k = statistics.fmean(ts), statistics.fmean(ks)
        var = sum((t - mean_t) ** 2 for t in ts)
        if var > 0:
            slope = sum((t - mean_t) * (k - mean_k) for t, k in after) / var * 60
    return {
        "start_kib": series[0][1],
        "at_warmup_kib": base,
        "at_end_kib": end,
        "peak_kib": max(k for _, k in series),
        "growth_percent": round((end - base) / base * 100, 2),
        "slope_kib_per_min": None if slope is None else round(slope, 1),
        "samples": series,
    }


def report(tally: Tally, args: argparse.Namespace, setup: dict[str, Any]) -> dict[str, Any]:
    """Every figure of the run, as written to ``--json``."""
    windows = tally.tokens_per_window
    first_after = math.ceil(args.warmup / args.window)
    return {
        "setup": setup,
        "config": {
            k: v for k, v in vars(args).items() if k not in ("json", "launcher_args", "pid")
        },
        "requests": dict(tally.requests),
        "generation_inputs": tally.generation_inputs,
        "client_cancellations": tally.client_cancellations,
        "errors": dict(tally.errors),
        "error_count": sum(tally.errors.values()),
        "error_examples": tally.error_examples,
        "generated_tokens": sum(windows),
        "throughput": {
            "window_s": args.window,
            "tokens_per_window": windows,
            "all": window_stats(windows, args.window),
            "after_warmup": window_stats(windows[first_after:], args.window),
        },
        "rss": {name: rss_figures(series, args.warmup) for name, series in tally.rss.items()},
    }


def summary(figures: dict[str, Any], args: argparse.Namespace) -> str:
    """The human-readable summary printed on stdout."""
    setup = figures["setup"]
    lines = [
        f"soak: {args.duration:.0f} s (warm-up {args.warmup:.0f} s), {args.clients} clients, "
        f"seed {args.seed}, model {setup['model']}",
        f"host: {setup['cpus']} CPUs, load average at start {setup['load_average_start']}, "
        f"at end {setup['load_average_end']}",
        f"requests: {sum(figures['requests'].values())} "
        + "("
        + ", ".join(f"{k} {v}" for k, v in sorted(figures["requests"].items()))
        + f"); {figures['generation_inputs']} generation inputs, "
        f"{figures['client_cancellations']} cancelled by the client (not errors)",
        f"errors: {figures['error_count']}"
        + (f" {figures['errors']}" if figures["errors"] else ""),
    ]
    lines += [f"  {example}" for example in figures["error_examples"][:5]]
    throughput = figures["throughput"]
    lines.append(
        f"generated tokens: {figures['generated_tokens']}; per {args.window:.0f} s window:"
    )
    for label in ("all", "after_warmup"):
        s = throughput[label]
        if s:
            lines.append(
                f"  {label:<13} {s['windows']:>4} windows: mean {s['mean']:.0f} "
                f"({s['mean_tokens_per_s']:.1f} tok/s), min {s['min']}, max {s['max']}, "
                f"CV {s['cv']:.3f}"
            )
    lines.append("resident memory (VmRSS, MiB):")
    lines.append(
        f"  {'process':<10} {'start':>8} {'warm-up':>8} {'end':>8} {'peak':>8} "
        f"{'growth':>8} {'slope KiB/min':>14}"
    )
    for name, r in figures["rss"].items():
        slope = "-" if r["slope_kib_per_min"] is None else f"{r['slope_kib_per_min']:.1f}"
        lines.append(
            f"  {name:<10} {r['start_kib'] / 1024:>8.1f} {r['at_warmup_kib'] / 1024:>8.1f} "
            f"{r['at_end_kib'] / 1024:>8.1f} {r['peak_kib'] / 1024:>8.1f} "
            f"{r['growth_percent']:>7.2f}% {slope:>14}"
        )
    if not figures["rss"]:
        lines.append("  (no process watched: give --pid NAME=PID with --target)")
    return "\n".join(lines)


# ---- the command --------------------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    launcher_args: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, launcher_args = argv[:cut], argv[cut + 1 :]
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--duration", type=float, default=1800.0, help="seconds of load (1800)")
    parser.add_argument(
        "--warmup", type=float, help="seconds before the RSS baseline (default: 20%% of duration)"
    )
    parser.add_argument("--clients", type=int, default=8, help="concurrent clients (8)")
    parser.add_argument("--window", type=float, default=10.0, help="throughput window, s (10)")
    parser.add_argument("--rss-interval", type=float, default=5.0, help="RSS sampling, s (5)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the request mix (0)")
    parser.add_argument("--model", help="model directory for the launched server (embedded)")
    parser.add_argument("--target", help="host:port of a running server (default: launch one)")
    parser.add_argument("--http-port", type=int, help="HTTP port of --target (health check)")
    parser.add_argument(
        "--pid",
        action="append",
        default=[],
        metavar="NAME=PID",
        help="a process of --target to watch (repeatable)",
    )
    parser.add_argument("--startup-timeout", type=float, default=300.0, help="seconds (300)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    args.launcher_args = launcher_args
    if args.warmup is None:
        args.warmup = 0.2 * args.duration
    if not 0 <= args.warmup < args.duration:
        parser.error("--warmup must be in [0, duration)")
    if args.target and args.model:
        parser.error("--model is for the launched server; not with --target")
    return args


def watched_pids(server: LauncherProcess) -> dict[str, int]:
    """Launcher, router and shard pids of a launched server, by name."""
    roles = server.process_pids()
    pids = {"launcher": server.proc.pid}
    for role, found in roles.items():
        for i, pid in enumerate(sorted(found)):
            pids[role if len(found) == 1 else f"{role}{i}"] = pid
    return pids


def health(target_http: str | None) -> int | None:
    """HTTP status of ``/health``, or None when it cannot be asked."""
    if target_http is None:
        return None
    try:
        with urllib.request.urlopen(f"{target_http}/health", timeout=30) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as err:
        return int(err.code)
    except OSError:
        return -1


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    server: LauncherProcess | None = None
    tally: Tally | None = None
    log_dir = Path(tempfile.mkdtemp(prefix="tgis-soak-"))
    try:
        if args.target:
            target = args.target
            http = f"http://{target.rsplit(':', 1)[0]}:{args.http_port}" if args.http_port else None
            pids = {name: int(pid) for name, _, pid in (p.partition("=") for p in args.pid)}
        else:
            extra = ["--model-name", args.model] if args.model else []
            server = start_launcher(
                log_dir, [*extra, *args.launcher_args], log_name="launcher.log", max_batch_size=None
            )
            server.wait_healthy(args.startup_timeout)
            target, http = server.grpc_target, f"http://127.0.0.1:{server.http_port}"
            pids = watched_pids(server)
        print(f"load on {target}, watching {pids}", file=sys.stderr, flush=True)
        load_start = " / ".join(f"{x:.2f}" for x in os.getloadavg())
        tally, server_info = asyncio.run(run_load(target, pids, args))
        end_health = health(http)
        if end_health not in (None, 200):
            tally.add_error("health", "UNHEALTHY", f"/health answered {end_health}")
        setup = {
            "model": args.model or ("embedded tiny Llama" if server else args.target),
            "target": target,
            "pids": pids,
            "cpus": os.cpu_count(),
            "load_average_start": load_start,
            "load_average_end": " / ".join(f"{x:.2f}" for x in os.getloadavg()),
            "launcher_args": args.launcher_args,
            **server_info,
        }
    except (RuntimeError, TimeoutError, grpc.aio.AioRpcError) as err:
        print(f"error: {err}", file=sys.stderr)
        if server is not None:
            print(server.log_tail(4000), file=sys.stderr)
        return 2
    finally:
        if server is not None:
            code = server.stop()
            print(f"launcher stopped (exit code {code})", file=sys.stderr)
            if code != 0 or (tally is not None and tally.errors):
                print(server.log_tail(6000), file=sys.stderr)
        shutil.rmtree(log_dir, ignore_errors=True)
    figures = report(tally, args, setup)
    print(summary(figures, args))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1))
    return 1 if figures["error_count"] else 0


if __name__ == "__main__":
    sys.exit(main())
