"""``triton_paged``: paged attention in Triton kernels that read the KV cache in place.

The semantics are the reference's (``torch_paged.TorchPagedAttention``): the step's new keys
and values are stored in their slots, then query row ``i`` of a sequence with ``n`` new
tokens and context ``c`` attends to the sequence's keys ``0 .. c - n + i`` (causal,
aligned to the end of the context, which covers prefill, chunked prefill and decode), with
a float32 online softmax; a layer's sliding ``window`` keeps the keys ``c - n + i - window
< t <= c - n + i``, and the tiles before it are never read; attention ``sinks`` (one logit
per query head) join each row's softmax denominator after its key tiles. No context is gathered or
copied: every kernel (``triton_kernels.py``) walks the sequence's block table.

Up to four launches per layer, over grids built from per-step metadata (``prepare``: one
host-to-device copy per step): the K/V write, the prefill kernel over the query tiles of
the sequences with several new tokens, the decode kernel over the one-token sequences and,
when the decode is split over the context (flash-decoding), the combine kernel
(``triton_split.py``).

Head dims are padded to a power of two (at least 16) with masked loads and stores, so 64,
80, 96, 128, 256 and the tests' tiny dims all work. Scores, softmax and accumulators are
float32; on CUDA the products take fp16/bf16 operands as they are (tensor cores; the
probabilities are rounded to that dtype for ``p @ v``, as flash attention does) and fp32
operands in full precision (``input_precision="ieee"``, not TF32, as the reference). On
CPU tensors (only under ``TRITON_INTERPRET=1``, the tests' mode) every product is computed
in float32, because the interpreter's ``tl.dot`` on bf16 operands is wrong (Triton 3.9).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import triton

from tgis.shard.native.attention.interface import AttentionBackend, BatchLayout, refuse_softcap
from tgis.shard.native.attention.torch_paged import TorchPagedAttention
from tgis.shard.native.attention.triton_kernels import (
    decode_kernel,
    prefill_kernel,
    write_kv_kernel,
)
from tgis.shard.native.attention.triton_split import SplitPartials, combine

LOG2E = 1.4426950408889634
FULL_WINDOW = 1 << 30  # the kernels' window for full attention (beyond any context)


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
    supports_sinks = True  # folded into each row's softmax after its key tiles

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

    def forward(  # noqa: PLR0913 - q/k/v, the caches, the step, the layer's scale, window, softcap
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: TritonPagedMetadata,
        scale: float | None = None,
        window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Store ``k``/``v`` in their slots, then attend each query row to its sequence's
        keys up to its own position (softmax scale ``scale``, default 1/sqrt(dim); the last
        ``window`` of them only, when given; ``sinks``: each query head's sink logit in the
        softmax's denominator)."""
        refuse_softcap(self.name, softcap)
        q, k, v = _contiguous_rows(q), _contiguous_rows(k), _contiguous_rows(v)
        self._write_kv(k, v, k_cache, v_cache, metadata.slot_mapping)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        head_dim = q.shape[2]
        scale_log2 = (1.0 / math.sqrt(head_dim) if scale is None else scale) * LOG2E
        span = FULL_WINDOW if window is None else window
        if sinks is not None:
            sinks = sinks.to(torch.float32).contiguous()
        if metadata.tile_seqs.numel():
            self._prefill(q, k_cache, v_cache, out, metadata, scale_log2, span, sinks)
        if metadata.decode_seqs.numel():
            self._decode(q, k_cache, v_cache, out, metadata, scale_log2, span, sinks)
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
        write_kv_kernel[(triton.cdiv(tokens, block_t),)](
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
        window: int,
        sinks: torch.Tensor | None = None,
    ) -> None:
        heads, head_dim = q.shape[1], q.shape[2]
        d_pad, row_bytes, dot_fp32, precision = self._operands(q, k_cache)
        # Key tiles of 32 rows up to 256-byte rows (bf16 dim 128), 16 beyond, on 4 warps,
        # 8 for the wide rows: no register spills at BLOCK_M = 64 (ptxas, sm_90, bf16).
        kv_tile = self.kv_tile or (32 if row_bytes <= 256 else 16)
        grid = (heads, metadata.tile_seqs.numel())
        prefill_kernel[grid](
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
            q if sinks is None else sinks,  # never read without sinks
            scale_log2,
            window,
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
            HAS_SINKS=sinks is not None,
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
        window: int,
        sinks: torch.Tensor | None = None,
    ) -> None:
        heads, head_dim, kv_heads = q.shape[1], q.shape[2], k_cache.shape[2]
        group = heads // kv_heads
        assert heads % kv_heads == 0, "query heads must be a multiple of KV heads"
        decodes = metadata.decode_seqs.numel()
        d_pad, row_bytes, dot_fp32, precision = self._operands(q, k_cache)
        group_pad = _pow2(group)
        kv_tile, warps = self._decode_tiles(group_pad, row_bytes)
        keys = min(metadata.max_decode_context, window)
        splits = self._decode_splits(q.device, decodes * kv_heads, keys)
        parts = SplitPartials.allocate(splits, decodes, d_pad, out)
        decode_kernel[(decodes, kv_heads, splits)](
            q,
            k_cache,
            v_cache,
            out,
            parts.acc,
            parts.max,
            parts.sum,
            metadata.decode_seqs,
            metadata.query_starts,
            metadata.context_lens,
            metadata.block_tables,
            q if sinks is None else sinks,  # never read without sinks
            scale_log2,
            window,
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
            HAS_SINKS=sinks is not None,
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
            seqs, starts = metadata.decode_seqs, metadata.query_starts
            combine(out, parts, seqs, starts, head_dim, d_pad, sinks)

    def _decode_tiles(self, group_pad: int, row_bytes: int) -> tuple[int, int]:
        """The decode kernel's key tile rows and warps: tiles of 64 rows up to 128-byte rows,
        else 32; 8 warps for big groups or wide rows (no register spills, ptxas, sm_90)."""
        kv_tile = self.kv_tile or (64 if row_bytes <= 128 else 32)
        return kv_tile, 8 if group_pad >= 64 or row_bytes >= 512 else 4

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
