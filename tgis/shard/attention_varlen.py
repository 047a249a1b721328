"""Varlen attention backends: every sequence of the step in one kernel call.

Both backends write the step's new K/V into the paged cache exactly as the reference
(`attention.TorchPagedAttention`) does, then gather each sequence's whole context out of
the cache into one packed (or padded) batch, so any block size works:

- `FlashVarlenAttention` calls flash-attn's `flash_attn_varlen_func` on the packed batch
  (CUDA only, when the `flash-attn` package is installed);
- `SdpaVarlenAttention` pads the batch and makes a single PyTorch SDPA call with a
  bottom-right causal mask (any device; the fallback on GPUs without flash-attn).

Causality is aligned to the end of each sequence's context: query row `i` of a sequence
with `n` new tokens and context `c` sees keys `0 .. c - n + i`, which covers prefill,
chunked prefill and decode alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from tgis.shard.attention import BatchLayout


@dataclass(frozen=True)
class VarlenMetadata:
    """Tensors shared by every layer of one step."""

    slot_mapping: torch.Tensor  # [tokens] where each new K/V is written
    context_slots: torch.Tensor  # [sum(context_lens)] every sequence's cache slots, packed
    cu_seqlens_q: torch.Tensor  # [seqs + 1] int32 offsets of the queries
    cu_seqlens_k: torch.Tensor  # [seqs + 1] int32 offsets of the packed keys
    max_seqlen_q: int
    max_seqlen_k: int
    # SDPA only: padded layout.
    query_index: torch.Tensor  # [seqs, max_q] row of q (or of a zero pad row) per position
    padded_slots: torch.Tensor  # [seqs, max_k] cache slot of each padded key position
    mask: torch.Tensor  # [seqs, 1, max_q, max_k] True where attention is allowed
    query_rows: torch.Tensor  # [tokens] flat index into [seqs * max_q] of each real query


def _write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """Store this step's K/V; return the caches flattened to [slots, kv_heads, dim]."""
    flat_k = k_cache.view(-1, k_cache.shape[2], k_cache.shape[3])
    flat_v = v_cache.view(-1, v_cache.shape[2], v_cache.shape[3])
    flat_k.index_copy_(0, slots, k.to(k_cache.dtype))
    flat_v.index_copy_(0, slots, v.to(v_cache.dtype))
    return flat_k, flat_v


def prepare_varlen(layout: BatchLayout, block_size: int, device: torch.device) -> VarlenMetadata:
    """Build the packed and padded indices of one step (plain Python, once per step)."""
    offsets = torch.arange(block_size)
    slot_parts: list[torch.Tensor] = []
    cu_q, cu_k = [0], [0]
    for n, ctx, table in zip(
        layout.query_lens.tolist(), layout.context_lens.tolist(), layout.block_tables, strict=True
    ):
        blocks = torch.tensor(table[: -(-ctx // block_size)])
        slot_parts.append((blocks[:, None] * block_size + offsets).flatten()[:ctx])
        cu_q.append(cu_q[-1] + n)
        cu_k.append(cu_k[-1] + ctx)
    seqs = len(layout.query_lens)
    max_q, max_k = int(layout.query_lens.max()), int(layout.context_lens.max())
    total_q = cu_q[-1]
    q_pos = torch.arange(max_q)
    k_pos = torch.arange(max_k)
    q_lens = torch.tensor(layout.query_lens)
    k_lens = torch.tensor(layout.context_lens)
    q_starts = torch.tensor(cu_q[:-1])
    k_starts = torch.tensor(cu_k[:-1])
    q_valid = q_pos[None, :] < q_lens[:, None]
    # Pad positions point at row `total_q`, a zero row appended to q in `forward`.
    query_index = torch.where(q_valid, q_starts[:, None] + q_pos[None, :], total_q)
    context_slots = torch.cat(slot_parts)
    key_index = torch.clamp(k_starts[:, None] + k_pos[None, :], max=max(cu_k[-1] - 1, 0))
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

    def on(t: torch.Tensor, dtype: torch.dtype = torch.long) -> torch.Tensor:
        return t.to(device=device, dtype=dtype)

    return VarlenMetadata(
        slot_mapping=on(torch.tensor(layout.slot_mapping)),
        context_slots=on(context_slots),
        cu_seqlens_q=on(torch.tensor(cu_q), torch.int32),
        cu_seqlens_k=on(torch.tensor(cu_k), torch.int32),
        max_seqlen_q=max_q,
        max_seqlen_k=max_k,
        query_index=on(query_index),
        padded_slots=on(context_slots[key_index]),
        mask=on(allowed[:, None], torch.bool),
        query_rows=on(query_rows),
    )


class _VarlenBackend:
    """What both varlen backends share: the per-step metadata, then one kernel per layer."""

    name = ""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size

    def prepare(
        self, layout: BatchLayout, device: torch.device, slot_mapping: torch.Tensor | None = None
    ) -> VarlenMetadata:
        return prepare_varlen(layout, self.block_size, device)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: VarlenMetadata,
        scale: float | None = None,
    ) -> torch.Tensor:
        """Store this step's K/V in the paged cache, then attend (``_attend``)."""
        flat_k, flat_v = _write_kv(k, v, k_cache, v_cache, metadata.slot_mapping)
        return self._attend(q, flat_k, flat_v, metadata, scale)

    def _attend(
        self,
        q: torch.Tensor,
        flat_k: torch.Tensor,
        flat_v: torch.Tensor,
        metadata: VarlenMetadata,
        scale: float | None,
    ) -> torch.Tensor:
        raise NotImplementedError


class SdpaVarlenAttention(_VarlenBackend):
    """All sequences in one padded `scaled_dot_product_attention` call."""

    name = "sdpa_varlen"

    def _attend(
        self,
        q: torch.Tensor,
        flat_k: torch.Tensor,
        flat_v: torch.Tensor,
        metadata: VarlenMetadata,
        scale: float | None,
    ) -> torch.Tensor:
        keys = flat_k[metadata.padded_slots].to(q.dtype)  # one gather, straight to padded
        values = flat_v[metadata.padded_slots].to(q.dtype)
        padded_q = torch.cat([q, q.new_zeros(1, *q.shape[1:])])[metadata.query_index]
        out = F.scaled_dot_product_attention(
            padded_q.transpose(1, 2),  # [seqs, heads, max_q, dim]
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=metadata.mask,
            scale=scale,
            enable_gqa=True,
        )
        flat_out = out.transpose(1, 2).reshape(-1, q.shape[1], q.shape[2])
        return flat_out[metadata.query_rows]


class FlashVarlenAttention(_VarlenBackend):
    """flash-attn's varlen kernel over the packed batch (CUDA, fp16/bf16)."""

    name = "flash_varlen"

    def __init__(self, block_size: int) -> None:
        from flash_attn import flash_attn_varlen_func

        super().__init__(block_size)
        self._kernel = flash_attn_varlen_func

    def _attend(
        self,
        q: torch.Tensor,
        flat_k: torch.Tensor,
        flat_v: torch.Tensor,
        metadata: VarlenMetadata,
        scale: float | None,
    ) -> torch.Tensor:
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
        )
        return out
