"""``triton_paged``: paged attention in Triton kernels that read the KV cache in place.

The semantics are the reference's (``attention.TorchPagedAttention``): the step's new keys
and values are stored in their slots, then query row ``i`` of a sequence with ``n`` new
tokens and context ``c`` attends to the sequence's keys ``0 .. c - n + i`` (causal,
aligned to the end of the context, which covers prefill, chunked prefill and decode), with
a float32 online softmax. No context is gathered or copied: every kernel walks the
sequence's block table and loads each key/value row from its block
(``kv_cache.py``: token ``p`` is at offset ``p % block_size`` of block
``table[p // block_size]``).

Up to four launches per layer, over grids built from per-step metadata (``prepare``: one
host-to-device copy per step):

- ``_write_kv_kernel``: each program copies the K and V rows (every KV head) of a few new
  tokens to their slots, cast to the cache's dtype.
- ``_prefill_kernel`` (sequences with several new tokens): FlashAttention-2 tiling. A
  program owns ``BLOCK_M`` consecutive query tokens of one sequence for one query head;
  it sweeps the keys in ``BLOCK_N`` tiles, first the tiles every row of its query tile sees
  whole (no mask), then the tiles that cross the causal diagonal (masked).
- ``_decode_kernel`` (one-token sequences): a program owns one sequence and one KV head and
  puts the query heads sharing that KV head (GQA/MQA group, padded to at least 16 rows for
  ``tl.dot``) in the rows of one tile, so each key and value row is loaded once for the
  whole group. Long contexts with few sequences are split (flash-decoding): split ``s`` of
  ``S`` covers one contiguous range of key tiles and stores its unnormalised partial
  result, max and sum; ``_combine_kernel`` merges the splits.

Head dims are padded to a power of two (at least 16) with masked loads and stores, so 64,
80, 96, 128, 256 and the tests' tiny dims all work. Scores, softmax and accumulators are
float32; on CUDA the products take fp16/bf16 operands as they are (tensor cores; the
probabilities are rounded to that dtype for ``p @ v``, as flash attention does) and fp32
operands in full precision (``input_precision="ieee"``, not TF32, as the reference). On
CPU tensors (only under ``TRITON_INTERPRET=1``, the tests' mode) every product is computed
in float32, because the interpreter's ``tl.dot`` on bf16 operands is wrong (Triton 3.9).
Only mainstream ``tl.*`` APIs are used, so older Triton releases (the one bundled with
PyTorch) compile these kernels too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from tgis.shard.native.attention.backends import AttentionBackend, BatchLayout, TorchPagedAttention

LOG2E = 1.4426950408889634


# --------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------


@triton.jit
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slots_ptr,
    tokens,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_cs,
    stride_ch,
    kv_heads,
    head_dim,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    D_PAD: tl.constexpr,
):
    """Program ``i`` stores the K and V rows (every KV head) of tokens ``i * BLOCK_T`` ..
    ``(i + 1) * BLOCK_T`` in their slots, cast to the cache's dtype; a tile is
    [BLOCK_T, HEADS_PAD * D_PAD], column ``c`` being dim ``c % D_PAD`` of head
    ``c // D_PAD``. Negative slots (padding) are skipped."""
    token = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, HEADS_PAD * D_PAD)
    head = cols // D_PAD
    dim = cols % D_PAD
    slot = tl.load(slots_ptr + token, mask=token < tokens, other=-1).to(tl.int64)
    mask = (slot[:, None] >= 0) & (head[None, :] < kv_heads) & (dim[None, :] < head_dim)
    dest = ((slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs)[:, None] + (
        head * stride_ch + dim
    )[None, :]
    src_k = token[:, None] * stride_kt + (head * stride_kh + dim)[None, :]
    src_v = token[:, None] * stride_vt + (head * stride_vh + dim)[None, :]
    k = tl.load(k_ptr + src_k, mask=mask)
    v = tl.load(v_ptr + src_v, mask=mask)
    tl.store(k_cache_ptr + dest, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dest, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _load_kv_tiles(
    k_cache_ptr,
    v_cache_ptr,
    table_ptr,
    positions,
    valid,
    kv_head,
    dims,
    head_dim,
    stride_cb,
    stride_cs,
    stride_ch,
    BLOCK_SIZE: tl.constexpr,
):
    """The K and V tiles, [BLOCK_N, D_PAD] rows each, of one KV head at token ``positions``
    of a sequence, read in place from their block (``table_ptr``: the sequence's block
    table, looked up once for both; K and V caches share strides); rows that are not
    ``valid`` and padded dims are zero."""
    blocks = tl.load(table_ptr + positions // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    rows = blocks * stride_cb + (positions % BLOCK_SIZE) * stride_cs + kv_head * stride_ch
    mask = valid[:, None] & (dims[None, :] < head_dim)
    offsets = rows[:, None] + dims[None, :]
    k = tl.load(k_cache_ptr + offsets, mask=mask, other=0.0)
    v = tl.load(v_cache_ptr + offsets, mask=mask, other=0.0)
    return k, v


@triton.jit
def _softmax_step(
    q,
    k,
    v,
    visible,
    m_i,
    l_i,
    acc,
    scale_log2,
    PRECISION: tl.constexpr,
):
    """One key tile of the online softmax: scores ``q @ k^T`` (base-2 logits), hidden
    where not ``visible``; returns the updated running max, sum and accumulator.

    Hidden scores are -inf and the running max starts at -1e30 (finite), so a row that has
    seen no key yet gets weights exp2(-inf) == 0 and a rescale of exp2(0), never NaN."""
    k = k.to(q.dtype)  # q is float32 already when DOT_FP32
    scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
    scores = tl.where(visible, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(scores - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    pv = tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=PRECISION)
    acc = acc * alpha[:, None] + pv
    return m_new, l_i, acc


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    tile_seqs_ptr,
    tile_offsets_ptr,
    query_starts_ptr,
    query_lens_ptr,
    context_lens_ptr,
    tables_ptr,
    scale_log2,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_table,
    group,
    head_dim,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    D_PAD: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Program (head, tile): query tokens ``offset .. offset + BLOCK_M`` of the tile's
    sequence for query head ``head``, against every key they may see. Heads vary fastest
    in the launch order, so the query heads sharing a KV head read its keys while they are
    in L2.

    Row ``r`` is at absolute position ``first + r`` (``first = context - query_len +
    offset``): keys below ``first + 1`` are visible to every row, so whole tiles up to there
    need no mask; the tiles from there to ``min(first + BLOCK_M, context)`` are masked by
    key position <= row position.
    """
    head = tl.program_id(0)
    tile = tl.program_id(1)
    kv_head = head // group
    seq = tl.load(tile_seqs_ptr + tile)
    offset = tl.load(tile_offsets_ptr + tile)
    q_start = tl.load(query_starts_ptr + seq)
    q_len = tl.load(query_lens_ptr + seq)
    context = tl.load(context_lens_ptr + seq)
    table_ptr = tables_ptr + seq * stride_table

    rows = offset + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, D_PAD)
    row_ok = rows < q_len
    q_mask = row_ok[:, None] & (dims[None, :] < head_dim)
    q_offs = (q_start + rows)[:, None] * stride_qt + head * stride_qh + dims[None, :]
    q = tl.load(q_ptr + q_offs, mask=q_mask, other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)

    first = context - q_len + offset
    positions = first + tl.arange(0, BLOCK_M)  # absolute position of each query row
    keys_end = tl.minimum(first + BLOCK_M, context)
    unmasked_end = ((first + 1) // BLOCK_N) * BLOCK_N

    m_i = tl.full([BLOCK_M], -1e30, tl.float32)  # finite: see _softmax_step
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    cols = tl.arange(0, BLOCK_N)
    for start in range(0, unmasked_end, BLOCK_N):
        keys = start + cols
        valid = keys < unmasked_end
        k, v = _load_kv_tiles(
            k_cache_ptr,
            v_cache_ptr,
            table_ptr,
            keys,
            valid,
            kv_head,
            dims,
            head_dim,
            stride_cb,
            stride_cs,
            stride_ch,
            BLOCK_SIZE,
        )
        m_i, l_i, acc = _softmax_step(q, k, v, valid[None, :], m_i, l_i, acc, scale_log2, PRECISION)
    for start in range(unmasked_end, keys_end, BLOCK_N):
        keys = start + cols
        valid = keys < keys_end
        k, v = _load_kv_tiles(
            k_cache_ptr,
            v_cache_ptr,
            table_ptr,
            keys,
            valid,
            kv_head,
            dims,
            head_dim,
            stride_cb,
            stride_cs,
            stride_ch,
            BLOCK_SIZE,
        )
        visible = (keys[None, :] <= positions[:, None]) & valid[None, :]
        m_i, l_i, acc = _softmax_step(q, k, v, visible, m_i, l_i, acc, scale_log2, PRECISION)

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_offs = (q_start + rows)[:, None] * stride_ot + head * stride_oh + dims[None, :]
    tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=q_mask)


@triton.jit
def _decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    part_acc_ptr,
    part_max_ptr,
    part_sum_ptr,
    decode_seqs_ptr,
    query_starts_ptr,
    context_lens_ptr,
    tables_ptr,
    scale_log2,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_table,
    num_heads,
    group,
    head_dim,
    BLOCK_SIZE: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    D_PAD: tl.constexpr,
    SPLITS: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Program (decode, kv_head, split): the one-token sequence ``decode_seqs[decode]``,
    the ``group`` query heads of ``kv_head`` as the rows of one tile, over the key tiles
    of split ``split`` (all of them when ``SPLITS == 1``, which stores the final output;
    otherwise the split's unnormalised accumulator, max and sum go to the partial buffers,
    laid out [decode, head, split(, dim)], for ``_combine_kernel``)."""
    decode = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = tl.load(decode_seqs_ptr + decode)
    row = tl.load(query_starts_ptr + seq)
    context = tl.load(context_lens_ptr + seq)
    table_ptr = tables_ptr + seq * stride_table

    members = tl.arange(0, GROUP_PAD)
    heads = kv_head * group + members
    dims = tl.arange(0, D_PAD)
    mask = (members[:, None] < group) & (dims[None, :] < head_dim)
    q = tl.load(
        q_ptr + row * stride_qt + heads[:, None] * stride_qh + dims[None, :], mask=mask, other=0.0
    )
    if DOT_FP32:
        q = q.to(tl.float32)

    tiles_per_split = tl.cdiv(tl.cdiv(context, BLOCK_N), SPLITS)
    keys_start = split * tiles_per_split * BLOCK_N
    keys_end = tl.minimum(context, keys_start + tiles_per_split * BLOCK_N)

    m_i = tl.full([GROUP_PAD], -1e30, tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
    cols = tl.arange(0, BLOCK_N)
    for start in range(keys_start, keys_end, BLOCK_N):
        keys = start + cols
        valid = keys < keys_end
        k, v = _load_kv_tiles(
            k_cache_ptr,
            v_cache_ptr,
            table_ptr,
            keys,
            valid,
            kv_head,
            dims,
            head_dim,
            stride_cb,
            stride_cs,
            stride_ch,
            BLOCK_SIZE,
        )
        m_i, l_i, acc = _softmax_step(q, k, v, valid[None, :], m_i, l_i, acc, scale_log2, PRECISION)

    if SPLITS == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        o_offs = row * stride_ot + heads[:, None] * stride_oh + dims[None, :]
        tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        part = (decode * num_heads + heads) * SPLITS + split
        tl.store(part_max_ptr + part, m_i, mask=members < group)
        tl.store(part_sum_ptr + part, l_i, mask=members < group)
        tl.store(part_acc_ptr + part[:, None] * D_PAD + dims[None, :], acc, mask=mask)


@triton.jit
def _combine_kernel(
    out_ptr,
    part_acc_ptr,
    part_max_ptr,
    part_sum_ptr,
    decode_seqs_ptr,
    query_starts_ptr,
    stride_ot,
    stride_oh,
    num_heads,
    head_dim,
    SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    D_PAD: tl.constexpr,
):
    """Program (decode, head): rescale each split's partial result to the global max and
    normalise by the total sum (an empty split has max -1e30 and sum 0: weight 0)."""
    decode = tl.program_id(0)
    head = tl.program_id(1)
    row = tl.load(query_starts_ptr + tl.load(decode_seqs_ptr + decode))
    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, D_PAD)
    ok = splits < SPLITS
    part = (decode * num_heads + head) * SPLITS + splits
    m_s = tl.load(part_max_ptr + part, mask=ok, other=float("-inf"))
    l_s = tl.load(part_sum_ptr + part, mask=ok, other=0.0)
    mask = ok[:, None] & (dims[None, :] < head_dim)
    acc_s = tl.load(part_acc_ptr + part[:, None] * D_PAD + dims[None, :], mask=mask, other=0.0)
    weights = tl.exp2(m_s - tl.max(m_s, 0))
    total = tl.sum(weights * l_s, 0)
    out = tl.sum(acc_s * weights[:, None], 0) / total
    o_offs = row * stride_ot + head * stride_oh + dims
    tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=dims < head_dim)


# --------------------------------------------------------------------------------------
# Backend
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TritonPagedMetadata:
    """One step's tensors (int32 views of one device buffer, except the slots)."""

    slot_mapping: torch.Tensor  # [tokens] int64: where each new K/V row is written
    block_tables: torch.Tensor  # [seqs, max blocks]
    context_lens: torch.Tensor  # [seqs]
    query_starts: torch.Tensor  # [seqs]
    query_lens: torch.Tensor  # [seqs]
    tile_seqs: torch.Tensor  # [prefill tiles] sequence of each prefill query tile
    tile_offsets: torch.Tensor  # [prefill tiles] its first query token within the sequence
    decode_seqs: torch.Tensor  # [decodes] the one-token sequences
    max_decode_context: int  # the longest decode context (for the split choice)


def _pow2(n: int, least: int = 16) -> int:
    return max(least, triton.next_power_of_2(n))


def _contiguous_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` with unit stride along its last dim (the kernels address rows by strides)."""
    return t if t.stride(-1) == 1 else t.contiguous()


class TritonPagedAttention:
    """The paged-attention backend of the Triton kernels above (CUDA; CPU tensors only
    under ``TRITON_INTERPRET=1``).

    ``prefill_tile`` (``BLOCK_M``) and ``kv_tile`` (``BLOCK_N``; default by the width of a
    cache row) are the kernels' tile sizes, ``decode_splits`` forces the number of key splits of the
    decode kernel (default: enough programs to fill the GPU, see ``_decode_splits``).
    """

    name = "triton_paged"

    def __init__(
        self,
        block_size: int,
        *,
        prefill_tile: int = 64,
        kv_tile: int | None = None,
        decode_splits: int | None = None,
    ) -> None:
        assert prefill_tile >= 16 and prefill_tile & (prefill_tile - 1) == 0
        assert kv_tile is None or (kv_tile >= 16 and kv_tile & (kv_tile - 1) == 0)
        self.block_size = block_size
        self.prefill_tile = prefill_tile
        self.kv_tile = kv_tile
        self.decode_splits = decode_splits
        self._num_sms: dict[int, int] = {}

    def probe(self, device: torch.device, dtype: torch.dtype = torch.float16) -> None:
        """One real call of every kernel on ``device`` against the reference (a Triton that
        cannot compile them for this GPU fails here, at start-up, not in the first request's
        step); raises what the call raised, RuntimeError on a wrong result."""
        bs = self.block_size
        # A 3-token prompt and a decode at position 39 (2 query heads, 1 KV head, dim 64).
        blocks = list(range(-(-3 // bs) + -(-40 // bs)))
        tables = [blocks[: -(-3 // bs)], blocks[-(-3 // bs) :]]
        slots = [tables[0][p // bs] * bs + p % bs for p in range(3)]
        slots.append(tables[1][39 // bs] * bs + 39 % bs)
        layout = BatchLayout.from_lists([3, 1], [3, 40], tables, slots)
        gen = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(4, heads, 64, generator=gen) for heads in (2, 1, 1))
        cache = torch.randn(len(blocks), bs, 1, 64, generator=gen)
        q, k, v, cache = (t.to(device=device, dtype=dtype) for t in (q, k, v, cache))
        outs = []
        backends: tuple[AttentionBackend, ...] = (
            TorchPagedAttention(bs),
            self,
            TritonPagedAttention(bs, decode_splits=2),
        )
        for backend in backends:
            metadata = backend.prepare(layout, device)
            outs.append(backend.forward(q, k, v, cache.clone(), cache.clone(), metadata))
        for out in outs[1:]:
            if not torch.allclose(out.float(), outs[0].float(), atol=2e-2, rtol=2e-2):
                raise RuntimeError("triton_paged returned a wrong result in its start-up probe")

    def prepare(
        self, layout: BatchLayout, device: torch.device, slot_mapping: torch.Tensor | None = None
    ) -> TritonPagedMetadata:
        """Cut the sequences with several new tokens into query tiles and list the decodes;
        everything goes to the device in one int32 copy."""
        lens, ctx = layout.query_lens, layout.context_lens
        if slot_mapping is None:
            slot_mapping = torch.from_numpy(layout.slot_mapping).to(device)
        prefill = np.flatnonzero(lens > 1)
        decode = np.flatnonzero(lens == 1)
        tiles = -(-lens[prefill] // self.prefill_tile)
        tile_seqs = np.repeat(prefill, tiles)
        first_tile = np.repeat(np.cumsum(tiles) - tiles, tiles)
        tile_offsets = (np.arange(len(tile_seqs)) - first_tile) * self.prefill_tile
        tables = layout.block_tables
        parts = [tables.ravel(), ctx, layout.query_starts, lens, tile_seqs, tile_offsets, decode]
        packed = torch.from_numpy(np.concatenate(parts).astype(np.int32)).to(device)
        views = packed.split([len(p) for p in parts])
        return TritonPagedMetadata(
            slot_mapping=slot_mapping,
            block_tables=views[0].view(tables.shape),
            context_lens=views[1],
            query_starts=views[2],
            query_lens=views[3],
            tile_seqs=views[4],
            tile_offsets=views[5],
            decode_seqs=views[6],
            max_decode_context=int(ctx[decode].max()) if len(decode) else 0,
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: TritonPagedMetadata,
        scale: float | None = None,
    ) -> torch.Tensor:
        """Store ``k``/``v`` in their slots, then attend each query row to its sequence's
        keys up to its own position (softmax scale ``scale``, default 1/sqrt(dim))."""
        q, k, v = _contiguous_rows(q), _contiguous_rows(k), _contiguous_rows(v)
        self._write_kv(k, v, k_cache, v_cache, metadata.slot_mapping)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        head_dim = q.shape[2]
        scale_log2 = (1.0 / math.sqrt(head_dim) if scale is None else scale) * LOG2E
        if metadata.tile_seqs.numel():
            self._prefill(q, k_cache, v_cache, out, metadata, scale_log2)
        if metadata.decode_seqs.numel():
            self._decode(q, k_cache, v_cache, out, metadata, scale_log2)
        return out

    def _write_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slots: torch.Tensor,
    ) -> None:
        tokens, kv_heads, head_dim = k.shape
        if tokens == 0:
            return
        assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
        heads_pad, d_pad = triton.next_power_of_2(kv_heads), triton.next_power_of_2(head_dim)
        block_t = max(1, 4096 // (heads_pad * d_pad))  # ~4096 elements of K (and V) a program
        _write_kv_kernel[(triton.cdiv(tokens, block_t),)](
            k,
            v,
            k_cache,
            v_cache,
            slots,
            tokens,
            k.stride(0),
            k.stride(1),
            v.stride(0),
            v.stride(1),
            k_cache.stride(0),
            k_cache.stride(1),
            k_cache.stride(2),
            kv_heads,
            head_dim,
            BLOCK_SIZE=self.block_size,
            BLOCK_T=block_t,
            HEADS_PAD=heads_pad,
            D_PAD=d_pad,
        )

    def _operands(self, q: torch.Tensor, k_cache: torch.Tensor) -> tuple[int, int, bool, str]:
        """(padded head dim, bytes of a padded cache row, float32 products?, dot precision)."""
        d_pad = _pow2(q.shape[2])
        dot_fp32 = q.dtype == torch.float32 or q.device.type == "cpu"
        return d_pad, d_pad * k_cache.element_size(), dot_fp32, "ieee" if dot_fp32 else "tf32"

    def _prefill(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        out: torch.Tensor,
        metadata: TritonPagedMetadata,
        scale_log2: float,
    ) -> None:
        heads, head_dim = q.shape[1], q.shape[2]
        d_pad, row_bytes, dot_fp32, precision = self._operands(q, k_cache)
        # Key tiles of 32 rows up to 256-byte rows (bf16 dim 128), 16 beyond, on 4 warps,
        # 8 for the wide rows: no register spills at BLOCK_M = 64 (ptxas, sm_90, bf16).
        kv_tile = self.kv_tile or (32 if row_bytes <= 256 else 16)
        grid = (heads, metadata.tile_seqs.numel())
        _prefill_kernel[grid](
            q,
            k_cache,
            v_cache,
            out,
            metadata.tile_seqs,
            metadata.tile_offsets,
            metadata.query_starts,
            metadata.query_lens,
            metadata.context_lens,
            metadata.block_tables,
            scale_log2,
            q.stride(0),
            q.stride(1),
            out.stride(0),
            out.stride(1),
            k_cache.stride(0),
            k_cache.stride(1),
            k_cache.stride(2),
            metadata.block_tables.stride(0),
            heads // k_cache.shape[2],
            head_dim,
            BLOCK_SIZE=self.block_size,
            BLOCK_M=self.prefill_tile,
            BLOCK_N=kv_tile,
            D_PAD=d_pad,
            DOT_FP32=dot_fp32,
            PRECISION=precision,
            num_warps=4 if row_bytes <= 256 else 8,
        )

    def _decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        out: torch.Tensor,
        metadata: TritonPagedMetadata,
        scale_log2: float,
    ) -> None:
        heads, head_dim = q.shape[1], q.shape[2]
        kv_heads = k_cache.shape[2]
        group = heads // kv_heads
        assert heads % kv_heads == 0, "query heads must be a multiple of KV heads"
        decodes = metadata.decode_seqs.numel()
        d_pad, row_bytes, dot_fp32, precision = self._operands(q, k_cache)
        group_pad = _pow2(group)
        # Key tiles of 64 rows up to 128-byte rows, else 32; 8 warps for big groups or wide
        # rows (no register spills, ptxas, sm_90).
        kv_tile = self.kv_tile or (64 if row_bytes <= 128 else 32)
        warps = 8 if group_pad >= 64 or row_bytes >= 512 else 4
        splits = self._decode_splits(q.device, decodes * kv_heads, metadata.max_decode_context)
        if splits > 1:
            part_acc = torch.empty(decodes, heads, splits, d_pad, device=q.device)
            part_max = torch.empty(decodes, heads, splits, device=q.device)
            part_sum = torch.empty(decodes, heads, splits, device=q.device)
        else:  # unused by the kernel
            part_acc = part_max = part_sum = out
        _decode_kernel[(decodes, kv_heads, splits)](
            q,
            k_cache,
            v_cache,
            out,
            part_acc,
            part_max,
            part_sum,
            metadata.decode_seqs,
            metadata.query_starts,
            metadata.context_lens,
            metadata.block_tables,
            scale_log2,
            q.stride(0),
            q.stride(1),
            out.stride(0),
            out.stride(1),
            k_cache.stride(0),
            k_cache.stride(1),
            k_cache.stride(2),
            metadata.block_tables.stride(0),
            heads,
            group,
            head_dim,
            BLOCK_SIZE=self.block_size,
            GROUP_PAD=group_pad,
            BLOCK_N=kv_tile,
            D_PAD=d_pad,
            SPLITS=splits,
            DOT_FP32=dot_fp32,
            PRECISION=precision,
            num_warps=warps,
        )
        if splits > 1:
            _combine_kernel[(decodes, heads)](
                out,
                part_acc,
                part_max,
                part_sum,
                metadata.decode_seqs,
                metadata.query_starts,
                out.stride(0),
                out.stride(1),
                heads,
                head_dim,
                SPLITS=splits,
                SPLITS_PAD=triton.next_power_of_2(splits),
                D_PAD=d_pad,
            )

    def _decode_splits(self, device: torch.device, programs: int, max_context: int) -> int:
        """Key splits per decode: 1 when (sequence, KV head) programs already fill the GPU
        twice over; else enough to, with at least 256 keys per split and at most 16."""
        if self.decode_splits is not None:
            return self.decode_splits
        if device.type != "cuda":
            return 1
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in self._num_sms:
            self._num_sms[index] = torch.cuda.get_device_properties(index).multi_processor_count
        wanted = -(-2 * self._num_sms[index] // programs)
        return max(1, min(wanted, -(-max_context // 256), 16))
