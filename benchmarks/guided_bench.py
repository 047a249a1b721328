"""Guided decoding's cost: compile time, mask time per step, and served throughput.

Three figures, printed as markdown:

1. **Compile** (in process): a 20-property JSON schema checked by the router's compiler
   (``GrammarCompiler._compile``: grammar built and validated with the tokenizer), cold and
   from its cache, and the shard's matcher for it (``Grammars.guide``), cold and cached.
2. **Mask per step** (in process): ``--rows`` constrained rows walking through the schema
   (a random allowed token each step), the time to fill their masks and apply them to
   random logits, per step (median and p90 over ``--mask-steps`` steps).
3. **Served throughput** (unless ``--no-serve``): a launched server (or ``--target``), with
   ``--streams`` concurrent requests of ``--new-tokens`` tokens each (min_new_tokens too, so
   both kinds produce the same count), alternating unguided and guided rounds; output
   tokens/s of each round, and the ratio of the medians (goal: guided >= 0.8x unguided).

``--model-dir`` names the model whose tokenizer.json is measured and served (default: the
embedded model); with ``--load-format dummy`` a config-only directory with a synthetic
tokenizer (``make_synthetic_tokenizer.py``) serves a 128k vocabulary. Usage::

    .venv/bin/python benchmarks/guided_bench.py
    .venv/bin/python benchmarks/guided_bench.py --model-dir DIR --load-format dummy
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc
import torch

from tgis.embedded_model import MODEL_DIR
from tgis.launcher.local_process import start_launcher
from tgis.pb import generation_pb2 as pb
from tgis.pb import generation_pb2_grpc as pb_grpc
from tgis.router.intake.guided import GrammarCompiler, grammar_source
from tgis.router.ops.metrics import Metrics
from tgis.router.request_types import GuidedKind, GuidedRequest
from tgis.shard.step.guided import Grammars

SCHEMA = {
    "type": "object",
    "properties": {
        f"field_{i}": (
            {"type": "integer", "minimum": 0, "maximum": 9999}
            if i % 3 == 0
            else {"type": "string", "maxLength": 12}
            if i % 3 == 1
            else {"type": "boolean"}
        )
        for i in range(20)
    },
    "required": [f"field_{i}" for i in range(20)],
    "additionalProperties": False,
}


def model_facts(model_dir: Path) -> tuple[str, int, list[int]]:
    config = json.loads((model_dir / "config.json").read_text())
    eos = config.get("eos_token_id")
    eos_ids = eos if isinstance(eos, list) else [eos]
    return (model_dir / "tokenizer.json").read_text(), int(config["vocab_size"]), eos_ids


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.2f} ms"


def compile_times(model_dir: Path) -> list[tuple[str, str]]:
    tokenizer_json, vocab, eos = model_facts(model_dir)
    request = GuidedRequest(GuidedKind.JSON_SCHEMA, json.dumps(SCHEMA))
    metrics = Metrics(max_sequence_length=64, max_new_tokens=64, max_batch_size=4)
    compiler = GrammarCompiler(lambda: tokenizer_json, vocab, tuple(eos), metrics)
    rows = []
    started = time.perf_counter()
    compiler._llg_tokenizer()
    rows.append(
        ("router: llguidance tokenizer (once per server)", ms(time.perf_counter() - started))
    )
    started = time.perf_counter()
    grammar = compiler._compile(request)
    rows.append(("router: compile + check, cold", ms(time.perf_counter() - started)))

    async def twice() -> float:
        await compiler.compile(request)
        started = time.perf_counter()
        await compiler.compile(request)
        return time.perf_counter() - started

    rows.append(("router: compile, cached", ms(asyncio.run(twice()))))
    compiler.close()
    grammars = Grammars(lambda: tokenizer_json, vocab, eos)
    started = time.perf_counter()
    grammars.guide(grammar).matcher()
    rows.append(("shard: first matcher (tokenizer + compile)", ms(time.perf_counter() - started)))
    started = time.perf_counter()
    grammars.guide(grammar).matcher()
    rows.append(("shard: matcher, cached (a copy)", ms(time.perf_counter() - started)))
    return rows


def mask_times(model_dir: Path, rows: int, steps: int) -> tuple[float, float, float]:
    """Median and p90 seconds per step to fill and apply ``rows`` masks; mean allowed tokens."""
    tokenizer_json, vocab, eos = model_facts(model_dir)
    grammar = grammar_source(GuidedRequest(GuidedKind.JSON_SCHEMA, json.dumps(SCHEMA)))
    grammars = Grammars(lambda: tokenizer_json, vocab, eos)
    rng = random.Random(0)
    guides = [grammars.guide(grammar) for _ in range(rows)]
    logits = torch.randn(rows, vocab)
    times, allowed_counts = [], []
    for _ in range(steps):
        scores = logits.clone()  # the sampler's own copy, which the masks change in place
        started = time.perf_counter()
        masks = grammars.start_masks(guides, torch.device("cpu")).result()
        masks.apply_(scores)
        times.append(time.perf_counter() - started)
        for row, guide in enumerate(guides):
            allowed = masks.allowed[row].nonzero()[:, 0].tolist()
            allowed_counts.append(len(allowed))
            choices = [t for t in allowed if t not in eos] or allowed
            token = rng.choice(choices)
            if token in eos:
                guides[row] = grammars.guide(grammar)  # start again
            else:
                guide.consume(token)
    times.sort()
    return statistics.median(times), times[int(len(times) * 0.9)], statistics.mean(allowed_counts)


def round_throughput(
    stub: pb_grpc.GenerationServiceStub, streams: int, new_tokens: int, guided: bool, seed: int
) -> float:
    params = pb.Parameters(
        stopping=pb.StoppingCriteria(max_new_tokens=new_tokens, min_new_tokens=new_tokens)
    )
    if guided:
        params.decoding.json_schema = json.dumps(SCHEMA)
    prompts = [f"Record {seed}-{i} as JSON:" for i in range(streams)]

    def one(text: str) -> int:
        request = pb.BatchedGenerationRequest(
            requests=[pb.GenerationRequest(text=text)], params=params
        )
        return stub.Generate(request, timeout=600).responses[0].generated_token_count

    started = time.perf_counter()
    with ThreadPoolExecutor(streams) as pool:
        tokens = sum(pool.map(one, prompts))
    return tokens / (time.perf_counter() - started)


def serve(args: argparse.Namespace) -> tuple[list[float], list[float]]:
    launcher = None
    target = args.target
    if target is None:
        extra = ["--max-batch-size", str(max(args.streams, 16))]
        if args.model_dir != MODEL_DIR:
            extra += ["--model-name", str(args.model_dir)]
        if args.load_format:
            extra += ["--load-format", args.load_format]
        launcher = start_launcher(Path(tempfile.mkdtemp(prefix="guided-bench-")), extra)
        launcher.wait_healthy(timeout=600)
        target = launcher.grpc_target
    try:
        stub = pb_grpc.GenerationServiceStub(grpc.insecure_channel(target))
        round_throughput(stub, args.streams, 4, guided=True, seed=-1)  # warm-up, compile
        round_throughput(stub, args.streams, 4, guided=False, seed=-2)
        plain, guided = [], []
        for r in range(args.rounds):
            plain.append(round_throughput(stub, args.streams, args.new_tokens, False, r))
            guided.append(round_throughput(stub, args.streams, args.new_tokens, True, r))
        return plain, guided
    finally:
        if launcher is not None:
            launcher.stop()


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, default=MODEL_DIR)
    parser.add_argument("--load-format", default=None)
    parser.add_argument("--target", help="host:port of a running server of that model")
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--mask-steps", type=int, default=200)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-serve", action="store_true")
    args = parser.parse_args(argv)
    vocab = model_facts(args.model_dir)[1]
    print(f"model: {args.model_dir.name}, vocabulary {vocab}, schema: 20 properties\n")
    print("| compile | time |\n|---|---:|")
    for name, value in compile_times(args.model_dir):
        print(f"| {name} | {value} |")
    median, p90, allowed = mask_times(args.model_dir, args.rows, args.mask_steps)
    print(f"\nmask fill + apply, {args.rows} rows: median {ms(median)}, p90 {ms(p90)} per step "
          f"(mean allowed tokens per row {allowed:.0f})")  # fmt: skip
    if args.no_serve:
        return
    plain, guided = serve(args)
    print("\n| round | unguided tok/s | guided tok/s |\n|---|---:|---:|")
    for r, (a, b) in enumerate(zip(plain, guided, strict=True)):
        print(f"| {r} | {a:.1f} | {b:.1f} |")
    ratio = statistics.median(guided) / statistics.median(plain)
    print(f"\nguided / unguided (medians): {ratio:.2f}x ({args.streams} streams, "
          f"{args.new_tokens} tokens each)")  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1:])
