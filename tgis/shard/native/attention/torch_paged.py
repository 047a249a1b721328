"""Paged attention over the flattened (varlen, unpadded) batch.

The seam for faster kernels: ``select_attention_backend`` is called once at start-up and
returns an ``AttentionBackend``. Per step, the runner describes the batch with a
``BatchLayout`` (numpy arrays), the backend turns it into its own metadata once
(``prepare``), and every layer then calls ``forward``. ``TorchPagedAttention`` is the
reference: pure torch, runs anywhere, and defines the semantics a flash/paged CUDA backend
must reproduce.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
import torch.nn.functional as F

from tgis.shard.errors import StartupError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BatchLayout:
    """A step's scheduled tokens, flattened in work order (numpy, on the host).

    Sequence ``i`` owns token rows ``query_starts[i] : query_starts[i] + query_lens[i]``,
    at absolute positions ``context_lens[i] - query_lens[i]`` onwards; after the step its
    cache holds ``context_lens[i]`` tokens. ``block_tables[i]`` is its block table (padded
    with zeros to the longest of the step), ``slot_mapping[r]`` the flat KV slot where row
    ``r``'s key and value are written.
    """

    query_lens: np.ndarray  # [seqs] int64
    context_lens: np.ndarray  # [seqs]
    query_starts: np.ndarray  # [seqs]
    block_tables: np.ndarray  # [seqs, max blocks of the step]
    slot_mapping: np.ndarray  # [tokens]
    input_ids: np.ndarray | None = None  # [tokens] (None when only attention is laid out)
    positions: np.ndarray | None = None  # [tokens]

    @classmethod
    def from_lists(
        cls,
        query_lens: Sequence[int],
        context_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        slot_mapping: Sequence[int],
    ) -> BatchLayout:
        """A layout from plain per-sequence lists (tests and benchmarks)."""
        lens = np.asarray(query_lens, dtype=np.int64)
        width = max((len(t) for t in block_tables), default=0)
        tables = np.zeros((len(block_tables), width), dtype=np.int64)
        for i, table in enumerate(block_tables):
            tables[i, : len(table)] = table
        return cls(
            query_lens=lens,
            context_lens=np.asarray(context_lens, dtype=np.int64),
            query_starts=np.cumsum(lens) - lens,
            block_tables=tables,
            slot_mapping=np.asarray(slot_mapping, dtype=np.int64),
        )

    def to_device(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Input ids, positions and KV slots as int64 tensors on ``device`` (one copy)."""
        assert self.input_ids is not None and self.positions is not None
        packed = torch.from_numpy(np.stack([self.input_ids, self.positions, self.slot_mapping]))
        if device.type != "cpu":
            packed = packed.to(device, non_blocking=True)
        return packed[0], packed[1], packed[2]


class AttentionBackend(Protocol):
    """Writes new K/V into the paged cache and attends each query to its sequence's keys."""

    name: str

    def prepare(
        self, layout: BatchLayout, device: torch.device, slot_mapping: torch.Tensor | None = None
    ) -> Any:
        """Per-step metadata, built once and shared by every layer (``slot_mapping``: the
        layout's slots already on ``device``, if the caller has them)."""
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


class TorchPagedAttention:
    """Reference paged attention in pure torch (CPU or GPU).

    One-token (decode) sequences are attended together in one padded SDPA call over their
    contexts, gathered block by block (``index_select`` of whole blocks); sequences with
    several new tokens (prefill or prompt chunks) one by one, so no memory is spent on
    padding long prompts, and a fresh prompt attends to its own keys without a gather.
    """

    name = "torch_paged"
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
        num_blocks, _, num_kv_heads, head_dim = k_cache.shape
        k = k.to(k_cache.dtype)
        v = v.to(v_cache.dtype)
        k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, metadata.slot_mapping, k)
        v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, metadata.slot_mapping, v)
        k_blocks = k_cache.view(num_blocks, -1)
        v_blocks = v_cache.view(num_blocks, -1)
        decode_rows = metadata.decode_rows
        if decode_rows is not None and not metadata.prefill and isinstance(decode_rows, slice):
            return self._decode(q, k_blocks, v_blocks, metadata, scale, k_cache.dtype)
        out = torch.empty_like(q)
        for seq in metadata.prefill:
            rows = slice(seq.start, seq.start + seq.length)
            if seq.blocks is None:
                keys, values = k[rows], v[rows]
            else:
                shape = (-1, num_kv_heads, head_dim)
                keys = k_blocks.index_select(0, seq.blocks).view(shape)[: seq.context_len]
                values = v_blocks.index_select(0, seq.blocks).view(shape)[: seq.context_len]
            attn = F.scaled_dot_product_attention(
                q[rows].transpose(0, 1).unsqueeze(0),
                keys.transpose(0, 1).unsqueeze(0).to(q.dtype),
                values.transpose(0, 1).unsqueeze(0).to(q.dtype),
                attn_mask=seq.mask,
                is_causal=seq.mask is None,
                scale=scale,
                enable_gqa=True,
            )
            out[rows] = attn[0].transpose(0, 1)
        if decode_rows is not None:
            out[decode_rows] = self._decode(q, k_blocks, v_blocks, metadata, scale, k_cache.dtype)
        return out

    def _decode(
        self,
        q: torch.Tensor,
        k_blocks: torch.Tensor,
        v_blocks: torch.Tensor,
        metadata: TorchPagedMetadata,
        scale: float | None,
        cache_dtype: torch.dtype,
    ) -> torch.Tensor:
        """The one-token sequences, in one SDPA call over their gathered contexts."""
        tables, context = metadata.decode_tables, metadata.decode_context
        assert tables is not None and context is not None and metadata.decode_rows is not None
        queries = q[metadata.decode_rows].unsqueeze(2)  # [decodes, heads, 1, dim]
        count, _, _, head_dim = queries.shape
        shape = (count, -1, k_blocks.shape[1] // (self.block_size * head_dim), head_dim)
        flat = tables.view(-1)
        keys = k_blocks.index_select(0, flat).view(shape).transpose(1, 2)
        values = v_blocks.index_select(0, flat).view(shape).transpose(1, 2)
        mask = metadata.decode_mask
        if mask is None:
            mask = _key_mask(context, tables.shape[1] * self.block_size)
        attn = F.scaled_dot_product_attention(
            queries,
            keys.to(q.dtype),
            values.to(q.dtype),
            attn_mask=mask,
            scale=scale,
            enable_gqa=True,
        )
        return attn.squeeze(2)


def _key_mask(context: torch.Tensor, width: int) -> torch.Tensor:
    """[rows, 1, 1, width]: key position < the row's context length."""
    key_pos = torch.arange(width, device=context.device)
    return (key_pos[None, :] < context[:, None])[:, None, None, :]


BACKENDS = ("torch_paged", "cpu_paged", "sdpa_varlen", "flash_varlen", "triton_paged")


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _has_triton() -> bool:
    """Whether Triton imports (checked only when a CUDA backend is chosen)."""
    try:
        import triton  # noqa: F401
    except Exception:  # ImportError, or a broken install failing at import
        return False
    return True


def select_attention_backend(device: torch.device, block_size: int) -> AttentionBackend:
    """The attention implementation for this device, chosen once at start-up.

    ``TGIS_ATTENTION_BACKEND`` (one of ``BACKENDS``) forces a choice. Otherwise: on CUDA,
    ``triton_paged`` (``triton_paged.py``: Triton kernels reading the paged cache in
    place) when Triton imports, unless TGIS's ``FLASH_ATTENTION=true`` asks for flash-attn
    and it is installed; without Triton, flash-attn's varlen kernel when installed, else the
    reference (whose prefills use PyTorch's causal SDPA kernels and whose decodes share one
    SDPA call). On CPU ``cpu_paged`` (the reference with its decodes in a C kernel that
    reads the paged cache in place, BENCHMARKS.md) when the extension was built, else the
    reference. ``FLASH_ATTENTION=true`` without flash-attn only warns; ``PAGED_ATTENTION``
    needs nothing: the KV cache is always paged. Triton is imported only here, when
    chosen, never by importing this module.
    """
    from tgis.shard.native.attention.cpu_paged import CpuPagedAttention, load_kernel
    from tgis.shard.native.attention.varlen import FlashVarlenAttention, SdpaVarlenAttention

    choice = os.environ.get("TGIS_ATTENTION_BACKEND", "").strip().lower()
    if choice and choice not in BACKENDS:
        raise ValueError(f"TGIS_ATTENTION_BACKEND={choice!r} is not one of {', '.join(BACKENDS)}")
    if not choice and device.type == "cuda":
        has_flash = importlib.util.find_spec("flash_attn") is not None
        wants_flash = _env_true("FLASH_ATTENTION")
        if wants_flash and not has_flash:
            log.warning("FLASH_ATTENTION=true but flash-attn is not installed")
        if has_flash and (wants_flash or not _has_triton()):
            choice = "flash_varlen"
        else:
            choice = "triton_paged" if _has_triton() else "torch_paged"
    kernel = load_kernel() if device.type == "cpu" else None
    if not choice:
        choice = "cpu_paged" if kernel is not None else "torch_paged"
    if choice == "cpu_paged":
        if kernel is None:
            raise ValueError(
                "TGIS_ATTENTION_BACKEND=cpu_paged needs the CPU kernel (built by pip install "
                "with a C compiler) and a CPU device"
            )
        return CpuPagedAttention(block_size, kernel)
    if choice == "triton_paged":
        return _triton_backend(device, block_size)
    if choice == "flash_varlen":
        return FlashVarlenAttention(block_size)
    if choice == "sdpa_varlen":
        return SdpaVarlenAttention(block_size)
    return TorchPagedAttention(block_size)


def start_attention_backend(
    device: torch.device, block_size: int, dtype: torch.dtype
) -> AttentionBackend:
    """``select_attention_backend``, then on CUDA one real call of the chosen kernels in the
    model's dtype (``probe``): an install that cannot run them (a flash-attn wheel built for
    another torch, a Triton that cannot compile for this GPU, a dtype the kernel lacks)
    fails here, not in the first request's step. A backend forced by
    ``TGIS_ATTENTION_BACKEND`` that fails is a StartupError; a default one falls back to
    the reference with a warning."""
    backend = select_attention_backend(device, block_size)
    probe = getattr(backend, "probe", None)
    if device.type != "cuda" or probe is None:
        return backend
    try:
        probe(device, dtype)
    except Exception as e:
        reason = " ".join(str(e).split())[:300] or type(e).__name__
        if os.environ.get("TGIS_ATTENTION_BACKEND", "").strip():
            raise StartupError(
                f"attention backend {backend.name} failed its start-up probe: {reason}"
            ) from None
        log.warning(
            "attention backend %s failed its start-up probe (%s); using torch_paged",
            backend.name,
            reason,
        )
        return TorchPagedAttention(block_size)
    log.info("attention backend %s passed its start-up probe", backend.name)
    return backend


def _triton_backend(device: torch.device, block_size: int) -> AttentionBackend:
    """``triton_paged``: CUDA, or CPU tensors under Triton's interpreter (tests)."""
    interpreted = os.environ.get("TRITON_INTERPRET", "").strip() == "1"
    if device.type != "cuda" and not interpreted:
        raise ValueError(
            "TGIS_ATTENTION_BACKEND=triton_paged needs a CUDA device (or TRITON_INTERPRET=1)"
        )
    if not _has_triton():
        raise ValueError("TGIS_ATTENTION_BACKEND=triton_paged needs the triton package")
    from tgis.shard.native.attention.triton_paged import TritonPagedAttention

    return TritonPagedAttention(block_size)
