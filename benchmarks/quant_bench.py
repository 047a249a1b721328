"""Quantized against dense weights, in process: decode speed and resident weight bytes.

For each variant (``--variants``: ``dense``, ``int8`` = ``--quantize int8`` at load,
``fp8`` = ``--quantize fp8`` at load (FP8 products on a GPU that has them, dequantized
elsewhere), ``gptq`` = random 4-bit GPTQ layers in groups of 128, ``awq`` likewise; ``name:kernel``
loads it with ``TGIS_QUANT_KERNEL=kernel``, e.g. ``gptq:torch``) the shard's
``ModelRunner`` is loaded on the model directory (``--load-format dummy`` by default:
random weights of a real shape, e.g. ``benchmarks/models/llama-3.2-1b``), its weights are
counted (every tensor the model holds, once: packed, quantized and dense), and
``step_bench.py``'s cases run: prefill ``B`` prompts of ``C`` tokens, then time decode
steps of all ``B``. Variants alternate ``--rounds`` times in one process so that the host's
drift touches all of them alike; the report gives each variant's median and its ratio to
``dense``. Example (the figures in BENCHMARKS.md)::

    .venv/bin/python benchmarks/quant_bench.py --model benchmarks/models/llama-3.2-1b \\
        --dtype bfloat16 --batches 1,16 --contexts 128 --steps 10 --rounds 3
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from step_bench import parse_ints, run_case  # noqa: E402

from tgis.shard.cli import engine_from_environment  # noqa: E402
from tgis.shard.config import ShardConfig  # noqa: E402
from tgis.shard.loader import load_runner  # noqa: E402
from tgis.shard.native.models.decoder import DecoderLM  # noqa: E402
from tgis.shard.native.runtime.model_runner import ModelRunner  # noqa: E402

VARIANTS = {"dense": None, "int8": "int8", "fp8": "fp8", "gptq": "gptq", "awq": "awq"}


def tensors_of(obj: object, seen: set[int]) -> Iterator[torch.Tensor]:
    """Every tensor reachable from ``obj``'s attributes (lists and tuples too), once."""
    if isinstance(obj, torch.Tensor):
        if id(obj) not in seen:
            seen.add(id(obj))
            yield obj
        return
    if isinstance(obj, list | tuple):
        for item in obj:
            yield from tensors_of(item, seen)
        return
    if isinstance(obj, dict):
        for item in obj.values():
            yield from tensors_of(item, seen)
        return
    if hasattr(obj, "__dict__") and not isinstance(obj, type):
        if id(obj) in seen:
            return
        seen.add(id(obj))
        for value in vars(obj).values():
            yield from tensors_of(value, seen)


def weight_bytes(runner: ModelRunner) -> int:
    """Bytes of every tensor the model holds (weights, norms, rotary tables; not the KV
    cache, which the runner holds)."""
    model = runner.model
    assert isinstance(model, DecoderLM)
    return sum(t.numel() * t.element_size() for t in tensors_of(model, set()))


def linear_bytes(runner: ModelRunner) -> int:
    """Bytes of the decoder layers' linear weights alone (quantized or dense)."""
    model = runner.model
    assert isinstance(model, DecoderLM)
    seen: set[int] = set()
    return sum(
        t.numel() * t.element_size()
        for linear in model.linear_layers()
        for t in tensors_of(linear.weight, seen)
    )


def load(args: argparse.Namespace, variant: str) -> ModelRunner:
    """``variant``: a name of VARIANTS, optionally ``:kernel`` (TGIS_QUANT_KERNEL's value
    while loading, e.g. ``gptq:torch``)."""
    name, _, kernel = variant.partition(":")
    engine = replace(engine_from_environment(), quant_kernel=kernel or "auto")
    largest = max(args.batches) * (max(args.contexts) + args.warmup + args.steps + 2)
    config = ShardConfig(
        model_name=str(args.model),
        load_format=args.load_format,
        dtype=args.dtype,
        quantize=VARIANTS[name],
        max_sequence_length=max(args.contexts) + args.warmup + args.steps + 16,
        kv_cache_blocks=-(-largest // 16) + max(args.batches),
        engine=engine,
    )
    return load_runner(config)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="directory with config.json")
    parser.add_argument("--load-format", default="dummy", choices=("dummy", "auto"))
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--variants", default="dense,int8,gptq")
    parser.add_argument("--batches", type=parse_ints, default=[1, 16])
    parser.add_argument("--contexts", type=parse_ints, default=[128])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--prefill-chunk", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3, help="alternations of the variants")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    results: dict[str, dict[str, Any]] = {v: {"cases": {}} for v in variants}
    for round_index in range(args.rounds):
        for variant in variants:
            runner = load(args, variant)
            results[variant]["weight_bytes"] = weight_bytes(runner)
            results[variant]["linear_bytes"] = linear_bytes(runner)
            results[variant]["kernels"] = dict(runner.model.linear_kernels())  # type: ignore[attr-defined]
            for batch in args.batches:
                for context in args.contexts:
                    result = run_case(runner, batch, context, args, 0, 0, None)
                    key = f"b{batch}-c{context}"
                    results[variant]["cases"].setdefault(key, []).append(result.ms_per_step_p50)
                    print(
                        f"round {round_index} {variant:6s} {key}: "
                        f"{result.ms_per_step_p50:8.2f} ms/step, "
                        f"{result.tokens_per_s:7.1f} tok/s, prefill "
                        f"{result.prefill_tokens_per_s:7.1f} tok/s",
                        flush=True,
                    )
            del runner
            gc.collect()
    report(results, variants)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


def report(results: dict[str, dict[str, Any]], variants: list[str]) -> None:
    dense = results.get("dense")
    print(
        "\nvariant  weights (MiB)  ratio  linears (MiB)  ratio  case  ms/step p50  tok/s  "
        "speed vs dense"
    )
    for variant in variants:
        data = results[variant]
        mib = data["weight_bytes"] / 2**20
        ratio = data["weight_bytes"] / dense["weight_bytes"] if dense else float("nan")
        linear_mib = data["linear_bytes"] / 2**20
        linear_ratio = data["linear_bytes"] / dense["linear_bytes"] if dense else float("nan")
        for key, times in data["cases"].items():
            ms = statistics.median(times)
            batch = int(key.split("-")[0][1:])
            speed = statistics.median(dense["cases"][key]) / ms if dense else float("nan")
            print(
                f"{variant:8s} {mib:13.1f} {ratio:6.2f} {linear_mib:14.1f} {linear_ratio:6.2f}  "
                f"{key:8s} {ms:9.2f} "
                f"{batch / ms * 1e3:7.1f} {speed:10.2f}x"
            )
        print(f"{'':8s} kernels: {data['kernels']}")


if __name__ == "__main__":
    main()
