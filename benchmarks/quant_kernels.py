"""One quantized layer: each kernel's milliseconds per call by rows of the step.

For each weight shape (``--shapes``, out x in) and width (``--bits``) a random layer in
groups of ``--group`` columns is built and multiplied by bfloat16 rows (``--rows``). On the
CPU (``--device cpu``, the default), with:

- ``tgis``: tgis's kernel in its own layout (``native/linear/cpu_quant.py``; products up to
  ``DEQUANTIZE_ROWS`` rows, dequantized for oneDNN from there);
- ``torch``: PyTorch's weight-only kernel (``_weight_int4pack_mm_for_cpu``, or
  ``_weight_int8pack_mm`` for 8 bits per channel);
- ``dense``: the same weight as bfloat16, packed for oneDNN (``cpu_gemm.py``): what the
  layer costs unquantized;
- ``fp8``: the same weight in FP8 per output channel through ``torch._scaled_mm``
  (``fp8_linear.py``), which on the CPU is a reference loop: why FP8 layers are
  dequantized there.

On CUDA (``--device cuda``, what ``gpu_check.sh`` runs), with ``triton``: the Triton
products (``quant_triton.kernel_product``) at every row count, ``dequant``: the layer
dequantized and multiplied by cuBLAS (``dequantized_product``) at every row count, and
``dense`` (``torch.matmul`` with the bfloat16 weight), and ``fp8`` (the same weight in FP8
per output channel, by ``torch._scaled_mm`` with per-token activation scales: FP8 checkpoints'
kernel on GPUs of compute capability 8.9+); the layer switches from the first to the second
at ``quant_triton.DEQUANTIZE_ROWS`` rows.

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

from tgis.shard.checkpoints.quantized.fp8_matrix import quantize_fp8  # noqa: E402
from tgis.shard.checkpoints.quantized.matrix import GroupQuantized  # noqa: E402
from tgis.shard.native.linear.cpu_gemm import linear, pack  # noqa: E402
from tgis.shard.native.linear.fp8_linear import scaled_weight  # noqa: E402
from tgis.shard.native.linear.quantized_linear import runtime_weight  # noqa: E402
from tgis.shard.native.linear.sharded import apply  # noqa: E402


def timed(call: Callable[[], object], repeats: int, device: torch.device) -> float:
    """Median milliseconds of ``call`` over ``repeats`` runs after two warm-ups."""
    for _ in range(2):
        call()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        call()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
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


def kernels(matrix: GroupQuantized, device: torch.device) -> dict[str, Callable[..., object]]:
    """Each kernel of ``device`` as a function of the rows x."""
    if device.type == "cuda":
        from tgis.shard.native.linear import quant_triton

        on_device = GroupQuantized(
            matrix.q.to(device),
            matrix.scales.to(device),
            matrix.zeros.to(device),
            matrix.g_idx.to(device),
            matrix.bits,
            torch.bfloat16,
        )
        w = quant_triton.triton_quant_weight(on_device)
        assert not isinstance(w, str), w
        args = (w.qweight, w.scales, w.szeros, w.out_features, w.group_size, w.bits)
        dense = matrix.dequantize(torch.bfloat16).t().contiguous().to(device)
        fp8 = scaled_weight(quantize_fp8(dense.t(), torch.bfloat16))
        assert not isinstance(fp8, str), fp8
        return {
            "triton": functools.partial(_call, quant_triton.kernel_product, args=args),
            "dequant": functools.partial(_call, quant_triton.dequantized_product, args=args),
            "dense": functools.partial(torch.matmul, other=dense),
            "fp8": functools.partial(apply, weight=fp8, bias=None),
        }
    tgis, _ = runtime_weight(matrix, "tgis")
    torch_weight, _ = runtime_weight(matrix, "torch")
    packed = pack(matrix.dequantize(torch.bfloat16))
    fp8 = scaled_weight(quantize_fp8(matrix.dequantize(torch.float32), torch.bfloat16))
    assert not isinstance(fp8, str), fp8
    return {
        "tgis": functools.partial(apply, weight=tgis, bias=None),
        "torch": functools.partial(apply, weight=torch_weight, bias=None),
        "dense": functools.partial(linear, weight=packed),
        "fp8": functools.partial(apply, weight=fp8, bias=None),
    }


def _call(x: torch.Tensor, function: Callable[..., object], args: tuple[object, ...]) -> object:
    return function(x, *args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--shapes", default="16384x2048,2048x8192", help="out x in, ...")
    parser.add_argument("--bits", default="4,8")
    parser.add_argument("--group", type=int, default=128, help="-1: per channel")
    parser.add_argument("--rows", default="1,4,16,64,512")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    print(f"{device}, threads {args.threads}, group {args.group}; ms per call (median)")
    header = None
    for shape in args.shapes.split(","):
        out, in_ = (int(v) for v in shape.split("x"))
        for bits in (int(b) for b in args.bits.split(",")):
            matrix = layer(out, in_, bits, args.group if bits == 4 else -1)
            calls = kernels(matrix, device)
            first, second = list(calls)[:2]
            if header is None:
                header = " ".join(f"{name:>8s}" for name in calls)
                print(f"bits  out x in       rows {header}  {first}/{second}")
            for rows in (int(r) for r in args.rows.split(",")):
                x = torch.randn(rows, in_).to(torch.bfloat16).to(device)
                ms = [
                    timed(functools.partial(call, x), args.repeats, device)
                    for call in calls.values()
                ]
                figures = " ".join(f"{v:8.3f}" for v in ms)
                print(
                    f"{bits:4d}  {shape:12s} {rows:5d} {figures} {ms[0] / ms[1]:10.2f}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
