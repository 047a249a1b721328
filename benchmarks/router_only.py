"""Router-only benchmark: the real router in front of an instant fake shard.

Measures the router's own ceiling: how many tokens per second ``text-generation-router`` can
schedule, send to the shard as Step RPCs, detokenize, check against the stopping criteria
and stream to gRPC clients, when the shard costs (almost) nothing.

1. Starts ``benchmarks/fake_shard.py`` in its own process: a real ``ShardService`` gRPC
   server on a Unix socket that answers ``Info`` with the embedded model's EOS id and vocabulary
   size (and 65,536 KV blocks) and every ``Step`` at once with one whole-word token id per
   sequence whose prompt is complete (never EOS, so requests run to ``max_new_tokens``).
2. Starts the real ``text-generation-router`` against it (``--master-shard-uds-path``,
   ``--tokenizer-path`` = the embedded tokenizer, free ports, ``--max-batch-size`` = the largest
   stream count) and waits for ``/health``.
3. For each stream count ``N`` (default 1, 64, 256): ``N`` closed-loop streaming clients
   (``GenerateStream``, greedy, ``min_new_tokens = max_new_tokens = --output-tokens``) send
   ``N × rounds`` requests, with ``rounds`` chosen so that a level streams at least
   ``--tokens-per-level`` tokens.

Reported per level: tokens/s streamed to the clients, per-stream tokens/s, TTFT and ITL, the
router's CPU time per token and per step (``/proc``; the §7 bar of
``/work/shared/spec/performance.md`` is "router CPU per token per step < 50 µs"), the share of
a core the router used, and per step (from the router's ``/metrics``) the wall time, the
router-timed Step RPC time and the rest (scheduling and applying the output). The fake shard's
and this client's CPU per token are listed too: all three processes share this host's cores.

Arguments after ``--`` go to ``text-generation-router`` unchanged (after the script's own
flags, so they win). Example::

    .venv/bin/python benchmarks/router_only.py --json router-only.json
    .venv/bin/python benchmarks/router_only.py --streams 1,16 --output-tokens 64 \\
        --step-delay-ms 5          # a fake 5 ms forward: is the router's work hidden?
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import grpc
from fake_shard import EMBEDDED_TOKENIZER
from serve import (
    STEP_METRICS,
    Level,
    RequestSpec,
    cpu_by_role,
    cpu_used_since,
    device_description,
    engine_commit,
    fmt,
    header_lines,
    json_safe,
    mean,
    percentile,
    run_level,
    scrape_step_metrics,
    stream_one,
    token_counts,
)

from tgis.launcher.local_process import BIN_DIR
from tgis.pb import generation_pb2_grpc as pb_grpc
from tgis.procinfo import free_ports, host_busy_seconds

FAKE_SHARD = Path(__file__).resolve().parent / "fake_shard.py"
DEFAULT_PROMPT = "Return the number of items in the list."


# ---- the processes ----------------------------------------------------------------------------


@dataclass
class Child:
    """A process this script started in its own session, with its log file."""

    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path

    def log_tail(self, chars: int = 3000) -> str:
        """The end of the process's combined stdout/stderr."""
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def check_alive(self) -> None:
        """Raise with the log tail when the process has exited."""
        if self.proc.poll() is not None:
            raise RuntimeError(
                f"{self.name} exited with {self.proc.returncode}:\n{self.log_tail()}"
            )

    def stop(self, timeout: float) -> int:
        """SIGTERM, then SIGKILL its process group after ``timeout`` seconds."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        return int(self.proc.returncode)


def start_child(name: str, argv: list[str], log_path: Path) -> Child:
    """Popen ``argv`` in a new session, stdout and stderr to ``log_path``."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(
            argv, stdout=log_file, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    return Child(name, proc, log_path)


def wait_for(predicate: Any, child: Child, timeout: float, what: str) -> None:
    """Poll ``predicate()`` every 0.1 s until true; raise if ``child`` dies or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        child.check_alive()
        if predicate():
            return
        time.sleep(0.1)
    raise TimeoutError(f"{what} not ready after {timeout:.0f} s:\n{child.log_tail()}")


def healthy(url: str) -> bool:
    """Whether ``url`` answers 200."""
    try:
        with urllib.request.urlopen(url, timeout=5.0) as resp:
            return bool(resp.status == 200)
    except (OSError, urllib.error.HTTPError):
        return False


# ---- one level ----------------------------------------------------------------------------------


@dataclass
class StreamLevel:
    """Aggregates of one stream count (times in µs unless named otherwise)."""

    streams: int
    requests: int
    completed: int
    errors: int
    wrong_length: int
    duration_s: float
    tokens: int
    tokens_per_s: float
    per_stream_tokens_per_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_mean_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    router_cpu_us_per_token: float
    router_cpu_share: float  # router CPU seconds / wall seconds (1.0 = one core busy)
    fake_shard_cpu_us_per_token: float
    client_cpu_us_per_token: float
    other_load_percent: float
    first_error: str = ""
    steps: int | None = None
    tokens_per_step: float | None = None
    wall_us_per_step: float | None = None
    step_rpc_us_per_step: float | None = None
    between_steps_us: float | None = None
    router_cpu_us_per_step: float | None = None


async def run_streams(
    stubs: list[pb_grpc.GenerationServiceStub],
    specs: list[RequestSpec],
    streams: int,
    pids: dict[str, int],
    metrics_url: str,
    timeout: float,
) -> StreamLevel:
    """``streams`` closed-loop clients sending ``specs``."""
    processes = {role: [pid] for role, pid in pids.items()}
    before_cpu = cpu_by_role(processes)
    before_host = host_busy_seconds()
    before = scrape_step_metrics(metrics_url)
    results, duration, _peak = await run_level(
        stubs, specs, Level(f"{streams}", concurrency=streams), timeout, seed=0
    )
    after = scrape_step_metrics(metrics_url)
    host_used = host_busy_seconds() - before_host
    used = cpu_used_since(before_cpu, processes)
    ok = [r for r in results if not r.error]
    errors = [r.error for r in results if r.error]
    tokens = sum(r.output_tokens for r in ok)
    itls = [g * 1000 for r in ok for g in r.itls]
    ttfts = [r.ttft * 1000 for r in ok]
    per_token = 1e6 / tokens if tokens else math.nan
    foreign = max(0.0, host_used - sum(used.values()))
    level = StreamLevel(
        streams=streams,
        requests=len(results),
        completed=len(ok),
        errors=len(errors),
        wrong_length=sum(r.wrong_length for r in ok),
        duration_s=duration,
        tokens=tokens,
        tokens_per_s=tokens / duration,
        per_stream_tokens_per_s=1000 / mean(itls) if itls else math.nan,
        ttft_p50_ms=percentile(ttfts, 50),
        ttft_p99_ms=percentile(ttfts, 99),
        itl_mean_ms=mean(itls),
        itl_p50_ms=percentile(itls, 50),
        itl_p99_ms=percentile(itls, 99),
        router_cpu_us_per_token=used["router"] * per_token,
        router_cpu_share=used["router"] / duration,
        fake_shard_cpu_us_per_token=used["fake shard"] * per_token,
        client_cpu_us_per_token=used["client"] * per_token,
        other_load_percent=100 * foreign / (duration * (os.cpu_count() or 1)),
        first_error=errors[0] if errors else "",
    )
    if before and after:
        steps = int(after[STEP_METRICS[1]] - before[STEP_METRICS[1]])
        if steps:
            level.steps = steps
            level.tokens_per_step = tokens / steps
            level.wall_us_per_step = duration * 1e6 / steps
            level.step_rpc_us_per_step = (after[STEP_METRICS[0]] - before[STEP_METRICS[0]]) * (
                1e6 / steps
            )
            level.between_steps_us = level.wall_us_per_step - level.step_rpc_us_per_step
            level.router_cpu_us_per_step = used["router"] * 1e6 / steps
    return level


def markdown_table(levels: list[StreamLevel]) -> str:
    """The results as two Markdown tables and a legend."""
    lines = [
        "| streams | ok/req | tokens | s | tok/s | tok/s per stream | TTFT p50 ms | TTFT p99 ms "
        "| ITL p50 ms | ITL p99 ms |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s in levels:
        lines.append(
            f"| {s.streams} | {s.completed}/{s.requests} | {s.tokens} | {fmt(s.duration_s)} | "
            f"{fmt(s.tokens_per_s, 0)} | {fmt(s.per_stream_tokens_per_s, 0)} | "
            f"{fmt(s.ttft_p50_ms, 2)} | {fmt(s.ttft_p99_ms, 2)} | {fmt(s.itl_p50_ms, 3)} | "
            f"{fmt(s.itl_p99_ms, 3)} |"
        )
    lines += [
        "",
        "| streams | router CPU µs/tok | router CPU share | steps | tok/step | wall µs/step "
        "| Step RPC µs/step | between steps µs | router CPU µs/step | fake shard CPU µs/tok "
        "| client CPU µs/tok | other load % |",
        "|---:|" + "---:|" * 11,
    ]
    for s in levels:
        lines.append(
            f"| {s.streams} | {fmt(s.router_cpu_us_per_token)} | "
            f"{fmt(100 * s.router_cpu_share, 0)} % | {s.steps if s.steps is not None else '–'} "
            f"| {fmt(s.tokens_per_step, 1)} | {fmt(s.wall_us_per_step, 0)} | "
            f"{fmt(s.step_rpc_us_per_step, 0)} | {fmt(s.between_steps_us, 0)} | "
            f"{fmt(s.router_cpu_us_per_step, 0)} | {fmt(s.fake_shard_cpu_us_per_token)} | "
            f"{fmt(s.client_cpu_us_per_token)} | {fmt(s.other_load_percent, 0)} |"
        )
    lines += [
        "",
        "tok/s = output tokens received by all clients / level wall time. Router CPU share = "
        "router process CPU seconds / wall seconds (100 % = one core). Step RPC = the router's "
        "own timing of each Step call (protobuf both ways, the Unix socket, the fake shard); "
        "between steps = wall/step − Step RPC (scheduling and applying the output: "
        "detokenize, stop checks, queueing the stream messages). CPU µs/tok = process CPU "
        "time / tokens. Other load = share of all cores used by processes other than these "
        "three (noise indicator).",
    ]
    return "\n".join(lines)


# ---- main -----------------------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Command line; everything after ``--`` goes to the router."""
    router_args: list[str] = []
    if "--" in argv:
        split = argv.index("--")
        argv, router_args = argv[:split], argv[split + 1 :]
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n", 1)[0] if __doc__ else None,
        epilog="Arguments after `--` are passed to text-generation-router unchanged.",
    )
    parser.add_argument("--streams", default="1,64,256", help="stream counts (1,64,256)")
    parser.add_argument("--output-tokens", type=int, default=256, help="tokens per request (256)")
    parser.add_argument("--prompt", default=DEFAULT_PROMPT, help="the prompt of every request")
    parser.add_argument(
        "--distinct-prompts",
        action="store_true",
        help="each request's prompt starts with its number (no two share a KV block)",
    )
    parser.add_argument(
        "--prefix-caching",
        action="store_true",
        help="the fake shard allows the router's prefix cache (on unless the router is given "
        "--disable-prefix-caching after --)",
    )
    parser.add_argument(
        "--tokens-per-level",
        type=int,
        default=32768,
        help="each level runs enough rounds to stream at least this many tokens (32768)",
    )
    parser.add_argument("--warmup", type=int, default=2, help="warm-up requests (2)")
    parser.add_argument(
        "--step-delay-ms", type=float, default=0.0, help="fake shard sleeps this long per Step"
    )
    parser.add_argument("--num-blocks", type=int, default=65536, help="fake shard KV blocks")
    parser.add_argument(
        "--tokenizer", type=Path, default=EMBEDDED_TOKENIZER, help="tokenizer.json (embedded)"
    )
    parser.add_argument(
        "--request-timeout", type=float, default=120.0, help="seconds per request (120)"
    )
    parser.add_argument(
        "--level-timeout", type=float, default=300.0, help="seconds per level (300)"
    )
    parser.add_argument(
        "--startup-timeout", type=float, default=60.0, help="seconds to wait for each process"
    )
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    args.router_args = router_args
    try:
        args.levels = [int(s) for s in args.streams.split(",") if s.strip()]
    except ValueError:
        parser.error("--streams takes comma-separated integers")
    if not args.levels or min(args.levels) < 1:
        parser.error("stream counts must be positive")
    if args.output_tokens < 2 or args.tokens_per_level < 1:
        parser.error("--output-tokens must be >= 2 and --tokens-per-level positive")
    return args


def router_argv(args: argparse.Namespace, uds: Path, grpc_port: int, http_port: int) -> list[str]:
    """The ``text-generation-router`` command line."""
    widest = max(args.levels)
    return [
        str(BIN_DIR / "text-generation-router"),
        "--master-shard-uds-path",
        str(uds),
        "--tokenizer-path",
        str(args.tokenizer),
        "--grpc-port",
        str(grpc_port),
        "--port",
        str(http_port),
        "--max-batch-size",
        str(widest),
        "--max-concurrent-requests",
        str(max(512, widest)),
        "--max-new-tokens",
        str(max(1024, args.output_tokens)),
        "--max-sequence-length",
        str(max(2048, args.output_tokens + 1024)),
        "--model-name",
        "fake-shard",
        *args.router_args,
    ]


async def distinct_specs(
    stub: pb_grpc.GenerationServiceStub, spec: RequestSpec, count: int
) -> list[RequestSpec]:
    """``count`` requests like ``spec``, each prompt starting with its own number (so none
    shares a KV block with another), with their token counts."""
    prompts = [f"{i}: {spec.prompt}" for i in range(count)]
    counts = await token_counts(stub, prompts)
    return [replace(spec, prompt=p, input_tokens=n) for p, n in zip(prompts, counts, strict=True)]


async def drive(
    args: argparse.Namespace, target: str, metrics_url: str, pids: dict[str, int]
) -> tuple[list[StreamLevel], int]:
    """Warm up, then run every stream count; (levels, prompt tokens)."""
    channels = [grpc.aio.insecure_channel(target) for _ in range(max(1, max(args.levels) // 64))]
    try:
        stubs = [pb_grpc.GenerationServiceStub(ch) for ch in channels]
        (prompt_tokens,) = await token_counts(stubs[0], [args.prompt])
        spec = RequestSpec(args.prompt, prompt_tokens, args.output_tokens)
        for _ in range(args.warmup):
            warm = await stream_one(stubs[0], spec.to_pb(), args.request_timeout)
            if warm.error or warm.output_tokens != args.output_tokens:
                raise SystemExit(f"warm-up failed: {warm.error or warm.output_tokens}")
        levels: list[StreamLevel] = []
        for streams in args.levels:
            rounds = max(1, math.ceil(args.tokens_per_level / (streams * args.output_tokens)))
            specs = [spec] * (streams * rounds)
            if args.distinct_prompts:
                specs = await distinct_specs(stubs[0], spec, len(specs))
            try:
                level = await asyncio.wait_for(
                    run_streams(stubs, specs, streams, pids, metrics_url, args.request_timeout),
                    args.level_timeout,
                )
            except TimeoutError:
                raise SystemExit(
                    f"{streams} streams: not done after --level-timeout {args.level_timeout} s"
                ) from None
            levels.append(level)
            print(
                f"{streams} streams x {rounds} rounds: {level.completed}/{level.requests} ok in "
                f"{level.duration_s:.1f} s, {level.tokens_per_s:.0f} tok/s, router "
                f"{level.router_cpu_us_per_token:.1f} µs CPU/token"
                + (f", first error: {level.first_error}" if level.first_error else ""),
                file=sys.stderr,
                flush=True,
            )
        return levels, prompt_tokens
    finally:
        for ch in channels:
            await ch.close()


def main(argv: list[str] | None = None) -> int:
    """Start the fake shard and the router, run the levels, stop both; 1 on any failure."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    work = Path(tempfile.mkdtemp(prefix="tgis-ro-", dir="/tmp"))  # short socket path
    uds = work / "shard-0"
    ready = work / "ready"
    grpc_port, http_port = free_ports(2)
    shard_argv = [
        sys.executable,
        str(FAKE_SHARD),
        "--uds",
        str(uds),
        "--ready-file",
        str(ready),
        "--tokenizer",
        str(args.tokenizer),
        "--num-blocks",
        str(args.num_blocks),
        "--step-delay-ms",
        str(args.step_delay_ms),
        *(["--prefix-caching"] if args.prefix_caching else []),
    ]
    r_argv = router_argv(args, uds, grpc_port, http_port)
    env: dict[str, Any] = {
        "device": device_description(),
        "engine commit": engine_commit(),
        "router": " ".join([Path(r_argv[0]).name, *r_argv[1:]]),
        "fake shard": (
            f"instant Step (+{args.step_delay_ms:g} ms sleep), {args.num_blocks} KV blocks, "
            "whole-word token ids of the embedded tokenizer, never EOS"
        ),
        "requests": (
            f"{args.prompt!r}{' after each its own number' if args.distinct_prompts else ''}, "
            f"greedy, min_new_tokens = max_new_tokens = {args.output_tokens}; "
            f"closed loop, each level >= {args.tokens_per_level} tokens "
            f"(+{args.warmup} warm-up requests)"
        ),
        "host load average (1/5/15 min) at start": " / ".join(f"{x:.2f}" for x in os.getloadavg()),
        "software": f"Python {platform.python_version()}, grpcio {grpc.__version__}",
    }
    shard: Child | None = None
    router: Child | None = None
    levels: list[StreamLevel] = []
    failed = True
    try:
        shard = start_child("fake shard", shard_argv, work / "fake-shard.log")
        wait_for(ready.exists, shard, args.startup_timeout, "fake shard")
        router = start_child("router", r_argv, work / "router.log")
        print(f"router: {' '.join(r_argv)}", file=sys.stderr, flush=True)
        health_url = f"http://127.0.0.1:{http_port}/health"
        wait_for(lambda: healthy(health_url), router, args.startup_timeout, "router")
        pids = {"router": router.proc.pid, "fake shard": shard.proc.pid}
        levels, prompt_tokens = asyncio.run(
            drive(args, f"127.0.0.1:{grpc_port}", f"http://127.0.0.1:{http_port}/metrics", pids)
        )
        env["requests"] = env["requests"].replace(", greedy", f" ({prompt_tokens} tokens), greedy")
        failed = any(s.errors or s.wrong_length for s in levels)
    except (RuntimeError, TimeoutError) as err:  # a process died or never became ready
        print(f"error: {err}", file=sys.stderr)
        return 1
    finally:
        for child, grace in ((router, 40.0), (shard, 10.0)):
            if child is not None:
                code = child.stop(grace)
                print(f"{child.name} stopped (exit code {code})", file=sys.stderr)
                if code != 0:
                    print(child.log_tail(), file=sys.stderr)
                    failed = True
        shutil.rmtree(work, ignore_errors=True)
    print("## Environment\n")
    print(header_lines(env))
    print("\n## Results\n")
    print(markdown_table(levels))
    if args.json:
        config = {k: v for k, v in vars(args).items() if k != "json"}
        args.json.write_text(
            json.dumps(
                json_safe(
                    {"environment": env, "config": config, "levels": [asdict(s) for s in levels]}
                ),
                indent=2,
                default=str,
                allow_nan=False,
            )
        )
    if failed:
        print("some requests failed, had the wrong length, or a process failed", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
