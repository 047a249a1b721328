"""Varlen attention backends: every sequence of the step in one kernel call.

Both backends write the step's new K/V into the paged cache exactly as the reference
(`torch_paged.TorchPagedAttention`) does, then gather each sequence's whole context out of
the cache into one packed (or padded) batch, so any block size works:

- `FlashVarlenAttention` calls flash-attn's `flash_attn_varlen_func` on the packed batch
  (CUDA only, when the `flash-attn` package is installed and a probe call succeeded at
  start-up); its metadata is the packed indices alone, built with numpy and copied once;
- `SdpaVarlenAttention` pads the batch and makes a single PyTorch SDPA call with a
  bottom-right causal mask (any device; the fallback on GPUs without flash-attn).

Causality is aligned to the end of each sequence's context: query row `i` of a sequence
with `n` new tokens and context `c` sees keys `0 .. c - n + i`, which covers prefill,
chunked prefill and decode alike; a layer's sliding `window` keeps the last `window` of
them (flash-attn's `window_size`, a mask on top of the causal one for SDPA).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from tgis.shard.native.attention.interface import BatchLayout, refuse_sinks, refuse_softcap


@dataclass(frozen=True)
class PackedMetadata:
    """What flash-attn's varlen call needs, shared by every layer of one step."""

    slot_mapping: torch.Tensor  # [tokens] where each new K/V is written
    context_slots: torch.Tensor  # [sum(context_lens)] every sequence's cache slots, packed
    cu_seqlens_q: torch.Tensor  # [seqs + 1] int32 offsets of the queries
    cu_seqlens_k: torch.Tensor  # [seqs + 1] int32 offsets of the packed keys
    max_seqlen_q: int
    max_seqlen_k: int


@dataclass(frozen=True)
class PaddedMetadata:
    """SDPA's padded layout on top of the packed one (it needs both)."""

    packed: PackedMetadata
    query_index: torch.Tensor  # [seqs, max_q] row of q (or of a zero pad row) per position
    padded_slots: torch.Tensor  # [seqs, max_k] cache slot of each padded key position
    mask: torch.Tensor  # [seqs, 1, max_q, max_k] True where attention is allowed
    query_rows: torch.Tensor  # [tokens] flat index into [seqs * max_q] of each real query
    query_positions: torch.Tensor  # [seqs, 1, max_q, 1] absolute position (pad rows: -1)
    window_masks: dict[int, torch.Tensor] = field(default_factory=dict)  # window → mask

    def mask_for(self, window: int | None) -> torch.Tensor:
        """The causal mask, with keys before a query's position less ``window`` hidden (the
        first layer with that window builds it; pad rows keep their key)."""
        if window is None:
            return self.mask
        mask = self.window_masks.get(window)
        if mask is None:
            key_pos = torch.arange(self.mask.shape[-1], device=self.mask.device)
            mask = self.mask & (key_pos > self.query_positions - window)
            self.window_masks[window] = mask
        return mask


def _write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """Store this step's K/V; return the caches flattened to [slots, kv_heads, dim]."""
    flat_k = k_cache.view(-1, k_cache.shape[2], k_cache.shape[3])
    flat_v = v_cache.view(-1, v_cache.shape[2], v_cache.shape[3])
    flat_k.index_copy_(0, slots, k.to(k_cache.dtype))
    flat_v.index_copy_(0, slots, v.to(v_cache.dtype))
    return flat_k, flat_v


def context_slots(layout: BatchLayout, block_size: int) -> np.ndarray:
    """Every sequence's cache slots, positions 0 .. context - 1, packed in work order."""
    lens = layout.context_lens.astype(np.int64)
    total = int(lens.sum())
    seq = np.repeat(np.arange(len(lens)), lens)
    position = np.arange(total) - np.repeat(np.cumsum(lens) - lens, lens)
    blocks = layout.block_tables[seq, position // block_size]
    return np.asarray(blocks * block_size + position % block_size, dtype=np.int64)


def prepare_packed(layout: BatchLayout, block_size: int, device: torch.device) -> PackedMetadata:
    """The packed indices of one step, vectorised on the host and sent in one copy."""
    q_lens = layout.query_lens.astype(np.int64)
    k_lens = layout.context_lens.astype(np.int64)
    cu_q = np.concatenate([[0], np.cumsum(q_lens)])
    cu_k = np.concatenate([[0], np.cumsum(k_lens)])
    slots = np.asarray(layout.slot_mapping, dtype=np.int64)
    host = np.concatenate([slots, context_slots(layout, block_size), cu_q, cu_k])
    packed = torch.from_numpy(host)
    if device.type != "cpu":
        packed = packed.to(device, non_blocking=True)
    n, c, s = len(slots), int(cu_k[-1]), len(q_lens) + 1
    return PackedMetadata(
        slot_mapping=packed[:n],
        context_slots=packed[n : n + c],
        cu_seqlens_q=packed[n + c : n + c + s].to(torch.int32),
        cu_seqlens_k=packed[n + c + s :].to(torch.int32),
        max_seqlen_q=int(q_lens.max()),
        max_seqlen_k=int(k_lens.max()),
    )


def prepare_padded(layout: BatchLayout, block_size: int, device: torch.device) -> PaddedMetadata:
    """SDPA's padded indices and bottom-right causal mask (built on the host, then copied)."""
    packed = prepare_packed(layout, block_size, device)
    seqs = len(layout.query_lens)
    max_q, max_k = packed.max_seqlen_q, packed.max_seqlen_k
    q_lens = torch.from_numpy(layout.query_lens.astype(np.int64))
    k_lens = torch.from_numpy(layout.context_lens.astype(np.int64))
    q_starts = torch.cumsum(q_lens, 0) - q_lens
    k_starts = torch.cumsum(k_lens, 0) - k_lens
    total_q, total_k = int(q_lens.sum()), int(k_lens.sum())
    q_pos = torch.arange(max_q)
    k_pos = torch.arange(max_k)
    q_valid = q_pos[None, :] < q_lens[:, None]
    # Pad positions point at row `total_q`, a zero row appended to q in `forward`.
    query_index = torch.where(q_valid, q_starts[:, None] + q_pos[None, :], total_q)
    key_index = torch.clamp(k_starts[:, None] + k_pos[None, :], max=max(total_k - 1, 0))
    # Absolute position of each query row, aligned to the end of the context.
    q_abs = (k_lens - q_lens)[:, None] + q_pos[None, :]
    allowed = (k_pos[None, None, :] <= q_abs[:, :, None]) & (
        k_pos[None, None, :] < k_lens[:, None, None]
    )
    allowed &= q_valid[:, :, None]
    # Fully masked pad rows would give NaN: let them see key 0 (their output is dropped).
    allowed[:, :, 0] |= ~q_valid
    rows = torch.arange(seqs)[:, None] * max_q + q_pos[None, :]
    query_rows = rows[q_valid]
    query_positions = torch.where(q_valid, q_abs, -1)[:, None, :, None]

    def on(t: torch.Tensor, dtype: torch.dtype = torch.long) -> torch.Tensor:
        return t.to(device=device, dtype=dtype)

    return PaddedMetadata(
        packed=packed,
        query_index=on(query_index),
        padded_slots=packed.context_slots[on(key_index)],
        mask=on(allowed[:, None], torch.bool),
        query_rows=on(query_rows),
        query_positions=on(query_positions),
    )


class SdpaVarlenAttention:
    """All sequences in one padded `scaled_dot_product_attention` call."""

    name = "sdpa_varlen"

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size

    def prepare(
        self, layout: BatchLayout, device: torch.device, slot_mapping: torch.Tensor | None = None
    ) -> PaddedMetadata:
        return prepare_padded(layout, self.block_size, device)

    def forward(  # noqa: PLR0913 - q/k/v, the caches, the step, the layer's scale, window, softcap
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: PaddedMetadata,
        scale: float | None = None,
        window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Store this step's K/V in the paged cache, gather the padded contexts, attend."""
        refuse_softcap(self.name, softcap)
        refuse_sinks(self.name, sinks)
        flat_k, flat_v = _write_kv(k, v, k_cache, v_cache, metadata.packed.slot_mapping)
        keys = flat_k[metadata.padded_slots].to(q.dtype)  # one gather, straight to padded
        values = flat_v[metadata.padded_slots].to(q.dtype)
        padded_q = torch.cat([q, q.new_zeros(1, *q.shape[1:])])[metadata.query_index]
        out = F.scaled_dot_product_attention(
            padded_q.transpose(1, 2),  # [seqs, heads, max_q, dim]
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=metadata.mask_for(window),
            scale=scale,
            enable_gqa=True,
        )
        flat_out = out.transpose(1, 2).reshape(-1, q.shape[1], q.shape[2])
        return flat_out[metadata.query_rows]


class FlashVarlenAttention:
    """flash-attn's varlen kernel over the packed batch (CUDA, fp16/bf16).

    The contexts are gathered out of the paged cache: flash-attn 2's own block-table
    support needs pages of a multiple of 256 tokens, and the cache's blocks are 16.
    """

    name = "flash_varlen"

    def __init__(self, block_size: int) -> None:
        from flash_attn import flash_attn_varlen_func

        self.block_size = block_size
        self._kernel = flash_attn_varlen_func

    def probe(self, device: torch.device, dtype: torch.dtype = torch.float16) -> None:
        """One real call on ``device`` in ``dtype`` (an ABI-mismatched or wrong-architecture
        build, or a dtype flash-attn lacks, fails here, at start-up, not in the first
        request's step); raises what the call raised."""
        layout = BatchLayout.from_lists([3, 1], [3, 5], [[0], [1]], [0, 1, 2, 20])
        q = torch.randn(4, 2, 64, device=device, dtype=dtype)
        cache = torch.zeros(2, self.block_size, 1, 64, device=device, dtype=dtype)
        kv = torch.randn(4, 1, 64, device=device, dtype=dtype)
        metadata = self.prepare(layout, device)
        out = self.forward(q, kv, kv, cache, cache.clone(), metadata)
        torch.cuda.synchronize(device)
        if out.shape != q.shape or not bool(torch.isfinite(out).all()):
            raise RuntimeError("flash-attn returned a wrong or non-finite result")

    def prepare(
        self, layout: BatchLayout, device: torch.device, slot_mapping: torch.Tensor | None = None
    ) -> PackedMetadata:
        return prepare_packed(layout, self.block_size, device)

    def forward(  # noqa: PLR0913 - q/k/v, the caches, the step, the layer's scale, window, softcap
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: PackedMetadata,
        scale: float | None = None,
        window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Store this step's K/V in the paged cache, gather the packed contexts, attend."""
        refuse_softcap(self.name, softcap)
        refuse_sinks(self.name, sinks)
        flat_k, flat_v = _write_kv(k, v, k_cache, v_cache, metadata.slot_mapping)
        out: torch.Tensor = self._kernel(
            q,
            flat_k[metadata.context_slots],
            flat_v[metadata.context_slots],
            metadata.cu_seqlens_q,
            metadata.cu_seqlens_k,
            metadata.max_seqlen_q,
            metadata.max_seqlen_k,
            softmax_scale=scale,
            causal=True,
            window_size=(-1, -1) if window is None else (window - 1, 0),
        )
        return out
