"""What the runner and every paged-attention backend share.

The seam for faster kernels: ``selection.select_attention_backend`` is called once at
start-up and returns an ``AttentionBackend``. Per step, the runner describes the batch with
a ``BatchLayout`` (numpy arrays), the backend turns it into its own metadata once
(``prepare``), and every layer then calls ``forward``. ``torch_paged.TorchPagedAttention``
is the reference: pure torch, runs anywhere, and defines the semantics a flash/paged CUDA
backend must reproduce.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch


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

    def forward(  # noqa: PLR0913 - q/k/v, the caches, the step, the layer's scale, window, softcap
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: Any,
        scale: float | None = None,
        window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attend: ``q`` [tokens, heads, dim], ``k``/``v`` [tokens, kv_heads, dim] → like ``q``.

        ``scale`` multiplies the scores before the softmax; None means 1/sqrt(dim).
        ``window`` is the layer's sliding window (None: full attention): a query at
        position ``p`` attends to the keys at positions ``p - window < t <= p`` (Mistral's
        and transformers' convention: ``window`` keys, its own included).
        ``softcap`` (None: none) caps the scaled scores to ``softcap * tanh(score /
        softcap)`` before the softmax (Gemma 2's ``attn_logit_softcapping``); only the
        backends whose ``supports_softcap`` is true take it (``layers.check_softcap``).
        ``sinks`` (None: none), float32 [heads] (this rank's query heads), are attention
        sinks (gpt-oss's): a learned logit per query head that joins each row's softmax
        denominator, ``exp(sink)`` beside the ``exp(score)`` of every key seen, and
        contributes no value; only the backends whose ``supports_sinks`` is true take it
        (``layers.check_sinks``).
        """
        ...


def refuse_softcap(backend: str, softcap: float | None) -> None:
    """For the backends that cannot soft-cap the scores (the models that need it check
    ``supports_softcap`` at start-up, so this is only a guard against wrong results)."""
    if softcap is not None:
        raise ValueError(f"the {backend} attention backend cannot soft-cap attention scores")


def refuse_sinks(backend: str, sinks: torch.Tensor | None) -> None:
    """For the backends without attention sinks (the models that have them check
    ``supports_sinks`` at start-up, so this is only a guard against wrong results)."""
    if sinks is not None:
        raise ValueError(f"the {backend} attention backend cannot attend with attention sinks")
