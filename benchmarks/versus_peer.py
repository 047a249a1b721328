"""tgis against the peer (vLLM behind vllm-tgis-adapter) on the same model, load and client.

For every workload (prompt length) and repetition this runs ``benchmarks/serve.py`` twice:
once launching tgis with its default flags on ``--model``, once against the peer started by
``vllm-peer.sh start`` on the same directory (with the peer's own defaults). The two servers
run one after the other, never together; repetitions alternate them, so slow drifts of a
shared host hit both. Prompts are distinct (``serve.py --distinct-prompts``): the peer
caches prompt prefixes by default and tgis does not yet, and identical prompts would time
its cache, not its engine (``--same-prompts`` for the old workload).
It prints one Markdown table per workload: each level's output tok/s,
TTFT p50 and TPOT p50 for both servers and their ratio (medians over repetitions), and the
start-up times; ``--json`` keeps every run.

Example (the peer's venv installed with ``vllm-peer.sh install``, a model made with
``vllm-peer.sh model DIR``)::

    .venv/bin/python benchmarks/versus_peer.py --model DIR \\
        --peer-script ../shared/tools/vllm-peer.sh --input-tokens 32,128 --reps 2
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
SERVE = REPO_ROOT / "benchmarks" / "serve.py"
PEER_READY = re.compile(r"peer ready after (\d+) s")
TGIS_READY = re.compile(r"server healthy after ([\d.]+) s")
METRICS = (
    ("out tok/s", "output_throughput", "higher"),
    ("TTFT p50 ms", "ttft_p50", "lower"),
    ("TPOT p50 ms", "tpot_p50", "lower"),
)


def serve(args: argparse.Namespace, input_tokens: int, out: Path, target: str | None) -> str:
    """One serve.py sweep; returns its stderr (progress, start-up time)."""
    command = [
        sys.executable,
        str(SERVE),
        "--concurrency",
        args.concurrency,
        "--num-requests",
        str(args.num_requests),
        "--input-tokens",
        str(input_tokens),
        "--output-tokens",
        str(args.output_tokens),
        "--json",
        str(out),
    ]
    if not args.same_prompts:
        command.append("--distinct-prompts")
    if target:
        command += ["--target", target, "--model-label", f"{args.model} (peer)"]
    else:
        command += ["--model-name", args.model]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"serve.py failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    return done.stderr


def run_tgis(args: argparse.Namespace, workdir: Path, rep: int) -> dict[int, Any]:
    results: dict[int, Any] = {}
    for tokens in args.input_lengths:
        out = workdir / f"tgis-{tokens}-{rep}.json"
        log = serve(args, tokens, out, None)
        ready = TGIS_READY.search(log)
        results[tokens] = json.loads(out.read_text())
        results[tokens]["startup_s"] = float(ready.group(1)) if ready else None
        print(f"tgis, prompt {tokens}, rep {rep}: done", file=sys.stderr, flush=True)
    return results


def run_peer(args: argparse.Namespace, workdir: Path, rep: int) -> dict[int, Any]:
    started = time.monotonic()
    start = subprocess.run(
        ["bash", args.peer_script, "start", args.model], capture_output=True, text=True
    )
    if start.returncode != 0:
        raise RuntimeError(f"the peer did not start:\n{start.stdout}\n{start.stderr}")
    ready = PEER_READY.search(start.stdout)
    startup = float(ready.group(1)) if ready else time.monotonic() - started
    results: dict[int, Any] = {}
    try:
        for tokens in args.input_lengths:
            out = workdir / f"peer-{tokens}-{rep}.json"
            serve(args, tokens, out, f"127.0.0.1:{args.peer_port}")
            results[tokens] = json.loads(out.read_text())
            results[tokens]["startup_s"] = startup
            print(f"peer, prompt {tokens}, rep {rep}: done", file=sys.stderr, flush=True)
    finally:
        subprocess.run(["bash", args.peer_script, "stop"], capture_output=True, check=False)
        time.sleep(3)
    return results


def median_of(runs: list[dict[str, Any]], label: str, key: str) -> float:
    values = [level[key] for run in runs for level in run["levels"] if level["label"] == label]
    return statistics.median(values)


def table(tokens: int, tgis: list[dict[str, Any]], peer: list[dict[str, Any]]) -> str:
    labels = [level["label"] for level in tgis[0]["levels"]]
    lines = [
        f"Prompt {tokens} tokens, output {tgis[0]['config']['output_tokens']} tokens "
        f"({len(tgis)} run(s) each, medians)",
        "",
        "| level | metric | tgis | peer | tgis / peer |",
        "|---|---|---:|---:|---:|",
    ]
    for label in labels:
        for name, key, _ in METRICS:
            ours, theirs = median_of(tgis, label, key), median_of(peer, label, key)
            ratio = ours / theirs if theirs else float("nan")
            lines.append(f"| {label} | {name} | {ours:.1f} | {theirs:.1f} | {ratio:.2f} |")
    ours_s = statistics.median(r["startup_s"] for r in tgis if r["startup_s"] is not None)
    theirs_s = statistics.median(r["startup_s"] for r in peer)
    lines.append(f"| start-up | s | {ours_s:.1f} | {theirs_s:.0f} | {ours_s / theirs_s:.2f} |")
    return "\n".join(lines)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0] if __doc__ else None)
    parser.add_argument("--model", required=True, help="model directory both servers read")
    parser.add_argument(
        "--peer-script",
        default=str(REPO_ROOT.parent / "shared" / "tools" / "vllm-peer.sh"),
        help="vllm-peer.sh (default: ../shared/tools/vllm-peer.sh next to the repository)",
    )
    parser.add_argument("--peer-port", type=int, default=int(os.environ.get("GRPC_PORT", 8043)))
    parser.add_argument("--input-tokens", default="32,128", help="prompt lengths (32,128)")
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--concurrency", default="1,32")
    parser.add_argument("--num-requests", type=int, default=128)
    parser.add_argument("--reps", type=int, default=1, help="alternating repetitions (1)")
    parser.add_argument(
        "--same-prompts",
        action="store_true",
        help="every prompt of a length the same text, as before issue 19's last runs (the "
        "peer's prefix cache then computes it once); default: distinct prompts",
    )
    parser.add_argument("--json", type=Path, help="write every run here")
    args = parser.parse_args(argv)
    args.input_lengths = [int(x) for x in args.input_tokens.split(",")]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    workdir = Path(tempfile.mkdtemp(prefix="tgis-versus-"))
    tgis: dict[int, list[Any]] = {t: [] for t in args.input_lengths}
    peer: dict[int, list[Any]] = {t: [] for t in args.input_lengths}
    for rep in range(args.reps):
        for tokens, result in run_tgis(args, workdir, rep).items():
            tgis[tokens].append(result)
        for tokens, result in run_peer(args, workdir, rep).items():
            peer[tokens].append(result)
    for tokens in args.input_lengths:
        print(table(tokens, tgis[tokens], peer[tokens]), end="\n\n")
    if args.json:
        args.json.write_text(json.dumps({"tgis": tgis, "peer": peer}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
