"""One quantized layer on the CPU: each kernel's milliseconds per call by rows of the step.

For each weight shape (``--shapes``, out x in) and width (``--bits``) a random layer in
groups of ``--group`` columns is built and multiplied by bfloat16 rows (``--rows``), with:

- ``tgis``: tgis's kernel in its own layout (``native/cpu_quant.py``; products up to
  ``DEQUANTIZE_ROWS`` rows, dequantized for oneDNN from there);
- ``torch``: PyTorch's weight-only kernel (``_weight_int4pack_mm_for_cpu``, or
  ``_weight_int8pack_mm`` for 8 bits per channel);
- ``dense``: the same weight as bfloat16, packed for oneDNN (``cpu_gemm.py``): what the
  layer costs unquantized.

The median of ``--repeats`` calls after two warm-ups; the same matrix stays in the caches
between calls, so these are the kernels' rates, not a model's (``quant_bench.py`` runs
whole models). Example (BENCHMARKS.md)::

    .venv/bin/python benchmarks/quant_kernels.py --shapes 16384x2048,2048x8192 \\
        --rows 1,4,16,64,512
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tgis.shard.checkpoints.quantized.matrix import GroupQuantized  # noqa: E402
from tgis.shard.native.cpu_gemm import linear, pack  # noqa: E402
from tgis.shard.native.parallel.layers import apply  # noqa: E402
from tgis.shard.native.quantized_linear import runtime_weight  # noqa: E402


def timed(call: Callable[[], object], repeats: int) -> float:
    """Median milliseconds of ``call`` over ``repeats`` runs after two warm-ups."""
    for _ in range(2):
        call()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


def layer(out: int, in_: int, bits: int, group: int) -> GroupQuantized:
    gen = torch.Generator().manual_seed(out + in_ + bits)
    groups = in_ // group if group > 0 else 1
    levels = 1 << bits
    return GroupQuantized(
        torch.randint(0, levels, (out, in_), generator=gen).to(torch.uint8),
        torch.rand(out, groups, generator=gen) * 0.01 + 0.001,
        torch.randint(0, levels, (out, groups), generator=gen).float(),
        torch.arange(in_) // (group if group > 0 else in_),
        bits,
        torch.bfloat16,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="16384x2048,2048x8192", help="out x in, ...")
    parser.add_argument("--bits", default="4,8")
    parser.add_argument("--group", type=int, default=128, help="-1: per channel")
    parser.add_argument("--rows", default="1,4,16,64,512")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"threads {args.threads}, group {args.group}; ms per call (median)")
    print("bits  out x in       rows     tgis    torch    dense  tgis/torch")
    for shape in args.shapes.split(","):
        out, in_ = (int(v) for v in shape.split("x"))
        for bits in (int(b) for b in args.bits.split(",")):
            matrix = layer(out, in_, bits, args.group if bits == 4 else -1)
            tgis, _ = runtime_weight(matrix, "tgis")
            torch_weight, _ = runtime_weight(matrix, "torch")
            dense = pack(matrix.dequantize(torch.bfloat16))
            for rows in (int(r) for r in args.rows.split(",")):
                x = torch.randn(rows, in_).to(torch.bfloat16)
                a, b, c = (
                    timed(functools.partial(kernel, x), args.repeats)
                    for kernel in (
                        functools.partial(apply, weight=tgis, bias=None),
                        functools.partial(apply, weight=torch_weight, bias=None),
                        functools.partial(linear, weight=dense),
                    )
                )
                print(
                    f"{bits:4d}  {shape:12s} {rows:5d} {a:8.3f} {b:8.3f} {c:8.3f} {a / b:10.2f}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
