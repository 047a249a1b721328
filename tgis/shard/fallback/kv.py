"""Batched key/value caches of the transformers fallback, without paging.

A ``KVBatch`` holds the cached keys and values of some sequences as one rectangular tensor
per layer, ``[rows, heads, width, head_dim]``, with a ``[rows, width]`` mask of the columns
that hold real tokens. Rows are *left-padded*: a row's tokens end at the last column, so
the next token of every row goes to the same column and a decode step is one forward of
``[rows, 1]`` new tokens. A step whose rows compute different numbers of tokens leaves
masked *holes* in some rows (see ``causal``); ``select`` squeezes them out again.

Encoder-decoder models add a ``CrossKV``: the cross-attention keys/values of each row's
encoder output, *right-padded* (a row's encoder positions start at column 0) with their
own mask.

``select`` (gather rows, drop holes, re-pad) and ``concat`` (stack batches) are the only
operations that copy; a batch whose rows are unchanged is reused as is, so steady decoding
copies nothing beyond what transformers' ``DynamicCache`` appends.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


@dataclass(frozen=True)
class CrossKV:
    """Cross-attention keys/values per layer ``[rows, heads, enc_width, head_dim]``."""

    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]
    mask: torch.Tensor  # [rows, enc_width], 1 = a real encoder position (a prefix of the row)


@dataclass(frozen=True)
class KVBatch:
    """The self-attention cache of ``rows`` (request ids), one tensor per layer."""

    rows: tuple[int, ...]
    keys: tuple[torch.Tensor, ...]  # per layer [rows, heads, width, head_dim]
    values: tuple[torch.Tensor, ...]
    mask: torch.Tensor  # [rows, width] int64, 1 = a cached token
    packed: bool  # every row is padding then tokens, without holes
    cross: CrossKV | None = None

    @property
    def width(self) -> int:
        """Columns per row (the longest row plus padding)."""
        return int(self.mask.shape[1])

    def cache(self) -> DynamicCache:
        """A transformers cache over this batch's tensors (no copy)."""
        return dynamic_cache(self.keys, self.values)

    def cross_cache(self) -> DynamicCache:
        """A transformers cache over the cross-attention tensors (no copy)."""
        if self.cross is None:
            raise ValueError("this batch has no cross-attention cache")
        return dynamic_cache(self.cross.keys, self.cross.values)


def dynamic_cache(keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> DynamicCache:
    """A ``DynamicCache`` whose layers hold ``keys``/``values`` themselves.

    Building one per forward keeps a failed forward from touching the batch: transformers
    rebinds a layer's tensors to new ones (``torch.cat``) and never writes into ours.
    """
    cache = DynamicCache()
    for k, v in zip(keys, values, strict=True):
        layer = DynamicLayer()
        layer.lazy_initialization(k, v)
        layer.keys, layer.values = k, v
        cache.layers.append(layer)
    return cache


def cache_tensors(cache: DynamicCache) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """The per-layer key and value tensors of a cache transformers has filled."""
    keys, values = [], []
    for layer in cache.layers:
        if not isinstance(layer, DynamicLayer) or layer.keys is None or layer.values is None:
            raise TypeError(f"unsupported cache layer {type(layer).__name__}")
        keys.append(layer.keys)
        values.append(layer.values)
    return tuple(keys), tuple(values)


def select(batch: KVBatch, rows: Sequence[int]) -> KVBatch:
    """The rows ``rows`` of ``batch``, packed and left-padded to the longest of them.

    Ids ``batch`` does not hold get an empty row (all padding). Returns ``batch`` itself
    when it already is exactly that.
    """
    rows = tuple(rows)
    if rows == batch.rows and batch.packed:
        return batch
    where = {rid: i for i, rid in enumerate(batch.rows)}
    if not any(r in where for r in rows):
        return empty_rows(batch, rows)
    device = batch.mask.device
    src_rows = torch.tensor([where.get(r, 0) for r in rows], dtype=torch.long, device=device)
    present = torch.tensor([r in where for r in rows], device=device)
    src_cols, new_mask = _packed_columns(batch.mask[src_rows] * present[:, None])
    keep = new_mask.bool()[:, None, :, None]
    index = (src_rows[:, None].expand_as(src_cols), src_cols)

    def gather(t: torch.Tensor) -> torch.Tensor:
        # t[b, :, c, :] for every (b, c) of the new layout → [B, width, heads, dim] → permute.
        picked = t.transpose(1, 2)[index].transpose(1, 2)
        return picked.masked_fill(~keep, 0)

    return KVBatch(
        rows=rows,
        keys=tuple(gather(k) for k in batch.keys),
        values=tuple(gather(v) for v in batch.values),
        mask=new_mask,
        packed=True,
        cross=_select_cross(batch.cross, src_rows, present) if batch.cross else None,
    )


def _packed_columns(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For a ``[B, W]`` mask of cached tokens: the source column of every column of the
    packed layout (tokens right-aligned in order, holes squeezed out) and its mask."""
    lengths = mask.sum(dim=1)
    width = int(lengths.max().item()) if len(mask) else 0
    dest = width - lengths[:, None] + mask.cumsum(dim=1) - 1
    r_idx, c_idx = mask.nonzero(as_tuple=True)
    d_idx = dest[r_idx, c_idx]
    src_cols = torch.zeros(len(mask), width, dtype=torch.long, device=mask.device)
    src_cols[r_idx, d_idx] = c_idx
    new_mask = torch.zeros(len(mask), width, dtype=torch.long, device=mask.device)
    new_mask[r_idx, d_idx] = 1
    return src_cols, new_mask


def empty_rows(like: KVBatch, rows: Sequence[int]) -> KVBatch:
    """A batch of ``rows`` with nothing cached yet, shaped like ``like`` (width 0)."""

    def empty(t: torch.Tensor) -> torch.Tensor:
        return t.new_zeros(len(rows), t.shape[1], 0, t.shape[3])

    return KVBatch(
        rows=tuple(rows),
        keys=tuple(empty(k) for k in like.keys),
        values=tuple(empty(v) for v in like.values),
        mask=like.mask.new_zeros(len(rows), 0),
        packed=True,
    )


def _select_cross(cross: CrossKV, src_rows: torch.Tensor, present: torch.Tensor) -> CrossKV:
    mask = cross.mask[src_rows] * present[:, None]
    width = int(mask.sum(dim=1).max().item()) if len(src_rows) else 0
    return CrossKV(
        keys=tuple(k[src_rows, :, :width] for k in cross.keys),
        values=tuple(v[src_rows, :, :width] for v in cross.values),
        mask=mask[:, :width],
    )


def concat(batches: Sequence[KVBatch]) -> KVBatch:
    """One batch holding the rows of ``batches`` in order (self caches left-padded to the
    widest, cross caches right-padded)."""
    if len(batches) == 1:
        return batches[0]
    width = max(b.width for b in batches)

    def left_pad(t: torch.Tensor, w: int) -> torch.Tensor:
        return F.pad(t, (0, 0, width - w, 0)) if w < width else t

    layers = range(len(batches[0].keys))
    crosses = [b.cross for b in batches if b.cross is not None]
    return KVBatch(
        rows=tuple(r for b in batches for r in b.rows),
        keys=tuple(torch.cat([left_pad(b.keys[i], b.width) for b in batches]) for i in layers),
        values=tuple(torch.cat([left_pad(b.values[i], b.width) for b in batches]) for i in layers),
        mask=torch.cat([F.pad(b.mask, (width - b.width, 0)) for b in batches]),
        packed=all(b.packed for b in batches),
        cross=_concat_cross(crosses) if len(crosses) == len(batches) else None,
    )


def _concat_cross(crosses: Sequence[CrossKV]) -> CrossKV:
    width = max(int(c.mask.shape[1]) for c in crosses)

    def right_pad(t: torch.Tensor, w: int) -> torch.Tensor:
        return F.pad(t, (0, 0, 0, width - w)) if w < width else t

    layers = range(len(crosses[0].keys))
    widths = [int(c.mask.shape[1]) for c in crosses]
    return CrossKV(
        keys=tuple(
            torch.cat([right_pad(c.keys[i], w) for c, w in zip(crosses, widths, strict=True)])
            for i in layers
        ),
        values=tuple(
            torch.cat([right_pad(c.values[i], w) for c, w in zip(crosses, widths, strict=True)])
            for i in layers
        ),
        mask=torch.cat([F.pad(c.mask, (0, width - c.mask.shape[1])) for c in crosses]),
    )
