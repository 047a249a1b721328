"""Speculative decoding's effect: time per output token and throughput with ``--speculate``
(its policy, ``core/draft_policy.py``) against without, and optionally against
``--speculate-always`` (drafts in every step, the policy's baseline).

Servers of one model are launched one after the other, alternately with ``--speculate K``
and without (and with ``--speculate K --speculate-always`` under ``--always``; the order
reversed every other round), ``--rounds`` times each, and measured on two workloads;
figures are printed as markdown with the acceptance rate from the server's own counters
(tokens confirmed / tokens drafted). The goals are issue 36's (speculation never slower
than off):

1. **Copying, one stream**: prompts whose continuation repeats spans of them (a code
   block to repeat, a list to extend, a passage to quote), one request at a time, greedy,
   ``min_new_tokens = max_new_tokens = --new-tokens``; TPOT p50 over all requests (time
   after the first token / tokens after the first). Goal: with / without <= 0.75.
2. **Many streams**: ``serve.py``'s usual workload (``--concurrency`` closed-loop streams,
   distinct 128-token prompts, 64 new tokens) against the running server; output tokens/s.
   Goal: with / without >= 0.97 at 16 and at 32 streams (above the launcher's
   ``--max-batch-size`` 16 requests queue, and above ``--speculator-max-batch-size``
   running or waiting none speculate).

The default model is the embedded one (trained: it repeats itself, as prompt lookup needs).
``--seldom-confirmed`` measures instead a copy of it whose drafts are seldom proposed or
confirmed (:func:`seldom_confirmed_model`: every tensor but the norms replaced by Gaussian
noise of 3x its standard deviation; a copy with *small* random weights repeats one token,
and most of its drafts are confirmed). There the goal is not to be slower: one stream's
TPOT with / without <= 1.03 (>= 0.97x the speed), and many streams >= 0.97. Usage::

    .venv/bin/python benchmarks/speculation_bench.py --rounds 3 --concurrency 16
    .venv/bin/python benchmarks/speculation_bench.py --rounds 2 --seldom-confirmed --always
"""

from __future__ import annotations

import argparse
import json
import shutil
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


MODES = ("on", "off", "always")
"""``--speculate K`` (the policy), none, ``--speculate K --speculate-always``."""


def seldom_confirmed_model(base: Path, target: Path, seed: int = 1, scale: float = 3.0) -> Path:
    """``base`` copied to ``target`` with every tensor of its ``model.safetensors`` but the
    norms replaced by Gaussian noise of ``scale`` times that tensor's standard deviation
    (``seed``, in name order): text that seldom repeats, so prompt lookup seldom proposes
    and its drafts are seldom confirmed (drafting every step, 10 % were: BENCHMARKS.md,
    issue 36)."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(base, target, dirs_exist_ok=True)
    tensors = load_file(base / "model.safetensors")
    generator = torch.Generator().manual_seed(seed)
    for name in sorted(tensors):
        tensor = tensors[name]
        if "norm" in name or tensor.numel() < 2:
            continue
        std = scale * tensor.float().std().item()
        noise = torch.randn(tensor.shape, generator=generator) * std
        tensors[name] = noise.to(tensor.dtype)
    save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    return target


@contextmanager
def server(args: argparse.Namespace, mode: str) -> Iterator[LauncherProcess]:
    extra = ["--max-new-tokens", str(max(args.new_tokens, 64))]
    if args.model_dir != MODEL_DIR:
        extra += ["--model-name", str(args.model_dir)]
    if mode != "off":
        extra += ["--speculate", str(args.speculate)]
    if mode == "always":
        extra.append("--speculate-always")
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


def measure(args: argparse.Namespace, mode: str) -> dict[str, float]:
    with server(args, mode) as launcher:
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


def table(
    args: argparse.Namespace,
    on: list[dict[str, float]],
    off: list[dict[str, float]],
    label: str = "on",
) -> None:
    """One markdown row per round of ``on`` (the servers of ``label``) against ``off``, and
    the medians."""
    print(
        f"| round | TPOT p50 ms {label} | off | {label} / off | acceptance "
        f"| tokens per spec step | c={args.concurrency} tok/s {label} | off | {label} / off |"
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
    tpot_goal = "<= 1.03: not slower" if args.seldom_confirmed else "<= 0.75"
    goals = (f" (goal {tpot_goal})", " (goal >= 0.97)") if label == "on" else ("", "")
    print(
        f"\nmedian TPOT ratio {tpot_ratio:.2f}{goals[0]}; "
        f"median c={args.concurrency} throughput ratio {tput_ratio:.2f}{goals[1]}"
    )


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, default=MODEL_DIR)
    parser.add_argument(
        "--seldom-confirmed",
        action="store_true",
        help="measure a noise copy of --model-dir whose drafts are seldom confirmed",
    )
    parser.add_argument(
        "--always",
        action="store_true",
        help="also measure --speculate-always servers (drafts in every step)",
    )
    parser.add_argument("--speculate", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    if not args.seldom_confirmed:
        run(args, args.model_dir.name)
        return
    with tempfile.TemporaryDirectory(prefix="spec-bench-seldom-") as work:
        name = f"{args.model_dir.name} (seldom confirmed: noise of 3x each tensor's std, seed 1)"
        args.model_dir = seldom_confirmed_model(args.model_dir, Path(work) / "model")
        run(args, name)


def run(args: argparse.Namespace, name: str) -> None:
    """The rounds of every mode, alternating, then their tables."""
    modes = MODES if args.always else MODES[:2]
    runs: dict[str, list[dict[str, float]]] = {mode: [] for mode in modes}
    for round_index in range(args.rounds):
        for mode in modes if round_index % 2 == 0 else modes[::-1]:
            runs[mode].append(measure(args, mode))
    print(f"model: {name}, --speculate {args.speculate}, {args.rounds} rounds\n")
    table(args, runs["on"], runs["off"])
    if args.always:
        print(f"\n--speculate {args.speculate} --speculate-always against off:\n")
        table(args, runs["always"], runs["off"], "always")


if __name__ == "__main__":
    main(sys.argv[1:])
