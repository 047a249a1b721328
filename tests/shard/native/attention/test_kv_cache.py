"""The CPU KV cache's memory: zeroed, committed at start only when asked (the prefix cache
fills all of it), else only as it is written."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from tgis.shard.native.attention.kv_cache import KVCache, KVCacheSpec

CPU = torch.device("cpu")
SPEC = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16)
BLOCKS = 2048  # 2 layers x K and V x 2048 blocks x 4 KiB = 32 MiB

pytestmark = pytest.mark.skipif(
    not Path("/proc/self/status").exists(), reason="reads VmRSS from /proc"
)


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_a_committed_cache_is_resident_at_once_and_zero() -> None:
    size_mib = BLOCKS * SPEC.bytes_per_block / 2**20
    assert size_mib == 32
    gc.collect()
    before = rss_mib()
    cache = KVCache(SPEC, BLOCKS, CPU, commit=True)
    assert rss_mib() - before > 0.9 * size_mib
    k, v = cache.layer(1)
    assert k.shape == (BLOCKS, SPEC.block_size, 2, 64) and k.dtype == torch.bfloat16
    assert not k.any() and not v.any()


def test_an_uncommitted_cache_costs_memory_only_where_written() -> None:
    gc.collect()
    before = rss_mib()
    cache = KVCache(SPEC, BLOCKS, CPU)
    assert rss_mib() - before < 4
    k, _ = cache.layer(0)
    assert not k[:16].any() and not k[-16:].any()  # reading zero pages commits nothing
    k[: BLOCKS // 2].fill_(1.0)  # half of one of the four tensors: 4 MiB
    assert 3.5 < rss_mib() - before < 8
