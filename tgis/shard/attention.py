"""Paged attention over the flattened (varlen, unpadded) batch.

The seam for faster kernels: ``select_attention_backend`` is called once at start-up and
returns an ``AttentionBackend``. Per step, the runner describes the batch with a
``BatchLayout`` (plain Python), the backend turns it into its own metadata once
(``prepare``), and every layer then calls ``forward``. ``TorchPagedAttention`` is the
reference: pure torch, runs anywhere, and defines the semantics a flash/paged CUDA backend
must reproduce.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BatchLayout:
    """Where each scheduled sequence's new tokens sit in the flattened batch.

    Sequence ``i`` owns rows ``query_starts[i] : query_starts[i] + query_lens[i]``; its new
    tokens are at absolute positions ``context_lens[i] - query_lens[i]`` onwards, and after
    the step its cache holds ``context_lens[i]`` tokens. ``slot_mapping[r]`` is the flat KV
    slot where row ``r``'s key and value are written.
    """

    query_lens: tuple[int, ...]
    context_lens: tuple[int, ...]
    block_tables: tuple[tuple[int, ...], ...]
    slot_mapping: tuple[int, ...]

    @property
    def query_starts(self) -> tuple[int, ...]:
        """Row of each sequence's first new token."""
        starts, total = [], 0
        for n in self.query_lens:
            starts.append(total)
            total += n
        return tuple(starts)


class AttentionBackend(Protocol):
    """Writes new K/V into the paged cache and attends each query to its sequence's keys."""

    name: str

    def prepare(self, layout: BatchLayout, device: torch.device) -> Any:
        """Per-step metadata, built once and shared by every layer."""
        ...

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: Any,
        scale: float | None = None,
    ) -> torch.Tensor:
        """Attend: ``q`` [tokens, heads, dim], ``k``/``v`` [tokens, kv_heads, dim] → like ``q``.

        ``scale`` multiplies the scores before the softmax; None means 1/sqrt(dim).
        """
        ...


@dataclass(frozen=True)
class _PrefillSeq:
    start: int
    length: int
    context_len: int
    block_table: torch.Tensor
    mask: torch.Tensor | None  # None: the query covers the whole context (plain causal)


@dataclass(frozen=True)
class TorchPagedMetadata:
    """Tensors ``TorchPagedAttention`` needs for one step."""

    slot_mapping: torch.Tensor  # [tokens]
    prefill: tuple[_PrefillSeq, ...]  # sequences with several new tokens, one at a time
    decode_rows: torch.Tensor | None  # [decodes] rows of the one-token sequences
    decode_tables: torch.Tensor | None  # [decodes, max_blocks]
    decode_mask: torch.Tensor | None  # [decodes, 1, 1, max_blocks * block_size]


class TorchPagedAttention:
    """Reference paged attention in pure torch (CPU or GPU).

    One-token (decode) sequences are attended together in one padded SDPA call; sequences
    with several new tokens (prefill or prompt chunks) one by one, so no memory is spent on
    padding long prompts.
    """

    name = "torch_paged"

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size

    def prepare(self, layout: BatchLayout, device: torch.device) -> TorchPagedMetadata:
        """Split the batch into decode and prefill groups and build their tensors."""
        prefill: list[_PrefillSeq] = []
        decode: list[int] = []
        for i, start in enumerate(layout.query_starts):
            n, ctx = layout.query_lens[i], layout.context_lens[i]
            num_blocks = -(-ctx // self.block_size)
            table = layout.block_tables[i][:num_blocks]
            if n == 1:
                decode.append(i)
                continue
            mask = None
            if ctx != n:
                key_pos = torch.arange(ctx, device=device)
                query_pos = torch.arange(ctx - n, ctx, device=device)
                mask = key_pos[None, :] <= query_pos[:, None]
            prefill.append(
                _PrefillSeq(
                    start, n, ctx, torch.tensor(table, dtype=torch.long, device=device), mask
                )
            )
        decode_rows = decode_tables = decode_mask = None
        if decode:
            starts = layout.query_starts
            max_blocks = max(-(-layout.context_lens[i] // self.block_size) for i in decode)
            tables = [
                list(layout.block_tables[i][:max_blocks])
                + [0] * (max_blocks - len(layout.block_tables[i][:max_blocks]))
                for i in decode
            ]
            decode_rows = torch.tensor([starts[i] for i in decode], dtype=torch.long, device=device)
            decode_tables = torch.tensor(tables, dtype=torch.long, device=device)
            ctx_lens = torch.tensor([layout.context_lens[i] for i in decode], device=device)
            key_pos = torch.arange(max_blocks * self.block_size, device=device)
            decode_mask = (key_pos[None, :] < ctx_lens[:, None])[:, None, None, :]
        return TorchPagedMetadata(
            slot_mapping=torch.tensor(layout.slot_mapping, dtype=torch.long, device=device),
            prefill=tuple(prefill),
            decode_rows=decode_rows,
            decode_tables=decode_tables,
            decode_mask=decode_mask,
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: TorchPagedMetadata,
        scale: float | None = None,
    ) -> torch.Tensor:
        """Store ``k``/``v`` in their slots, then attend causally over each sequence's cache
        (softmax scale ``scale``, default 1/sqrt(dim))."""
        num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        flat_k = k_cache.view(-1, num_kv_heads, head_dim)
        flat_v = v_cache.view(-1, num_kv_heads, head_dim)
        flat_k.index_copy_(0, metadata.slot_mapping, k.to(k_cache.dtype))
        flat_v.index_copy_(0, metadata.slot_mapping, v.to(v_cache.dtype))
        out = torch.empty_like(q)
        for seq in metadata.prefill:
            keys = k_cache[seq.block_table].flatten(0, 1)[: seq.context_len]
            values = v_cache[seq.block_table].flatten(0, 1)[: seq.context_len]
            queries = q[seq.start : seq.start + seq.length]
            attn = F.scaled_dot_product_attention(
                queries.transpose(0, 1).unsqueeze(0),
                keys.transpose(0, 1).unsqueeze(0),
                values.transpose(0, 1).unsqueeze(0),
                attn_mask=seq.mask,
                is_causal=seq.mask is None,
                scale=scale,
                enable_gqa=True,
            )
            out[seq.start : seq.start + seq.length] = attn[0].transpose(0, 1)
        if metadata.decode_rows is not None:
            assert metadata.decode_tables is not None
            keys = k_cache[metadata.decode_tables].flatten(1, 2).transpose(1, 2)
            values = v_cache[metadata.decode_tables].flatten(1, 2).transpose(1, 2)
            queries = q[metadata.decode_rows].unsqueeze(2)  # [decodes, heads, 1, dim]
            attn = F.scaled_dot_product_attention(
                queries,
                keys,
                values,
                attn_mask=metadata.decode_mask,
                scale=scale,
                enable_gqa=True,
            )
            out[metadata.decode_rows] = attn.squeeze(2)
        return out


BACKENDS = ("torch_paged", "sdpa_varlen", "flash_varlen")


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def select_attention_backend(device: torch.device, block_size: int) -> AttentionBackend:
    """The attention implementation for this device, chosen once at start-up.

    ``TGIS_ATTENTION_BACKEND`` (one of ``BACKENDS``) forces a choice. Otherwise: on CUDA,
    flash-attn's varlen kernel when the package is installed, else the reference (whose
    prefills use PyTorch's causal SDPA kernels and whose decodes share one SDPA call); on
    CPU the reference, which BENCHMARKS.md measures faster there than the padded
    ``sdpa_varlen``. TGIS's ``FLASH_ATTENTION=true`` asks for flash-attn (a warning when it
    is missing); ``PAGED_ATTENTION`` needs nothing: the KV cache is always paged.
    """
    from tgis.shard.attention_varlen import FlashVarlenAttention, SdpaVarlenAttention

    choice = os.environ.get("TGIS_ATTENTION_BACKEND", "").strip().lower()
    if choice and choice not in BACKENDS:
        raise ValueError(f"TGIS_ATTENTION_BACKEND={choice!r} is not one of {', '.join(BACKENDS)}")
    if not choice and device.type == "cuda":
        has_flash = importlib.util.find_spec("flash_attn") is not None
        if _env_true("FLASH_ATTENTION") and not has_flash:
            log.warning("FLASH_ATTENTION=true but flash-attn is not installed")
        choice = "flash_varlen" if has_flash else "torch_paged"
    if choice == "flash_varlen":
        return FlashVarlenAttention(block_size)
    if choice == "sdpa_varlen":
        return SdpaVarlenAttention(block_size)
    return TorchPagedAttention(block_size)
