"""Engine-level micro-benchmark of the shard's attention backends, in one process.

Compares ``TorchPagedAttention`` (``tgis.shard.native.attention.torch_paged``, the reference:
decodes in one padded SDPA call, prefill sequences one SDPA call each) with
``SdpaVarlenAttention`` (``tgis.shard.native.attention.varlen``: every sequence in one padded
SDPA call with a bottom-right causal mask) on the same paged batches: random, non-contiguous block
tables (16-token blocks), random Q/K/V, a KV cache holding every sequence's context.

For each head configuration and batch shape it times, after a warm-up, the median of N
calls (the two backends called in turn, so background noise hits both alike) of

* ``prepare``: the per-step metadata (built once per step, shared by every layer);
* ``forward``: one layer's call (writes the step's K/V into the cache, then attends);

and reports the per-step cost for the configuration's layer count
(``prepare + layers × forward``), the ratio varlen / reference, and the largest absolute
difference between the two outputs (a sanity check, not a test).

Example::

    .venv/bin/python benchmarks/attention.py                      # CPU, float32, defaults
    .venv/bin/python benchmarks/attention.py --configs llama8b --shapes decode-16x512 \\
        --repeats 50 --dtype bfloat16 --json attention.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from tgis.shard.native.attention.interface import AttentionBackend, BatchLayout
from tgis.shard.native.attention.kv_cache import BLOCK_SIZE
from tgis.shard.native.attention.torch_paged import TorchPagedAttention
from tgis.shard.native.attention.varlen import SdpaVarlenAttention


@dataclass(frozen=True)
class HeadConfig:
    """Attention geometry of one model (per tensor-parallel rank)."""

    heads: int
    kv_heads: int
    head_dim: int
    layers: int
    description: str


CONFIGS: dict[str, HeadConfig] = {
    "tiny": HeadConfig(4, 2, 64, 4, "embedded tiny model: 4 heads, 2 KV heads, dim 64, 4 layers"),
    "llama8b": HeadConfig(32, 8, 128, 32, "Llama-3-8B: 32 heads, 8 KV heads, dim 128, 32 layers"),
}

# Each shape: (new tokens, context length after the step) per sequence.
SHAPES: dict[str, list[tuple[int, int]]] = {
    "decode-1x512": [(1, 512)],
    "decode-16x512": [(1, 512)] * 16,
    "decode-16x128": [(1, 128)] * 16,
    "prefill-4x256": [(256, 256)] * 4,
    "prefill-1x1024": [(1024, 1024)],
    # 12 decodes at 512 + two 128-token prompt chunks on top of 256 cached tokens.
    "mixed-12x512+2x128c": [(1, 512)] * 12 + [(128, 384)] * 2,
}
DEFAULT_SHAPES = "decode-1x512,decode-16x512,prefill-4x256,mixed-12x512+2x128c"


@dataclass
class Inputs:
    """One step's tensors and layout."""

    layout: BatchLayout
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor


def make_inputs(
    shape: list[tuple[int, int]],
    cfg: HeadConfig,
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
) -> Inputs:
    """Random Q/K/V and a paged cache with shuffled block tables for ``shape``."""
    rng = random.Random(seed)
    per_seq = [-(-ctx // BLOCK_SIZE) for _, ctx in shape]
    num_blocks = sum(per_seq) + 8
    blocks = list(range(num_blocks))
    rng.shuffle(blocks)
    tables: list[tuple[int, ...]] = []
    slots: list[int] = []
    for (new, ctx), count in zip(shape, per_seq, strict=True):
        table = tuple(blocks.pop() for _ in range(count))
        tables.append(table)
        slots += [
            table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(ctx - new, ctx)
        ]
    layout = BatchLayout.from_lists(
        query_lens=tuple(n for n, _ in shape),
        context_lens=tuple(c for _, c in shape),
        block_tables=tuple(tables),
        slot_mapping=tuple(slots),
    )
    gen = torch.Generator().manual_seed(seed)
    tokens = sum(n for n, _ in shape)

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(size, generator=gen).to(device=device, dtype=dtype)

    cache_shape = (num_blocks, BLOCK_SIZE, cfg.kv_heads, cfg.head_dim)
    return Inputs(
        layout=layout,
        q=randn(tokens, cfg.heads, cfg.head_dim),
        k=randn(tokens, cfg.kv_heads, cfg.head_dim),
        v=randn(tokens, cfg.kv_heads, cfg.head_dim),
        k_cache=randn(*cache_shape),  # the cached context: random keys and values
        v_cache=randn(*cache_shape),
    )


def time_interleaved(
    fns: list[Callable[[], object]], warmup: int, repeats: int, device: torch.device
) -> list[tuple[float, float]]:
    """(median, minimum) ms of each of ``fns``, called in turn, after ``warmup`` rounds.

    Interleaving the candidates call by call spreads background noise (other processes on
    a small machine, frequency changes) evenly over them, which keeps their ratio honest.
    """

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(warmup):
        for fn in fns:
            fn()
    sync()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, samples in zip(fns, times, strict=True):
            started = time.perf_counter()
            fn()
            sync()
            samples.append((time.perf_counter() - started) * 1000)
    return [(statistics.median(t), min(t)) for t in times]


@dataclass
class Row:
    """Timings of one (config, shape, backend)."""

    config: str
    shape: str
    backend: str
    tokens: int
    prepare_ms: float  # medians
    forward_ms: float
    step_ms: float  # prepare + layers × forward
    prepare_min_ms: float
    forward_min_ms: float
    max_abs_diff: float


@torch.inference_mode()
def bench_pair(
    backends: list[AttentionBackend],
    inputs: Inputs,
    device: torch.device,
    warmup: int,
    repeats: int,
) -> list[tuple[tuple[float, float], tuple[float, float], torch.Tensor]]:
    """Per backend: ((median, min) prepare ms, (median, min) forward ms, output)."""
    prepares = time_interleaved(
        [partial(b.prepare, inputs.layout, device) for b in backends], warmup, repeats, device
    )
    metadata = [b.prepare(inputs.layout, device) for b in backends]
    calls: list[Callable[[], torch.Tensor]] = [
        partial(b.forward, inputs.q, inputs.k, inputs.v, inputs.k_cache, inputs.v_cache, m)
        for b, m in zip(backends, metadata, strict=True)
    ]
    forwards = time_interleaved(list(calls), warmup, repeats, device)
    return [(prep, fwd, call()) for prep, fwd, call in zip(prepares, forwards, calls, strict=True)]


def run(args: argparse.Namespace) -> list[Row]:
    """Every (config, shape) with both backends, reference first."""
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    rows: list[Row] = []
    for config_name in args.configs:
        cfg = CONFIGS[config_name]
        for shape_name in args.shapes:
            shape = SHAPES[shape_name]
            inputs = make_inputs(shape, cfg, dtype, device)
            backends: list[AttentionBackend] = [
                TorchPagedAttention(BLOCK_SIZE),
                SdpaVarlenAttention(BLOCK_SIZE),
            ]
            results = bench_pair(backends, inputs, device, args.warmup, args.repeats)
            reference = results[0][2].float()
            for backend, (prepare_ms, forward_ms, out) in zip(backends, results, strict=True):
                rows.append(
                    Row(
                        config=config_name,
                        shape=shape_name,
                        backend=backend.name,
                        tokens=int(inputs.q.shape[0]),
                        prepare_ms=prepare_ms[0],
                        forward_ms=forward_ms[0],
                        step_ms=prepare_ms[0] + cfg.layers * forward_ms[0],
                        prepare_min_ms=prepare_ms[1],
                        forward_min_ms=forward_ms[1],
                        max_abs_diff=float((out.float() - reference).abs().max()),
                    )
                )
            print(f"{config_name} {shape_name}: done", file=sys.stderr, flush=True)
    return rows


def markdown(rows: list[Row]) -> str:
    """One table row per (config, shape): both backends side by side and the ratios."""
    lines = [
        "| config | shape | tokens | paged prepare | paged fwd/layer | varlen prepare | "
        "varlen fwd/layer | fwd ratio varlen/paged | step ratio (prepare + L×fwd) | "
        "max abs diff |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for i in range(0, len(rows), 2):
        ref, var = rows[i], rows[i + 1]
        lines.append(
            f"| {ref.config} | {ref.shape} | {ref.tokens} | {ref.prepare_ms:.3f} | "
            f"{ref.forward_ms:.3f} | {var.prepare_ms:.3f} | {var.forward_ms:.3f} | "
            f"{var.forward_ms / ref.forward_ms:.2f} | {var.step_ms / ref.step_ms:.2f} | "
            f"{var.max_abs_diff:.1e} |"
        )
    lines += [
        "",
        "Times in ms (median). paged = TorchPagedAttention (reference), varlen = "
        "SdpaVarlenAttention. Ratio < 1: varlen is faster.",
    ]
    return "\n".join(lines)


def device_name(device: torch.device) -> str:
    """GPU name, or the CPU model and core count from /proc/cpuinfo."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    model = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads, no GPU"


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Command line."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n", 1)[0])
    parser.add_argument("--configs", default="tiny,llama8b", help=f"of {', '.join(CONFIGS)}")
    parser.add_argument("--shapes", default=DEFAULT_SHAPES, help=f"of {', '.join(SHAPES)}")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--warmup", type=int, default=5, help="untimed calls first (5)")
    parser.add_argument("--repeats", type=int, default=40, help="timed calls, median (40)")
    parser.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args(argv)
    args.configs = [c for c in args.configs.split(",") if c]
    args.shapes = [s for s in args.shapes.split(",") if s]
    for name in args.configs:
        if name not in CONFIGS:
            parser.error(f"unknown config {name!r}; choose from {', '.join(CONFIGS)}")
    for name in args.shapes:
        if name not in SHAPES:
            parser.error(f"unknown shape {name!r}; choose from {', '.join(SHAPES)}")
    if args.repeats < 1 or args.warmup < 0:
        parser.error("--repeats must be >= 1 and --warmup >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the comparison and print the environment and the table."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    rows = run(args)
    env: dict[str, Any] = {
        "device": device_name(device),
        "dtype": args.dtype,
        "torch": torch.__version__,
        "block size": BLOCK_SIZE,
        "timing": f"median of {args.repeats} after {args.warmup} warm-up calls",
        "configs": {name: CONFIGS[name].description for name in args.configs},
    }
    print("\n".join(f"- **{k}**: {v}" for k, v in env.items()))
    print()
    print(markdown(rows))
    if args.json:
        args.json.write_text(
            json.dumps({"environment": env, "rows": [asdict(r) for r in rows]}, indent=2)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
