"""Prefix caching's effect: first-token latency and throughput with the cache on and off.

Two servers of one model are launched one after the other (the cache on, the default, and
``--disable-prefix-caching``), each measured on the same three workloads; figures are
printed as markdown with the cache's hit rate from the server's own counters:

1. **Near-repeat TTFT**: a cold prompt of about ``--system-tokens`` tokens (a unique
   opening, so nothing is cached), then a prompt sharing all but its last ~20 tokens with
   it; ``--repeats`` pairs, one request at a time; medians. Goal: warm <= 0.3x cold.
2. **Shared system prompt**: ``--clients`` concurrent clients, each asking ``--questions``
   short questions after one system prompt of ~``--system-tokens`` tokens; TTFT p50 and
   output tokens/s.
3. **Conversation**: ``--clients`` conversations of ``--turns`` turns; each turn's prompt is
   the previous prompt, its answer and a new question; TTFT p50 and output tokens/s.

``--model-dir`` with ``--load-format dummy`` serves a config-only directory (random
weights); the default is the embedded model, whose 1,024 positions limit the prompts. The
unshared workload (goal >= 0.97x) is ``serve.py`` with and without ``--
--disable-prefix-caching``. Usage::

    .venv/bin/python benchmarks/prefix_cache_bench.py --model-dir DIR --load-format dummy
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc

from tgis.embedded_model import MODEL_DIR
from tgis.launcher.local_process import LauncherProcess, serving, start_launcher
from tgis.pb import generation_pb2 as pb
from tgis.pb import generation_pb2_grpc as pb_grpc

WORDS = [
    "the",
    "router",
    "keeps",
    "a",
    "pool",
    "of",
    "blocks",
    "and",
    "each",
    "block",
    "holds",
    "sixteen",
    "tokens",
    "of",
    "keys",
]


def filler(tokens: int, seed: int) -> str:
    """About ``tokens`` tokens of text (words of the embedded vocabulary, one token or two
    each), varied by ``seed``."""
    words = [WORDS[(seed * 7 + i * 3) % len(WORDS)] for i in range(int(tokens * 0.55))]
    return " ".join(words)


@contextmanager
def server(args: argparse.Namespace, cache: bool) -> Iterator[LauncherProcess]:
    extra = ["--max-sequence-length", str(args.max_sequence_length), "--max-new-tokens", "64"]
    extra += ["--max-batch-size", str(max(args.clients, 16))]
    if args.model_dir != MODEL_DIR:
        extra += ["--model-name", str(args.model_dir)]
    if args.load_format:
        extra += ["--load-format", args.load_format]
    if not cache:
        extra.append("--disable-prefix-caching")
    launcher = start_launcher(Path(tempfile.mkdtemp(prefix="prefix-bench-")), extra)
    with serving(launcher, timeout=600):
        yield launcher


def ttft_and_tokens(
    stub: pb_grpc.GenerationServiceStub, text: str, new_tokens: int
) -> tuple[float, int, str]:
    """A streamed request: seconds to its first token, tokens generated, the text."""
    stopping = pb.StoppingCriteria(max_new_tokens=new_tokens, min_new_tokens=new_tokens)
    request = pb.SingleGenerationRequest(
        request=pb.GenerationRequest(text=text), params=pb.Parameters(stopping=stopping)
    )
    started = time.perf_counter()
    first = None
    count = 0
    out = []
    for message in stub.GenerateStream(request, timeout=600):
        if message.generated_token_count and first is None:
            first = time.perf_counter() - started
        count = max(count, message.generated_token_count)
        out.append(message.text)
    assert first is not None
    return first, count, "".join(out)


def counters(launcher: LauncherProcess) -> tuple[float, float]:
    _, body = launcher.http_get("/metrics")
    values = {}
    for line in body.decode().splitlines():
        name, _, value = line.partition(" ")
        if name in ("tgi_prefix_cache_queries", "tgi_prefix_cache_hits"):
            values[name] = float(value)
    return values.get("tgi_prefix_cache_queries", 0.0), values.get("tgi_prefix_cache_hits", 0.0)


def near_repeat(
    stub: pb_grpc.GenerationServiceStub, args: argparse.Namespace
) -> tuple[float, float]:
    cold, warm = [], []
    for r in range(args.repeats):
        base = f"Request {r} of the near-repeat test. " + filler(args.system_tokens, r)
        cold.append(ttft_and_tokens(stub, base + " first question", 4)[0])
        warm.append(ttft_and_tokens(stub, base + " and now a different last line", 4)[0])
    return statistics.median(cold), statistics.median(warm)


def shared_system(
    stub: pb_grpc.GenerationServiceStub, args: argparse.Namespace, run: int
) -> tuple[float, float]:
    system = f"System prompt {run}. " + filler(args.system_tokens, 100 + run)

    def client(c: int) -> list[tuple[float, int, str]]:
        return [
            ttft_and_tokens(stub, f"{system} Client {c} asks question {q}?", args.new_tokens)
            for q in range(args.questions)
        ]

    started = time.perf_counter()
    with ThreadPoolExecutor(args.clients) as pool:
        results = [x for per in pool.map(client, range(args.clients)) for x in per]
    wall = time.perf_counter() - started
    return statistics.median(r[0] for r in results), sum(r[1] for r in results) / wall


def conversation(
    stub: pb_grpc.GenerationServiceStub, args: argparse.Namespace, run: int
) -> tuple[float, float]:
    def talk(c: int) -> list[tuple[float, int, str]]:
        prompt = f"Conversation {run}-{c}. " + filler(args.system_tokens // 2, 200 + c)
        turns = []
        for t in range(args.turns):
            prompt += f" User: tell me about turn {t}. Assistant:"
            turn = ttft_and_tokens(stub, prompt, args.new_tokens)
            prompt += turn[2]
            turns.append(turn)
        return turns

    started = time.perf_counter()
    with ThreadPoolExecutor(args.clients) as pool:
        results = [x for per in pool.map(talk, range(args.clients)) for x in per]
    wall = time.perf_counter() - started
    return statistics.median(r[0] for r in results), sum(r[1] for r in results) / wall


def measure(args: argparse.Namespace, cache: bool) -> dict[str, float]:
    with server(args, cache) as launcher:
        stub = pb_grpc.GenerationServiceStub(grpc.insecure_channel(launcher.grpc_target))
        ttft_and_tokens(stub, "warm-up " + filler(64, 0), 4)
        figures: dict[str, float] = {}
        q0, h0 = counters(launcher)
        figures["cold"], figures["warm"] = near_repeat(stub, args)
        q1, h1 = counters(launcher)
        figures["near_hit"] = (h1 - h0) / max(q1 - q0, 1)
        figures["shared_ttft"], figures["shared_tps"] = shared_system(stub, args, 0)
        q2, h2 = counters(launcher)
        figures["shared_hit"] = (h2 - h1) / max(q2 - q1, 1)
        figures["conv_ttft"], figures["conv_tps"] = conversation(stub, args, 0)
        q3, h3 = counters(launcher)
        figures["conv_hit"] = (h3 - h2) / max(q3 - q2, 1)
        return figures


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, default=MODEL_DIR)
    parser.add_argument("--load-format", default=None)
    parser.add_argument("--max-sequence-length", type=int, default=1024)
    parser.add_argument("--system-tokens", type=int, default=800)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--questions", type=int, default=3)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=16)
    args = parser.parse_args(argv)
    on = measure(args, cache=True)
    off = measure(args, cache=False)
    ms = 1000.0
    print(f"model: {args.model_dir.name}, system prompt ~{args.system_tokens} tokens\n")
    print("| workload | metric | cache on | cache off | on / off | hit rate (on) |")
    print("|---|---|---:|---:|---:|---:|")
    rows = [
        ("near repeat (c=1)", "cold TTFT ms", on["cold"] * ms, off["cold"] * ms, None),
        ("near repeat (c=1)", "warm TTFT ms", on["warm"] * ms, off["warm"] * ms, on["near_hit"]),
        (
            "shared system prompt",
            "TTFT p50 ms",
            on["shared_ttft"] * ms,
            off["shared_ttft"] * ms,
            on["shared_hit"],
        ),
        ("shared system prompt", "out tok/s", on["shared_tps"], off["shared_tps"], None),
        (
            "conversation",
            "TTFT p50 ms",
            on["conv_ttft"] * ms,
            off["conv_ttft"] * ms,
            on["conv_hit"],
        ),
        ("conversation", "out tok/s", on["conv_tps"], off["conv_tps"], None),
    ]
    for name, metric, a, b, hit in rows:
        rate = "" if hit is None else f"{hit:.0%}"
        print(f"| {name} | {metric} | {a:.1f} | {b:.1f} | {a / b:.2f} | {rate} |")
    print(f"\nwarm / cold TTFT with the cache: {on['warm'] / on['cold']:.2f} (goal <= 0.3)")


if __name__ == "__main__":
    main(sys.argv[1:])
