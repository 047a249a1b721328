"""The decode graphs' bookkeeping, on any device: buckets, which steps replay, how a step is
staged into the static buffers. Capture and replay themselves need CUDA
(tests/shard/test_gpu.py: graphs == eager)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from tgis.shard.config import EngineSettings
from tgis.shard.native.attention.interface import BatchLayout
from tgis.shard.native.attention.kv_cache import KVCache, KVCacheSpec
from tgis.shard.native.graphs.cuda_graphs import DecodeGraphs, graph_buckets


def test_buckets() -> None:
    assert graph_buckets(1) == (1,)
    assert graph_buckets(12) == (1, 2, 4, 8, 12)
    assert graph_buckets(64) == (1, 2, 4, 8, 16, 32, 48, 64)
    assert graph_buckets(70)[-2:] == (64, 70)
    assert len(graph_buckets(256)) == 4 + 16


def test_mode() -> None:
    for value, mode in (("", "auto"), ("auto", "auto"), ("1", "on"), ("0", "off")):
        assert EngineSettings(cuda_graphs=value).graphs_switch == mode
    with pytest.raises(ValueError, match="TGIS_CUDA_GRAPHS"):
        _ = EngineSettings(cuda_graphs="maybe").graphs_switch


def graphs(max_batch: int = 16, max_context: int = 64, width: int = 1) -> DecodeGraphs:
    spec = KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=8, dtype=torch.float32, block_size=4)
    cache = KVCache(spec, 32, torch.device("cpu"))

    def forward(*args: object) -> torch.Tensor:
        raise AssertionError("not run on CPU")

    return DecodeGraphs(
        forward, cache, torch.device("cpu"), graph_buckets(max_batch), max_context, 100, width
    )


def layout(query_lens: list[int], contexts: list[int], tables: list[list[int]]) -> BatchLayout:
    tokens = sum(query_lens)
    base = BatchLayout.from_lists(query_lens, contexts, tables, list(range(7, 7 + tokens)))
    return replace(
        base,
        input_ids=np.arange(50, 50 + tokens, dtype=np.int64),
        positions=np.concatenate(
            [np.arange(c - q, c) for q, c in zip(query_lens, contexts, strict=True)]
        ).astype(np.int64),
    )


def test_only_decode_steps_that_fit_replay() -> None:
    g = graphs(max_batch=16, max_context=64)  # 16 blocks of 4 at most
    assert g.bucket_for(layout([1] * 3, [5, 9, 2], [[1, 2], [3, 4, 5], [6]])) == 4
    assert g.bucket_for(layout([1] * 16, [1] * 16, [[i] for i in range(16)])) == 16
    assert g.bucket_for(layout([1] * 17, [1] * 17, [[i] for i in range(17)])) is None
    assert g.bucket_for(layout([1, 3], [5, 3], [[1, 2], [3]])) is None  # a prompt chunk
    assert g.bucket_for(layout([1], [65], [list(range(17))])) is None  # beyond max_context


def test_staging_pads_the_bucket() -> None:
    g = graphs()
    g.slots.fill_(123)  # stale rows from an earlier, larger step
    g.stage(layout([1, 1, 1], [5, 9, 2], [[1, 2], [3, 4, 5], [6]]), 4)
    assert g.input_ids[:4].tolist() == [50, 51, 52, 0]
    assert g.positions[:4].tolist() == [4, 8, 1, 0]
    assert g.slots[:4].tolist() == [7, 8, 9, -1]  # the pad row writes no KV
    assert g.context[:4].tolist() == [5, 9, 2, 1]
    assert g.tables[:4, :3].tolist() == [[1, 2, 0], [3, 4, 5], [6, 0, 0], [0, 0, 0]]
    assert g.slots[4:].tolist() == [123] * 12  # rows beyond the bucket are not part of it
    meta = g.metadata(4)
    assert meta.decode_seqs.tolist() == [0, 1, 2, 3] and meta.tile_seqs.numel() == 0
    assert meta.max_decode_context == 64


def test_verify_graphs_take_steps_of_up_to_width_tokens_a_sequence() -> None:
    g = graphs(max_batch=4, max_context=64, width=3)  # 17 blocks of 4: 64 + 2 pad positions
    assert g.bucket_for(layout([3, 1, 2], [9, 5, 7], [[1, 2, 3], [4, 5], [6, 7]])) == 4
    assert g.bucket_for(layout([1, 1], [9, 5], [[1, 2, 3], [4, 5]])) == 2
    assert g.bucket_for(layout([4, 1], [9, 5], [[1, 2, 3], [4, 5]])) is None  # too wide
    assert g.bucket_for(layout([1] * 5, [1] * 5, [[i] for i in range(5)])) is None
    assert g.bucket_for(layout([1], [64], [list(range(16))])) == 1  # padded to 66 of 68
    assert g.bucket_for(layout([1], [67], [list(range(17))])) is None  # padded past 68


def test_verify_staging_pads_each_sequence_to_width_rows() -> None:
    g = graphs(max_batch=4, width=3)
    g.stage(layout([3, 1], [9, 5], [[1, 2, 3], [4, 5]]), 2)  # ids 50-53, slots 7-10
    # Sequence 0 fills its three rows; sequence 1 has one row, then two pad rows.
    assert g.input_ids[:6].tolist() == [50, 51, 52, 53, 0, 0]
    assert g.positions[:6].tolist() == [6, 7, 8, 4, 0, 0]
    assert g.slots[:6].tolist() == [7, 8, 9, 10, -1, -1]
    # Its context grows by its two pad rows: its real row keeps position 4.
    assert g.context[:2].tolist() == [9, 7]
    assert g.gather[:4].tolist() == [0, 1, 2, 3]
    meta = g.metadata(2)
    assert meta.query_starts.tolist() == [0, 3] and meta.query_lens.tolist() == [3, 3]
    assert meta.tile_seqs.tolist() == [0, 1] and meta.tile_offsets.tolist() == [0, 0]
    assert meta.decode_seqs.numel() == 0
    g.stage(layout([1, 2], [5, 9], [[4, 5], [1, 2, 3]]), 4)
    assert g.gather[:3].tolist() == [0, 3, 4]
    assert g.context[:4].tolist() == [7, 10, 3, 3]  # pad sequences: width keys of block 0
    assert g.slots[6:12].tolist() == [-1] * 6
