"""The Triton kernels of ``triton_paged`` (host side: ``triton_paged.TritonPagedAttention``).

Every kernel walks a sequence's block table and loads each key/value row from its block
(``kv_cache.py``: token ``p`` is at offset ``p % block_size`` of block
``table[p // block_size]``); no context is gathered or copied.

- ``write_kv_kernel``: each program copies the K and V rows (every KV head) of a few new
  tokens to their slots, cast to the cache's dtype.
- ``prefill_kernel`` (sequences with several new tokens): FlashAttention-2 tiling. A
  program owns ``BLOCK_M`` consecutive query tokens of one sequence for one query head;
  it sweeps the keys in ``BLOCK_N`` tiles, first the tiles every row of its query tile sees
  whole (no mask), then the tiles that cross the causal diagonal (masked). With a sliding
  window the tiles before the window are skipped and those crossing its lower edge masked.
- ``decode_kernel`` (one-token sequences): a program owns one sequence and one KV head and
  puts the query heads sharing that KV head (GQA/MQA group, padded to at least 16 rows for
  ``tl.dot``) in the rows of one tile, so each key and value row is loaded once for the
  whole group. Long contexts with few sequences are split (flash-decoding): split ``s`` of
  ``S`` covers one contiguous range of key tiles and stores its unnormalised partial
  result, max and sum; ``triton_split.combine_kernel`` merges the splits. With a sliding
  window only the tiles of the last ``window`` keys are read (and split).

``window`` (a layer's sliding window, ``2**30`` for full attention): the query at position
``p`` sees the keys ``p - window < t <= p``. ``HAS_SINKS`` (gpt-oss's attention sinks): each
query head's sink logit (``sinks_ptr``, natural-log units) joins the softmax's maximum and
denominator once, after the key tiles (``_fold_sink``; for split decodes in
``combine_kernel``).

Head dims are padded to a power of two (at least 16) with masked loads and stores. Scores,
softmax and accumulators are float32; ``DOT_FP32`` makes every product float32 and
``PRECISION`` is ``tl.dot``'s input precision (``triton_paged`` explains the choice). Only
mainstream ``tl.*`` APIs are used, so older Triton releases (the one bundled with PyTorch)
compile these kernels too.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def write_kv_kernel(  # noqa: PLR0913 - a Triton function takes every pointer, stride and tile size
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
def _load_kv_tiles(  # noqa: PLR0913 - a Triton function takes every pointer, stride and tile size
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
def _softmax_step(  # noqa: PLR0913 - a Triton function takes every pointer, stride and tile size
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
def _fold_sink(m_i, l_i, acc, sink):
    """The running max, sum and accumulator with the sink logit ``sink`` (natural-log units,
    one per row or one for all) added to the softmax: it raises the max where it is larger
    and adds its exp to the sum; it weighs no value."""
    sink2 = sink * 1.4426950408889634  # base 2, as the scores
    m_new = tl.maximum(m_i, sink2)
    alpha = tl.exp2(m_i - m_new)
    return l_i * alpha + tl.exp2(sink2 - m_new), acc * alpha[:, None]


@triton.jit
def _in_window(keys, positions, window):
    """[rows, keys]: key position in ``(row position - window, row position]``."""
    return (keys[None, :] <= positions[:, None]) & (keys[None, :] > positions[:, None] - window)


@triton.jit
def prefill_kernel(  # noqa: PLR0913 - a Triton function takes every pointer, stride and tile size
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
    sinks_ptr,
    scale_log2,
    window,
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
    HAS_SINKS: tl.constexpr,
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
    key position <= row position. With a window, keys from ``first + BLOCK_M - window`` on
    are visible to every row from below, the tiles from ``first + 1 - window`` to there are
    masked by key position > row position - window, and those before are never read.
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
    masked_start = (tl.maximum(first + 1 - window, 0) // BLOCK_N) * BLOCK_N
    unmasked_start = tl.cdiv(tl.maximum(first + BLOCK_M - window, 0), BLOCK_N) * BLOCK_N

    m_i = tl.full([BLOCK_M], -1e30, tl.float32)  # finite: see _softmax_step
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    cols = tl.arange(0, BLOCK_N)
    for start in range(unmasked_start, unmasked_end, BLOCK_N):
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
    # The masked tiles: those crossing the window's lower edge, then the causal diagonal.
    lower_tiles = tl.cdiv(tl.minimum(unmasked_start, keys_end) - masked_start, BLOCK_N)
    upper_start = tl.maximum(unmasked_end, unmasked_start)
    tiles = lower_tiles + tl.cdiv(tl.maximum(keys_end - upper_start, 0), BLOCK_N)
    for i in range(0, tiles):
        base = tl.where(i < lower_tiles, masked_start, upper_start - lower_tiles * BLOCK_N)
        keys = base + i * BLOCK_N + cols
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
        visible = _in_window(keys, positions, window) & valid[None, :]
        m_i, l_i, acc = _softmax_step(q, k, v, visible, m_i, l_i, acc, scale_log2, PRECISION)

    if HAS_SINKS:
        l_i, acc = _fold_sink(m_i, l_i, acc, tl.load(sinks_ptr + head))
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_offs = (q_start + rows)[:, None] * stride_ot + head * stride_oh + dims[None, :]
    tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=q_mask)


@triton.jit
def decode_kernel(  # noqa: PLR0913 - a Triton function takes every pointer, stride and tile size
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
    sinks_ptr,
    scale_log2,
    window,
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
    HAS_SINKS: tl.constexpr,
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
    laid out [decode, head, split(, dim)], for ``combine_kernel``). The key tiles are those
    of the sequence's last ``window`` keys."""
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

    keys_lo = tl.maximum(context - window, 0)
    base = (keys_lo // BLOCK_N) * BLOCK_N
    tiles_per_split = tl.cdiv(tl.cdiv(context - base, BLOCK_N), SPLITS)
    keys_start = base + split * tiles_per_split * BLOCK_N
    keys_end = tl.minimum(context, keys_start + tiles_per_split * BLOCK_N)

    m_i = tl.full([GROUP_PAD], -1e30, tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
    cols = tl.arange(0, BLOCK_N)
    for start in range(keys_start, keys_end, BLOCK_N):
        keys = start + cols
        valid = (keys >= keys_lo) & (keys < keys_end)
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
        if HAS_SINKS:
            sink = tl.load(sinks_ptr + heads, mask=members < group, other=0.0)
            l_i, acc = _fold_sink(m_i, l_i, acc, sink)
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        o_offs = row * stride_ot + heads[:, None] * stride_oh + dims[None, :]
        tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        part = (decode * num_heads + heads) * SPLITS + split
        tl.store(part_max_ptr + part, m_i, mask=members < group)
        tl.store(part_sum_ptr + part, l_i, mask=members < group)
        tl.store(part_acc_ptr + part[:, None] * D_PAD + dims[None, :], acc, mask=mask)
