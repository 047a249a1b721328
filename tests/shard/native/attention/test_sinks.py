"""Attention sinks (gpt-oss's learned per-head logit in the softmax's denominator) in every
backend that says ``supports_sinks``: the reference against a naive softmax with the sink as
one more column, cpu_paged (its decodes in the C kernel) and triton_paged (in Triton's
interpreter without a GPU) against the reference, with and without a sliding window; and the
backends without sinks refuse them."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.shard.native.attention.test_triton_paged import (
    DEVICE,
    Batch,
    make_batch,
)
from tgis.shard.native.attention.cpu_paged import CpuPagedAttention, load_kernel
from tgis.shard.native.attention.interface import AttentionBackend
from tgis.shard.native.attention.torch_paged import TorchPagedAttention
from tgis.shard.native.attention.triton_paged import TritonPagedAttention
from tgis.shard.native.attention.varlen import SdpaVarlenAttention
from tgis.shard.native.models.layers import check_sinks

HEADS, KV_HEADS, DIM, BLOCK = 4, 2, 8, 4
KERNEL = load_kernel()
# Sink logits around the scores' scale: some heads give the sink most of the mass, some little.
SINKS = torch.tensor([1.5, -1.0, 0.0, 3.0])
# Decodes over one and two 16-key tiles, a chunk after cached context, a fresh prompt of two
# 16-row query tiles (small: Triton's interpreter is slow).
SMALL = [(1, 9), (1, 23), (6, 14), (17, 17)]


def run(
    backend: AttentionBackend, batch: Batch, sinks: torch.Tensor | None, window: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The backend's output and the K cache after the step."""
    caches = batch.k_cache.clone(), batch.v_cache.clone()
    metadata = backend.prepare(batch.layout, batch.q.device)
    extra: dict[str, Any] = {} if sinks is None else {"sinks": sinks.to(batch.q.device)}
    out = backend.forward(batch.q, batch.k, batch.v, *caches, metadata, window=window, **extra)
    return out, caches[0]


def naive(batch: Batch, sinks: torch.Tensor, window: int | None) -> torch.Tensor:
    """Query by query: its keys (the cache written by the step, read through the block
    table), softmax over their scores and the head's sink, the sink's share dropped."""
    k_cache, v_cache = batch.k_cache.clone(), batch.v_cache.clone()
    reference = TorchPagedAttention(BLOCK)
    reference.forward(
        batch.q, batch.k, batch.v, k_cache, v_cache, reference.prepare(batch.layout, DEVICE)
    )
    layout, group = batch.layout, HEADS // KV_HEADS
    out = torch.empty_like(batch.q, dtype=torch.float32)
    for seq, (n, context) in enumerate(zip(layout.query_lens, layout.context_lens, strict=True)):
        table = layout.block_tables[seq]
        slots = [int(table[p // BLOCK]) * BLOCK + p % BLOCK for p in range(int(context))]
        keys = k_cache.view(-1, KV_HEADS, DIM)[slots].float().repeat_interleave(group, 1)
        values = v_cache.view(-1, KV_HEADS, DIM)[slots].float().repeat_interleave(group, 1)
        for i in range(int(n)):
            row, position = int(layout.query_starts[seq]) + i, int(context - n) + i
            lo = 0 if window is None else max(0, position - window + 1)
            scores = torch.einsum("hd,thd->ht", batch.q[row].float(), keys[lo : position + 1])
            scores = torch.cat([scores * DIM**-0.5, sinks[:, None]], dim=1)
            probs = scores.softmax(-1)[:, :-1]
            out[row] = torch.einsum("ht,thd->hd", probs, values[lo : position + 1])
    return out


@pytest.mark.parametrize("window", [None, 5])
def test_reference_sinks_equal_a_naive_softmax(window: int | None) -> None:
    batch = make_batch(SMALL, HEADS, KV_HEADS, DIM, BLOCK, torch.float32, seed=7)
    got, _ = run(TorchPagedAttention(BLOCK), batch, SINKS, window)
    plain, _ = run(TorchPagedAttention(BLOCK), batch, None, window)
    assert not torch.allclose(got, plain, atol=1e-2)  # the sinks take mass
    torch.testing.assert_close(got, naive(batch, SINKS, window), atol=1e-5, rtol=1e-5)


def _backends() -> list[AttentionBackend]:
    backends: list[AttentionBackend] = [
        TritonPagedAttention(BLOCK, prefill_tile=16, kv_tile=16),
        TritonPagedAttention(BLOCK, prefill_tile=16, kv_tile=16, decode_splits=3),
    ]
    if DEVICE.type == "cpu" and KERNEL is not None:
        backends.append(CpuPagedAttention(BLOCK, KERNEL))
    return backends


@pytest.mark.parametrize(("dtype", "window"), [(torch.float32, None), (torch.bfloat16, 5)])
def test_backends_with_sinks_equal_the_reference(dtype: torch.dtype, window: int | None) -> None:
    """triton_paged (one decode split, and three: the sinks in the combine kernel) and
    cpu_paged on prompts, chunks and decodes."""
    batch = make_batch(SMALL, HEADS, KV_HEADS, DIM, BLOCK, dtype, seed=3)
    expected, expected_cache = run(TorchPagedAttention(BLOCK), batch, SINKS, window)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    for backend in _backends():
        got, cache = run(backend, batch, SINKS, window)
        assert got.dtype == expected.dtype, backend.name
        torch.testing.assert_close(got, expected, atol=tol, rtol=tol, msg=backend.name)
        assert torch.equal(cache, expected_cache), backend.name


def test_cpu_kernel_is_built() -> None:
    """The sinks test above covers the C kernel only where the extension exists (make
    install builds it)."""
    assert KERNEL is not None


def test_a_backend_without_sinks_is_refused() -> None:
    backend = SdpaVarlenAttention(BLOCK)
    with pytest.raises(ValueError, match="cannot attend with attention sinks"):
        backend.forward(*(torch.zeros(1) for _ in range(5)), None, sinks=SINKS)
    with pytest.raises(Exception, match="sdpa_varlen attention backend cannot do"):
        check_sinks(backend, "GptOssForCausalLM")
    for ok in (TorchPagedAttention(BLOCK), TritonPagedAttention(BLOCK)):
        check_sinks(ok, "GptOssForCausalLM")
