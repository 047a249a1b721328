"""``torch_paged``: the reference paged attention, in pure torch (CPU or GPU).

It defines the semantics every other backend reproduces (``interface.AttentionBackend``):
the step's new keys and values are stored in their slots, then each query row attends
causally to its sequence's cached keys, read through the block table; with a layer's
sliding ``window``, a query at position ``p`` only to the keys at ``p - window < t <= p``;
soft-capped scores and attention sinks by an explicit float32 softmax
(``explicit_attention``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import torch
import torch.nn.functional as F

from tgis.shard.native.attention.interface import BatchLayout


@dataclass(frozen=True)
class _PrefillSeq:
    start: int  # first token row
    length: int  # new tokens
    context_len: int  # cached tokens after the step
    # None: a fresh prompt (the context is this step's own keys, plain causal); else the
    # blocks to gather the context from and the bottom-right causal mask.
    blocks: torch.Tensor | None
    mask: torch.Tensor | None


@dataclass(frozen=True)
class TorchPagedMetadata:
    """Tensors ``TorchPagedAttention`` needs for one step."""

    slot_mapping: torch.Tensor  # [tokens]
    prefill: tuple[_PrefillSeq, ...]  # sequences with several new tokens, one at a time
    decode_rows: torch.Tensor | slice | None  # rows of the one-token sequences
    decode_tables: torch.Tensor | None  # [decodes, max_blocks] int64: their block tables
    decode_context: torch.Tensor | None  # [decodes] int64: their context lengths
    max_context: int  # the longest of them
    decode_mask: torch.Tensor | None  # [decodes, 1, 1, max_blocks * block_size] key visible
    # The masks of a sliding window, built by the first layer with that window and shared by
    # the others: (window, prefill index or -1 for the decodes) → mask.
    window_masks: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)


class TorchPagedAttention:
    """Reference paged attention in pure torch (CPU or GPU).

    One-token (decode) sequences are attended together in one padded SDPA call over their
    contexts, gathered block by block (``index_select`` of whole blocks); sequences with
    several new tokens (prefill or prompt chunks) one by one, so no memory is spent on
    padding long prompts, and a fresh prompt attends to its own keys without a gather.
    """

    name = "torch_paged"
    supports_softcap = True  # the soft-capped layers attend through explicit_attention
    supports_sinks = True  # so do the layers with attention sinks
    # The decode group's padded key mask is built once per step (backends that attend to
    # decodes otherwise skip it).
    masks_decodes = True

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size

    def prepare(
        self, layout: BatchLayout, device: torch.device, slot_mapping: torch.Tensor | None = None
    ) -> TorchPagedMetadata:
        """Split the batch into decode and prefill groups and build their tensors."""
        bs = self.block_size
        lens, ctx_lens, starts = layout.query_lens, layout.context_lens, layout.query_starts
        if slot_mapping is None:
            slot_mapping = torch.from_numpy(layout.slot_mapping).to(device)
        prefill: list[_PrefillSeq] = []
        for i in np.flatnonzero(lens > 1).tolist():
            n, ctx = int(lens[i]), int(ctx_lens[i])
            blocks = mask = None
            if ctx != n:
                table = layout.block_tables[i, : -(-ctx // bs)]
                blocks = torch.from_numpy(np.ascontiguousarray(table)).to(device)
                key_pos = torch.arange(ctx, device=device)
                query_pos = torch.arange(ctx - n, ctx, device=device)
                mask = key_pos[None, :] <= query_pos[:, None]
            prefill.append(_PrefillSeq(int(starts[i]), n, ctx, blocks, mask))
        decode_rows: torch.Tensor | slice | None = None
        decode_tables = decode_context = decode_mask = None
        max_context = 0
        decode = np.flatnonzero(lens == 1)
        if len(decode):
            count = len(decode)
            rows = starts[decode]
            contiguous = int(rows[0]) == 0 and int(rows[-1]) == count - 1
            decode_rows = slice(0, count) if contiguous else torch.from_numpy(rows).to(device)
            decode_ctx = np.ascontiguousarray(ctx_lens[decode], dtype=np.int64)
            max_context = int(decode_ctx.max())
            max_blocks = -(-max_context // bs)
            decode_tables = torch.from_numpy(
                np.ascontiguousarray(layout.block_tables[decode, :max_blocks], dtype=np.int64)
            ).to(device)
            decode_context = torch.from_numpy(decode_ctx).to(device)
            if self.masks_decodes:
                decode_mask = _key_mask(decode_context, max_blocks * bs)
        return TorchPagedMetadata(
            slot_mapping=slot_mapping,
            prefill=tuple(prefill),
            decode_rows=decode_rows,
            decode_tables=decode_tables,
            decode_context=decode_context,
            max_context=max_context,
            decode_mask=decode_mask,
        )

    def forward(  # noqa: PLR0913 - q/k/v, the caches, the step, the layer's scale, window, softcap
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: TorchPagedMetadata,
        scale: float | None = None,
        window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Store ``k``/``v`` in their slots, then attend causally over each sequence's cache
        (softmax scale ``scale``, default 1/sqrt(dim); ``window``: the keys at ``p - window
        < t <= p`` only, None for all of them; ``softcap``: the scores capped to ``softcap *
        tanh(score / softcap)`` before the softmax; ``sinks``: each query head's sink logit
        in the softmax's denominator)."""
        num_blocks, _, num_kv_heads, head_dim = k_cache.shape
        k = k.to(k_cache.dtype)
        v = v.to(v_cache.dtype)
        k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, metadata.slot_mapping, k)
        v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, metadata.slot_mapping, v)
        k_blocks = k_cache.view(num_blocks, -1)
        v_blocks = v_cache.view(num_blocks, -1)
        decode_rows = metadata.decode_rows
        if decode_rows is not None and not metadata.prefill and isinstance(decode_rows, slice):
            return self._decode(
                q, k_blocks, v_blocks, metadata, scale, k_cache.dtype, window, softcap, sinks
            )
        out = torch.empty_like(q)
        for index, seq in enumerate(metadata.prefill):
            rows = slice(seq.start, seq.start + seq.length)
            if seq.blocks is None:
                keys, values = k[rows], v[rows]
            else:
                shape = (-1, num_kv_heads, head_dim)
                keys = k_blocks.index_select(0, seq.blocks).view(shape)[: seq.context_len]
                values = v_blocks.index_select(0, seq.blocks).view(shape)[: seq.context_len]
            mask = seq.mask
            if window is not None and window < seq.context_len:
                mask = _cached(
                    metadata, window, index, partial(_prefill_mask, seq, window, q.device)
                )
            attn = _attention(
                q[rows].transpose(0, 1).unsqueeze(0),
                keys.transpose(0, 1).unsqueeze(0).to(q.dtype),
                values.transpose(0, 1).unsqueeze(0).to(q.dtype),
                mask,
                scale,
                softcap,
                sinks,
            )
            out[rows] = attn[0].transpose(0, 1)
        if decode_rows is not None:
            out[decode_rows] = self._decode(
                q, k_blocks, v_blocks, metadata, scale, k_cache.dtype, window, softcap, sinks
            )
        return out

    def _decode(  # noqa: PLR0913 - the step's tensors and the layer's options
        self,
        q: torch.Tensor,
        k_blocks: torch.Tensor,
        v_blocks: torch.Tensor,
        metadata: TorchPagedMetadata,
        scale: float | None,
        cache_dtype: torch.dtype,
        window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The one-token sequences, in one SDPA call over their gathered contexts (the
        last ``window`` keys of each, when given)."""
        tables, context = metadata.decode_tables, metadata.decode_context
        assert tables is not None and context is not None and metadata.decode_rows is not None
        queries = q[metadata.decode_rows].unsqueeze(2)  # [decodes, heads, 1, dim]
        count, _, _, head_dim = queries.shape
        shape = (count, -1, k_blocks.shape[1] // (self.block_size * head_dim), head_dim)
        flat = tables.view(-1)
        keys = k_blocks.index_select(0, flat).view(shape).transpose(1, 2)
        values = v_blocks.index_select(0, flat).view(shape).transpose(1, 2)
        width = tables.shape[1] * self.block_size
        mask = metadata.decode_mask
        if window is not None and window < metadata.max_context:
            mask = _cached(metadata, window, -1, partial(_key_mask, context, width, window))
        elif mask is None:
            mask = _key_mask(context, width)
        keys, values = keys.to(q.dtype), values.to(q.dtype)
        return _attention(queries, keys, values, mask, scale, softcap, sinks).squeeze(2)


def _attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float | None,
    softcap: float | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """SDPA of [batch, heads, rows, dim] queries over [batch, kv_heads, keys, dim] keys and
    values (grouped-query), ``mask`` [rows, keys] or broadcastable (None: causal); with a
    ``softcap`` or ``sinks``, the explicit softmax (``explicit_attention``)."""
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True
        )
    return explicit_attention(q, k, v, mask, scale, softcap, sinks)


def explicit_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float | None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """``softmax(cap(q k^T * scale) + mask) v`` (scale default 1/sqrt(dim); ``cap``:
    ``softcap * tanh(score / softcap)`` when ``softcap`` is given; ``mask`` boolean, True
    where a key is seen; None: causal, the rows the last of the keys), in float32, cast back
    to ``q``'s dtype. With ``sinks`` ([heads]) each head's sink logit joins the softmax as
    one more column whose probability is dropped (it weighs no value)."""
    group = q.shape[1] // k.shape[1]
    k32 = k.float().repeat_interleave(group, dim=1)
    v32 = v.float().repeat_interleave(group, dim=1)
    scores = q.float() @ k32.transpose(-1, -2) * (scale or q.shape[-1] ** -0.5)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is None:
        rows, keys = scores.shape[-2:]
        mask = torch.ones(rows, keys, dtype=torch.bool, device=q.device).tril(keys - rows)
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return (torch.softmax(scores, dim=-1) @ v32).to(q.dtype)
    sink = sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return (probs @ v32).to(q.dtype)


def _key_mask(context: torch.Tensor, width: int, window: int | None = None) -> torch.Tensor:
    """[rows, 1, 1, width]: key position < the row's context length (and >= the context
    length less ``window``)."""
    key_pos = torch.arange(width, device=context.device)
    visible = key_pos[None, :] < context[:, None]
    if window is not None:
        visible &= key_pos[None, :] >= context[:, None] - window
    return visible[:, None, None, :]


def _prefill_mask(seq: _PrefillSeq, window: int, device: torch.device) -> torch.Tensor:
    """[new tokens, context]: the causal mask of ``seq``'s rows within ``window``."""
    key_pos = torch.arange(seq.context_len, device=device)
    query_pos = torch.arange(seq.context_len - seq.length, seq.context_len, device=device)
    distance = query_pos[:, None] - key_pos[None, :]
    return (distance >= 0) & (distance < window)


def _cached(
    metadata: TorchPagedMetadata, window: int, index: int, build: Callable[[], torch.Tensor]
) -> torch.Tensor:
    """The step's mask for ``window`` and the prefill ``index`` (-1: the decodes), built
    by the first layer that asks for it."""
    mask = metadata.window_masks.get((window, index))
    if mask is None:
        mask = metadata.window_masks[(window, index)] = build()
    return mask
