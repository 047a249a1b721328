"""LoRA adapters in the native engine: which rows of a step use which adapter.

Requests for different LoRA adapters and for none run in the same step. ``lora_rows``
groups the step's flattened rows by adapter; every linear layer an adapter targets then
adds, for each group, ``(x[rows] @ A) @ B`` to its output rows (``LoraRows.add``): one pair
of small matmuls per adapter present and site, whatever the number of sequences. Rows of
sequences without an adapter are untouched, and a step without LoRA rows pays nothing.
Such steps run the eager forward (the compiled step and CUDA graphs never see adapters).
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tgis.shard.adapters.lora_layout import LoraWeights

if TYPE_CHECKING:
    from tgis.shard.step.plan import WorkItem


@dataclass(frozen=True)
class LoraGroup:
    """One adapter and the rows of the step that use it (None: every row)."""

    weights: LoraWeights
    rows: torch.Tensor | None


@dataclass(frozen=True)
class LoraRows:
    """The adapters of one step, each with its rows."""

    groups: tuple[LoraGroup, ...]

    def add(self, site: int, x: torch.Tensor, y: torch.Tensor) -> None:
        """Add to ``y`` (the output of site ``site`` for input ``x``) each group's delta, in
        place, on that group's rows."""
        for group in self.groups:
            pair = group.weights.pairs.get(site)
            if pair is None:
                continue
            if group.rows is None:
                y.add_((x @ pair.a) @ pair.b)
            else:
                delta = (x.index_select(0, group.rows) @ pair.a) @ pair.b
                y.index_add_(0, group.rows, delta)


def lora_rows(
    work: SequenceOf[WorkItem], query_starts: list[int], device: torch.device
) -> LoraRows | None:
    """The step's LoRA groups, or None when no scheduled sequence has a LoRA adapter.

    ``query_starts[i]`` is the first row of ``work[i]`` in the flattened batch.
    """
    by_adapter: dict[str, tuple[LoraWeights, list[range]]] = {}
    for item, row in zip(work, query_starts, strict=True):
        weights = item.seq.lora
        if weights is None:
            continue
        entry = by_adapter.setdefault(weights.adapter_id, (weights, []))
        entry[1].append(range(row, row + item.num_tokens))
    if not by_adapter:
        return None
    total = sum(item.num_tokens for item in work)
    groups = []
    for weights, spans in by_adapter.values():
        count = sum(len(s) for s in spans)
        rows = None
        if count != total:
            rows = torch.tensor([r for s in spans for r in s], dtype=torch.long, device=device)
        groups.append(LoraGroup(weights, rows))
    return LoraRows(tuple(groups))
