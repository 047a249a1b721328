"""The reference paged attention against plain causal SDPA."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tgis.shard.native.attention.interface import BatchLayout
from tgis.shard.native.attention.torch_paged import TorchPagedAttention

BLOCK = 16
HEADS, KV_HEADS, DIM = 4, 2, 8
NUM_BLOCKS = 32


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of a whole sequence: [len, heads, dim] (GQA by repeating K/V)."""
    rep = HEADS // KV_HEADS
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.repeat_interleave(rep, dim=1).transpose(0, 1),
        v.repeat_interleave(rep, dim=1).transpose(0, 1),
        is_causal=True,
    )
    return out.transpose(0, 1)


def run_step(
    backend: TorchPagedAttention,
    caches: tuple[torch.Tensor, torch.Tensor],
    seqs: list[dict[str, Any]],
    ranges: list[tuple[int, int]],
) -> list[torch.Tensor]:
    """Attend positions ``ranges[i]`` of each sequence in one flattened call."""
    qs, ks, vs, slots = [], [], [], []
    for seq, (start, end) in zip(seqs, ranges, strict=True):
        qs.append(seq["q"][start:end])
        ks.append(seq["k"][start:end])
        vs.append(seq["v"][start:end])
        table = seq["table"]
        slots += [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(start, end)]
    layout = BatchLayout.from_lists(
        query_lens=tuple(e - s for s, e in ranges),
        context_lens=tuple(e for _, e in ranges),
        block_tables=tuple(tuple(s["table"]) for s in seqs),
        slot_mapping=tuple(slots),
    )
    metadata = backend.prepare(layout, torch.device("cpu"))
    out = backend.forward(torch.cat(qs), torch.cat(ks), torch.cat(vs), *caches, metadata)
    return list(out.split(list(layout.query_lens)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_equals_causal_sdpa(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    rng = random.Random(0)
    blocks = list(range(NUM_BLOCKS))
    rng.shuffle(blocks)  # non-contiguous, out-of-order block tables
    # (length, tokens in the first step): prefill+decode, chunk+chunk, long prefill+chunk,
    # one-token prompt then decode.
    plans = [(23, 22), (40, 17), (50, 45), (2, 1)]
    seqs: list[dict[str, Any]] = []
    for length, _ in plans:
        shape = (length, HEADS, DIM), (length, KV_HEADS, DIM), (length, KV_HEADS, DIM)
        q, k, v = (torch.randn(s, generator=gen).to(dtype) for s in shape)
        table = [blocks.pop() for _ in range(-(-length // BLOCK))]
        seqs.append({"q": q, "k": k, "v": v, "table": table})
    cache_shape = (NUM_BLOCKS, BLOCK, KV_HEADS, DIM)
    # Garbage in the cache: stale values must never be read.
    caches = (torch.randn(cache_shape).to(dtype), torch.randn(cache_shape).to(dtype))
    backend = TorchPagedAttention(BLOCK)

    first = run_step(backend, caches, seqs, [(0, first) for _, first in plans])
    second = run_step(backend, caches, seqs, [(first, length) for length, first in plans])

    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for seq, (length, split), a, b in zip(seqs, plans, first, second, strict=True):
        expected = reference(seq["q"].float(), seq["k"].float(), seq["v"].float())
        torch.testing.assert_close(a.float(), expected[:split], atol=tol, rtol=tol)
        torch.testing.assert_close(b.float(), expected[split:length], atol=tol, rtol=tol)
