"""Speculative decoding's effect: time per output token with and without ``--speculate``.

Servers of one model are launched one after the other, alternately with ``--speculate K``
and without, ``--rounds`` times each, and measured on two workloads; figures are printed
as markdown with the acceptance rate from the server's own counters (tokens confirmed /
tokens drafted):

1. **Copying, one stream**: prompts whose continuation repeats spans of them (a code
   block to repeat, a list to extend, a passage to quote), one request at a time, greedy,
   ``min_new_tokens = max_new_tokens = --new-tokens``; TPOT p50 over all requests (time
   after the first token / tokens after the first). Goal: with / without <= 0.6.
2. **Many streams**: ``serve.py``'s usual workload (``--concurrency`` closed-loop streams,
   distinct 128-token prompts, 64 new tokens) against the running server; output tokens/s.
   Goal: with / without >= 0.95 (above ``--speculator-max-batch-size`` the policy does not
   speculate).

The default model is the embedded one (trained: it repeats itself, as prompt lookup needs;
a model with random weights never confirms a draft). Usage::

    .venv/bin/python benchmarks/speculation_bench.py --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc

from tgis.embedded_model import MODEL_DIR
from tgis.launcher.local_process import LauncherProcess, serving, start_launcher
from tgis.pb import generation_pb2 as pb
from tgis.pb import generation_pb2_grpc as pb_grpc

HERE = Path(__file__).resolve().parent
COPYING_PROMPTS = [
    "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\n"
    "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n",
    "Items: the red file, the blue file, the green file, the red file, the blue file, the",
    "The server reads the request, checks the request, queues the request and then the "
    "server reads the request, checks the",
    "for i in range(10):\n    print(i)\nfor j in range(10):\n    print(j)\nfor k in range(",
    "Quote: the cache holds blocks of keys and values. Again: the cache holds blocks of",
    "name: alpha, size: 10; name: beta, size: 20; name: gamma, size: 30; name: delta, size:",
]


@contextmanager
def server(args: argparse.Namespace, speculate: int) -> Iterator[LauncherProcess]:
    extra = ["--max-new-tokens", str(max(args.new_tokens, 64))]
    if args.model_dir != MODEL_DIR:
        extra += ["--model-name", str(args.model_dir)]
    if speculate:
        extra += ["--speculate", str(speculate)]
    launcher = start_launcher(Path(tempfile.mkdtemp(prefix="spec-bench-")), extra)
    with serving(launcher, timeout=600):
        yield launcher


def tpot(stub: pb_grpc.GenerationServiceStub, text: str, new_tokens: int) -> float:
    """One streamed greedy request: seconds per token after the first."""
    stopping = pb.StoppingCriteria(max_new_tokens=new_tokens, min_new_tokens=new_tokens)
    request = pb.SingleGenerationRequest(
        request=pb.GenerationRequest(text=text),
        params=pb.Parameters(method=pb.GREEDY, stopping=stopping),
    )
    first = None
    count = 0
    for message in stub.GenerateStream(request, timeout=600):
        if message.generated_token_count and first is None:
            first = time.perf_counter()
        count = max(count, message.generated_token_count)
    assert first is not None and count == new_tokens, count
    return (time.perf_counter() - first) / (count - 1) if count > 1 else 0.0


def counters(launcher: LauncherProcess) -> dict[str, float]:
    _, body = launcher.http_get("/metrics")
    wanted = ("tgi_spec_steps", "tgi_spec_draft_tokens", "tgi_spec_accepted_tokens")
    values = {name: 0.0 for name in wanted}
    for line in body.decode().splitlines():
        name, _, value = line.partition(" ")
        if name in wanted:
            values[name] = float(value)
    return values


def many_streams(launcher: LauncherProcess, args: argparse.Namespace) -> float:
    """serve.py's usual workload against ``launcher``: output tokens/s."""
    with tempfile.TemporaryDirectory() as work:
        out = Path(work) / "serve.json"
        command = [
            sys.executable,
            str(HERE / "serve.py"),
            "--target",
            launcher.grpc_target,
            "--concurrency",
            str(args.concurrency),
            "--num-requests",
            str(10 * args.concurrency),
            "--input-tokens",
            "128",
            "--output-tokens",
            "64",
            "--distinct-prompts",
            "--json",
            str(out),
        ]
        subprocess.run(command, check=True, capture_output=True, timeout=900)
        return float(json.loads(out.read_text())["levels"][0]["output_throughput"])


def measure(args: argparse.Namespace, speculate: int) -> dict[str, float]:
    with server(args, speculate) as launcher:
        stub = pb_grpc.GenerationServiceStub(grpc.insecure_channel(launcher.grpc_target))
        tpot(stub, "warm-up", 8)
        before = counters(launcher)
        tpots = [
            tpot(stub, text, args.new_tokens)
            for _ in range(args.repeats)
            for text in COPYING_PROMPTS
        ]
        after = counters(launcher)
        drafted = after["tgi_spec_draft_tokens"] - before["tgi_spec_draft_tokens"]
        accepted = after["tgi_spec_accepted_tokens"] - before["tgi_spec_accepted_tokens"]
        steps = after["tgi_spec_steps"] - before["tgi_spec_steps"]
        figures = {
            "tpot_p50": statistics.median(tpots),
            "acceptance": accepted / drafted if drafted else 0.0,
            "tokens_per_step": 1 + accepted / steps if steps else 1.0,
        }
        figures["throughput"] = many_streams(launcher, args)
        return figures


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, default=MODEL_DIR)
    parser.add_argument("--speculate", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    runs: dict[int, list[dict[str, float]]] = {args.speculate: [], 0: []}
    for round_index in range(args.rounds):
        order = (args.speculate, 0) if round_index % 2 == 0 else (0, args.speculate)
        for speculate in order:
            runs[speculate].append(measure(args, speculate))
    on, off = runs[args.speculate], runs[0]
    print(f"model: {args.model_dir.name}, --speculate {args.speculate}, {args.rounds} rounds\n")
    print(
        "| round | TPOT p50 ms on | off | on / off | acceptance | tokens per spec step "
        f"| c={args.concurrency} tok/s on | off | on / off |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for i, (a, b) in enumerate(zip(on, off, strict=True)):
        print(
            f"| {i + 1} | {a['tpot_p50'] * 1e3:.2f} | {b['tpot_p50'] * 1e3:.2f} | "
            f"{a['tpot_p50'] / b['tpot_p50']:.2f} | {a['acceptance']:.0%} | "
            f"{a['tokens_per_step']:.2f} | {a['throughput']:.0f} | {b['throughput']:.0f} | "
            f"{a['throughput'] / b['throughput']:.2f} |"
        )
    pairs = list(zip(on, off, strict=True))
    tpot_ratio = statistics.median(a["tpot_p50"] / b["tpot_p50"] for a, b in pairs)
    tput_ratio = statistics.median(a["throughput"] / b["throughput"] for a, b in pairs)
    print(
        f"\nmedian TPOT ratio {tpot_ratio:.2f} (goal <= 0.6); "
        f"median c={args.concurrency} throughput ratio {tput_ratio:.2f} (goal >= 0.95)"
    )


if __name__ == "__main__":
    main(sys.argv[1:])
