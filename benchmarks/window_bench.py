"""Decode attention with and without a sliding window, on the device's default backend.

One layer's decode call (``forward``: the K/V write and the attention) for ``--seqs``
sequences at ``--context`` tokens each, full and within ``--window`` keys, over shuffled
16-token blocks: ``cpu_paged`` on the CPU (``torch_paged`` without the C kernel),
``triton_paged`` on CUDA. A window skips the blocks before it, so the call should cost
about ``window / context`` of the full one. Median of ``--repeats`` calls after two
warm-ups, the two cases in turn.

Example::

    .venv/bin/python benchmarks/window_bench.py --seqs 16 --context 4096 --window 512
    python3 benchmarks/window_bench.py --device cuda --context 32768 --window 4096
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from tgis.shard.native.attention.interface import BatchLayout
from tgis.shard.native.attention.selection import select_attention_backend

BLOCK = 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seqs", type=int, default=16)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    per_seq = -(-args.context // BLOCK)
    free = list(range(args.seqs * per_seq))
    random.Random(0).shuffle(free)
    tables = [[free.pop() for _ in range(per_seq)] for _ in range(args.seqs)]
    last = args.context - 1
    slots = [t[last // BLOCK] * BLOCK + last % BLOCK for t in tables]
    layout = BatchLayout.from_lists([1] * args.seqs, [args.context] * args.seqs, tables, slots)
    shape = (args.seqs * per_seq, BLOCK, args.kv_heads, args.head_dim)
    k_cache = torch.randn(shape, device=device).to(dtype)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(args.seqs, args.heads, args.head_dim, device=device).to(dtype)
    k, v = (torch.randn(args.seqs, args.kv_heads, args.head_dim, device=device) for _ in "kv")
    backend = select_attention_backend(device, BLOCK)
    metadata = backend.prepare(layout, device)

    def call(window: int | None) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        backend.forward(q, k.to(dtype), v.to(dtype), k_cache, v_cache, metadata, window=window)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    times: dict[int | None, list[float]] = {None: [], args.window: []}
    for window in times:  # warm-ups
        for _ in range(2):
            call(window)
    for _ in range(args.repeats):
        for window, found in times.items():
            found.append(call(window))
    print(
        f"{backend.name} on {args.device}, {args.dtype}, {args.seqs} decodes x {args.context} "
        f"tokens, {args.heads}/{args.kv_heads} heads of {args.head_dim}, "
        f"{torch.get_num_threads()} threads"
    )
    full = statistics.median(times[None])
    for window, found in times.items():
        median = statistics.median(found)
        print(f"  window {window}: {median * 1e3:.3f} ms per layer ({median / full:.2f}x full)")


if __name__ == "__main__":
    main()
