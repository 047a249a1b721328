"""The OpenAI and TGI streaming routes against gRPC streaming, on one launched server and
one load.

Starts ``text-generation-launcher`` once (default: the embedded tiny model, where the
router's own cost per token weighs most) and builds ``serve.py``'s fixed request list
(``--input-tokens`` prompt tokens calibrated with the Tokenize RPC, ``--output-tokens``
generated, greedy, the output length forced). Then, for ``--rounds`` rounds, it sends that
list at every ``--concurrency`` level through each API of ``--apis`` (default: all three),
the order alternating by round (gRPC, OpenAI, TGI, then TGI, OpenAI, gRPC, ...) so a slow
drift of the shared host hits them all:

* **gRPC**: ``GenerateStream`` (grpc.aio), as ``serve.py`` sends it;
* **OpenAI**: ``POST /v1/completions`` with ``stream: true`` and
  ``stream_options.include_usage`` (aiohttp, server-sent events parsed line by line),
  ``temperature: 0``, ``max_tokens = min_tokens`` = the request's output length (vLLM's
  ``min_tokens`` extra, which tgis accepts, so EOS cannot end a request early).
  ``--chat`` sends ``/v1/chat/completions`` with the prompt as one user message instead
  (the model needs a chat template; the embedded one has none).
* **TGI**: ``POST /generate_stream`` (HF TGI's REST API; aiohttp, one event per token),
  ``max_new_tokens`` = the request's output length, greedy, ``details: true`` for the counts
  on the last event. TGI's API has no minimum length: a request that meets EOS first ends
  there and counts as having the wrong length, so the prompt's word must be one whose greedy
  continuation outlasts the output length (on the embedded model, ``--word a`` at 64 prompt
  tokens runs past 64 output tokens; ``the`` meets EOS within 30).

Every request's prompt and output token counts are checked (the gRPC stream's counts, the
OpenAI stream's ``usage``, the TGI stream's last ``details``): the script exits 1 when one
failed or had the wrong length.

Reported per level and API (medians over rounds): output tokens/s, TTFT and TPOT p50, the
messages (gRPC) or chunks (OpenAI) per request, and the CPU time per output token of the
router, the shard and this client (``/proc``); then the ratios OpenAI / gRPC and TGI / gRPC
of the throughput and of the router's CPU per token. The issue's goal: OpenAI and TGI
throughput ≥ 0.9× gRPC's at 1 and 32 streams.

Example::

    .venv/bin/python benchmarks/openai_bench.py --concurrency 1,32 --rounds 3
    .venv/bin/python benchmarks/openai_bench.py --apis grpc,tgi --word a
    .venv/bin/python benchmarks/openai_bench.py --json out.json -- --max-batch-size 64

Arguments after ``--`` go to the launcher unchanged.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp
import grpc
from serve import (
    Level,
    LevelStats,
    RequestResult,
    RequestSpec,
    build_workload,
    cpu_by_role,
    cpu_used_since,
    device_description,
    drive_arrivals,
    engine_commit,
    fmt,
    header_lines,
    json_safe,
    print_progress,
    run_level,
    stream_one,
    summarise,
)

from tgis.launcher.local_process import LauncherProcess, start_launcher
from tgis.pb import generation_pb2_grpc as pb_grpc

APIS = ("grpc", "openai", "tgi")

SendOne = Callable[[RequestSpec, float, RequestResult], Awaitable[None]]
"""Send one streaming request over an HTTP route and fill in its result."""


@dataclass(frozen=True)
class OpenAIClient:
    """What one OpenAI streaming request needs: the session, the route and the model id."""

    session: aiohttp.ClientSession
    base_url: str
    model: str
    chat: bool

    def body(self, spec: RequestSpec) -> dict[str, Any]:
        """The streaming request for ``spec``: greedy, its output length forced."""
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": spec.output_tokens,
            "min_tokens": spec.output_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.chat:
            body["messages"] = [{"role": "user", "content": spec.prompt}]
        else:
            body["prompt"] = spec.prompt
        return body

    @property
    def url(self) -> str:
        return self.base_url + ("/v1/chat/completions" if self.chat else "/v1/completions")


async def sse_stream_one(
    client: OpenAIClient, spec: RequestSpec, timeout: float, result: RequestResult
) -> None:
    """Send one streaming request, time its first and last token chunk, count the token
    chunks (``result.messages``) and read the counts from its usage chunk."""
    sent = time.perf_counter()
    first = last = 0.0
    usage: dict[str, int] | None = None
    try:
        async with client.session.post(
            client.url, json=client.body(spec), timeout=aiohttp.ClientTimeout(total=timeout)
        ) as resp:
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return
            async for line in resp.content:
                if not line.startswith(b"data: "):
                    continue
                data = line[6:].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("usage"):
                    usage = chunk["usage"]
                if not _carries_tokens(chunk):
                    continue
                last = time.perf_counter()
                if not result.messages:
                    first = last
                result.messages += 1
    except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError) as err:
        result.error = f"{type(err).__name__}: {err}"
        return
    if usage is None or not result.messages:
        result.error = "no usage chunk" if result.messages else "no tokens generated"
        return
    result.ttft, result.e2el = first - sent, last - sent
    result.input_tokens = usage["prompt_tokens"]
    result.output_tokens = usage["completion_tokens"]


def _carries_tokens(chunk: dict[str, Any]) -> bool:
    """Whether a chunk is a token event (not the chat stream's opening role chunk, not the
    usage chunk)."""
    choices = chunk.get("choices") or []
    if not choices:
        return False
    choice = choices[0]
    delta = choice.get("delta")
    return delta is None or "role" not in delta


@dataclass(frozen=True)
class TGIClient:
    """What one TGI streaming request needs: the session and the server."""

    session: aiohttp.ClientSession
    base_url: str

    def body(self, spec: RequestSpec) -> dict[str, Any]:
        """The streaming request for ``spec``: greedy (TGI's default), its output length as
        ``max_new_tokens``, details for the counts."""
        return {
            "inputs": spec.prompt,
            "parameters": {"max_new_tokens": spec.output_tokens, "details": True},
        }


async def tgi_stream_one(
    client: TGIClient, spec: RequestSpec, timeout: float, result: RequestResult
) -> None:
    """Send one ``/generate_stream`` request, time its first and last event (one per token,
    ``result.messages``) and read the counts from the last event's details."""
    sent = time.perf_counter()
    first = last = 0.0
    details: dict[str, Any] | None = None
    try:
        async with client.session.post(
            client.base_url + "/generate_stream",
            json=client.body(spec),
            timeout=aiohttp.ClientTimeout(total=timeout),
        ) as resp:
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return
            async for line in resp.content:
                if not line.startswith(b"data:"):
                    continue
                event = json.loads(line[5:])
                if "error" in event:
                    result.error = f"{event.get('error_type')}: {event['error']}"
                    return
                last = time.perf_counter()
                if not result.messages:
                    first = last
                result.messages += 1
                details = event.get("details") or details
    except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError) as err:
        result.error = f"{type(err).__name__}: {err}"
        return
    if details is None:
        result.error = "no details event" if result.messages else "no tokens generated"
        return
    result.ttft, result.e2el = first - sent, last - sent
    result.input_tokens = details["input_length"]
    result.output_tokens = details["generated_tokens"]


async def run_http_level(
    send_one: SendOne, specs: list[RequestSpec], level: Level, timeout: float
) -> tuple[list[RequestResult], float, int]:
    """``serve.run_level`` over an HTTP route: (results, wall seconds, peak in flight)."""
    results = [RequestResult(s.input_tokens, s.output_tokens) for s in specs]

    async def send(index: int) -> None:
        await send_one(specs[index], timeout, results[index])

    duration, peak = await drive_arrivals(send, len(specs), level, 0)
    return results, duration, peak


@dataclass
class Measured:
    """One (round, API, level) run."""

    api: str
    round: int
    stats: LevelStats
    messages_per_request: float


async def measured(
    api: str,
    run: Awaitable[tuple[list[RequestResult], float, int]],
    level: Level,
    server: LauncherProcess,
    round_index: int,
) -> Measured:
    """Run one level (``run``, a coroutine not yet started) and attach the processes' CPU
    time per output token."""
    pids = server.process_pids()
    before = cpu_by_role(pids)
    results, duration, peak = await run  # not started before the CPU reading
    stats = summarise(level, results, duration, peak)
    used = cpu_used_since(before, pids)
    if stats.output_tokens:
        stats.cpu_ms_per_token = {r: s * 1000 / stats.output_tokens for r, s in used.items()}
    print_progress(f"round {round_index} {api} {level.label}", stats)
    messages = statistics.fmean(r.messages for r in results)
    return Measured(api, round_index, stats, messages)


async def benchmark(args: argparse.Namespace, server: LauncherProcess) -> list[Measured]:
    """Build the workload, warm both APIs up, then alternate them round by round."""
    # Separate connections when asked (a local subchannel pool each), like separate clients.
    options = [("grpc.use_local_subchannel_pool", 1)]
    channels = [
        grpc.aio.insecure_channel(server.grpc_target, options=options)
        for _ in range(args.grpc_channels)
    ]
    base_url = f"http://127.0.0.1:{server.http_port}"
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        try:
            stubs = [pb_grpc.GenerationServiceStub(channel) for channel in channels]
            stub = stubs[0]
            specs = await build_workload(stub, args)
            async with session.get(base_url + "/v1/models") as resp:
                model = (await resp.json())["data"][0]["id"]
            senders: dict[str, SendOne] = {
                "openai": functools.partial(
                    sse_stream_one, OpenAIClient(session, base_url, model, args.chat)
                ),
                "tgi": functools.partial(tgi_stream_one, TGIClient(session, base_url)),
            }
            for spec in specs[: max(1, args.warmup)]:
                errors = [(await stream_one(stub, spec.to_pb(), args.request_timeout)).error]
                for api in args.apis[1:]:
                    errors.append(await _warm(senders[api], api, spec, args.request_timeout))
                for error in errors:
                    if error:
                        raise SystemExit(f"warm-up request failed: {error}")
            runs: list[Measured] = []
            for round_index in range(args.rounds):
                order = args.apis if round_index % 2 == 0 else args.apis[::-1]
                for api in order:
                    for level in args.levels:
                        run = (
                            run_level(stubs, specs, level, args.request_timeout, 0)
                            if api == "grpc"
                            else run_http_level(senders[api], specs, level, args.request_timeout)
                        )
                        runs.append(await measured(api, run, level, server, round_index))
            return runs
        finally:
            for channel in channels:
                await channel.close()


async def _warm(send_one: SendOne, api: str, spec: RequestSpec, timeout: float) -> str:
    result = RequestResult(spec.input_tokens, spec.output_tokens)
    await send_one(spec, timeout, result)
    if not result.error and result.wrong_length:
        return (
            f"the {api} stream counted {result.input_tokens} prompt / {result.output_tokens} "
            f"output tokens, expected {spec.input_tokens} / {spec.output_tokens}"
        )
    return result.error


def median_of(runs: list[Measured], pick: Callable[[Measured], float | None]) -> float | None:
    """The median of ``pick`` over ``runs`` (None values left out)."""
    values = [v for r in runs if (v := pick(r)) is not None]
    return statistics.median(values) if values else None


def report(runs: list[Measured], levels: list[Level], apis: Sequence[str] = APIS) -> str:
    """One row per level and API, medians over rounds, and each HTTP API's ratios to gRPC."""
    roles = sorted({role for r in runs for role in r.stats.cpu_ms_per_token})
    lines = [
        "| level | API | out tok/s | TTFT p50 ms | TPOT p50 ms | msgs/req |"
        + "".join(f" {role} CPU ms/tok |" for role in roles),
        "|---|---|" + "---:|" * (4 + len(roles)),
    ]
    others = [api for api in apis if api != "grpc"]
    ratios = [
        "",
        "| level |"
        + "".join(f" out tok/s {_NAMES[a]} / gRPC |" for a in others)
        + "".join(f" router CPU/tok {_NAMES[a]} / gRPC |" for a in others),
        "|---|" + "---:|" * (2 * len(others)),
    ]
    for level in levels:
        medians: dict[str, dict[str, float | None]] = {}
        for api in apis:
            mine = [r for r in runs if r.api == api and r.stats.label == level.label]
            row = {
                "out": median_of(mine, lambda r: r.stats.output_throughput),
                "ttft": median_of(mine, lambda r: r.stats.ttft_p50),
                "tpot": median_of(mine, lambda r: r.stats.tpot_p50),
                "msgs": median_of(mine, lambda r: r.messages_per_request),
            }
            for role in roles:
                row[role] = median_of(mine, lambda r, role=role: r.stats.cpu_ms_per_token.get(role))
            medians[api] = row
            lines.append(
                f"| {level.label} | {api} | {fmt(row['out'], 0)} | {fmt(row['ttft'])} | "
                f"{fmt(row['tpot'], 2)} | {fmt(row['msgs'], 1)} |"
                + "".join(f" {fmt(row[role], 3)} |" for role in roles)
            )
        ratios.append(
            f"| {level.label} |"
            + "".join(f" {fmt(_ratio(medians, a, 'out'), 3)} |" for a in others)
            + "".join(f" {fmt(_ratio(medians, a, 'router'), 3)} |" for a in others)
        )
    return "\n".join(lines + ratios)


_NAMES = {"openai": "OpenAI", "tgi": "TGI"}


def _ratio(medians: dict[str, dict[str, float | None]], api: str, key: str) -> float | None:
    theirs, ours = medians["grpc"].get(key), medians[api].get(key)
    return ours / theirs if ours is not None and theirs else None


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Command line; everything after ``--`` goes to the launcher."""
    launcher_args: list[str] = []
    if "--" in argv:
        split = argv.index("--")
        argv, launcher_args = argv[:split], argv[split + 1 :]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0] if __doc__ else "")
    parser.add_argument("--concurrency", default="1,32", help="closed-loop stream counts (1,32)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of both APIs (2)")
    parser.add_argument("--num-requests", type=int, default=64, help="requests per level (64)")
    parser.add_argument("--warmup", type=int, default=2, help="warm-up requests per API (2)")
    parser.add_argument("--input-tokens", type=int, default=64, help="prompt tokens (64)")
    parser.add_argument("--output-tokens", type=int, default=64, help="output tokens (64)")
    parser.add_argument("--word", default="the", help="word repeated to build prompts (the)")
    parser.add_argument("--chat", action="store_true", help="/v1/chat/completions instead")
    parser.add_argument(
        "--apis", default=",".join(APIS), help="the APIs measured, gRPC first (grpc,openai,tgi)"
    )
    parser.add_argument(
        "--grpc-channels",
        type=int,
        default=1,
        help="gRPC connections the streams share, round robin (1; the OpenAI client opens "
        "one connection per stream in flight)",
    )
    parser.add_argument("--request-timeout", type=float, default=300.0)
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    parser.add_argument("--json", type=Path, help="also write every run here")
    args = parser.parse_args(argv)
    try:
        counts = [int(c) for c in args.concurrency.split(",") if c.strip()]
    except ValueError:
        parser.error("--concurrency takes comma-separated integers")
    if min([*counts, args.rounds, args.num_requests, args.grpc_channels], default=0) < 1:
        parser.error("stream counts, --rounds, --num-requests and --grpc-channels must be positive")
    if args.output_tokens < 2 or args.input_tokens < 1:
        parser.error("--output-tokens must be >= 2 and --input-tokens >= 1")
    args.apis = [a.strip() for a in args.apis.split(",") if a.strip()]
    if args.apis[:1] != ["grpc"] or not set(args.apis) <= set(APIS) or len(args.apis) < 2:
        parser.error("--apis: grpc first, then openai and/or tgi")
    args.levels = [Level(f"c={c}", concurrency=c) for c in counts]
    args.launcher_args = launcher_args
    # What serve.build_workload reads: fixed lengths, one shared prompt per length.
    args.seed, args.input_range, args.output_range = 0, 0.0, 0.0
    args.dataset, args.distinct_prompts = None, False
    return args


def main(argv: list[str] | None = None) -> int:
    """Launch, measure both APIs, print the report; 1 when a request failed or was wrong."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    log_dir = Path(tempfile.mkdtemp(prefix="tgis-openai-bench-"))
    batch = ["--max-batch-size", str(max(lv.concurrency or 1 for lv in args.levels))]
    server = start_launcher(log_dir, [*batch, *args.launcher_args], max_batch_size=None)
    try:
        server.wait_healthy(args.startup_timeout)
        runs = asyncio.run(benchmark(args, server))
    except (RuntimeError, TimeoutError) as err:
        print(f"error: {err}\n{server.log_tail(3000)}", file=sys.stderr)
        return 1
    finally:
        code = server.stop()
        shutil.rmtree(log_dir, ignore_errors=True)
    env = {
        "device": device_description(),
        "engine commit": engine_commit(),
        "launcher": " ".join(server.args),
        "workload": (
            f"{args.num_requests} requests per level, {args.input_tokens} prompt / "
            f"{args.output_tokens} output tokens, greedy, output length forced; "
            f"{args.rounds} rounds, API order alternating; {args.grpc_channels} gRPC "
            "connection(s); " + ", ".join(_routes(args))
        ),
        "launcher exit code": code,
    }
    print("## Environment\n\n" + header_lines(env) + "\n\n## Results\n")
    print(report(runs, args.levels, args.apis))
    if args.json:
        payload = {"environment": env, "runs": [asdict(r) for r in runs]}
        args.json.write_text(json.dumps(json_safe(payload), indent=2, default=str))
    failed = sum(r.stats.errors + r.stats.wrong_length for r in runs)
    if failed:
        print(f"{failed} request(s) failed or had the wrong length", file=sys.stderr)
    return 1 if failed else 0


def _routes(args: argparse.Namespace) -> list[str]:
    routes = {
        "grpc": "GenerateStream",
        "openai": "/v1/chat/completions" if args.chat else "/v1/completions",
        "tgi": "/generate_stream",
    }
    return [routes[api] for api in args.apis]


if __name__ == "__main__":
    sys.exit(main())
