"""What ``HfRunner`` needs from a transformers model family (causal or encoder-decoder).

An engine runs the forward pass of one step over its batched caches (``kv.KVBatch``)
and returns a ``Forward``: the logits to sample from, the input-token details, and the
cache *after* the step, which becomes the engine's state only when the runner commits it
(so a step that raises leaves the cache as it was).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch

from tgis.shard.fallback.kv import KVBatch, concat, select
from tgis.shard.step.plan import WorkItem
from tgis.shard.step.sequence import Sequence as ShardSequence
from tgis.shard_api.messages import TokenDetail

# Batch row id of a forgotten sequence: never matches a request, dropped by the next select.
FORGOTTEN = -1


@dataclass(frozen=True)
class Forward:
    """The outcome of one engine forward, not yet committed."""

    sample_items: tuple[WorkItem, ...]  # sequences that get a token, in logits row order
    logits: torch.Tensor | None  # float32 [len(sample_items), vocab]
    batch: KVBatch  # the engine's cache after this step
    input_details: dict[int, list[TokenDetail]] = field(default_factory=dict)


@dataclass(frozen=True)
class Part:
    """One forward's share of a step: its sampling items, their logits, its cache rows."""

    sample_items: tuple[WorkItem, ...]
    logits: torch.Tensor | None  # float32 [len(sample_items), vocab]
    batch: KVBatch
    input_details: dict[int, list[TokenDetail]] = field(default_factory=dict)


def combine(parts: Sequence[Part], previous: KVBatch, live: Collection[int]) -> Forward:
    """The step's ``Forward`` from its parts; rows of ``previous`` whose sequences are alive
    but were not computed this step are carried over (packed), the others dropped."""
    batches = [part.batch for part in parts]
    handled = {r for batch in batches for r in batch.rows}
    carried = [r for r in previous.rows if r in live and r not in handled]
    if carried:
        batches.append(select(previous, carried))
    logits = [part.logits for part in parts if part.logits is not None]
    return Forward(
        sample_items=tuple(item for part in parts for item in part.sample_items),
        logits=torch.cat(logits) if logits else None,
        batch=concat(batches) if batches else select(previous, ()),
        input_details={rid: d for part in parts for rid, d in part.input_details.items()},
    )


class HfEngine(Protocol):
    """One model family's batched forward over transformers caches."""

    model: Any  # the transformers model

    def run(self, work: Sequence[WorkItem], live: Collection[int]) -> Forward:
        """Compute ``work`` (rows of sequences in ``live`` not scheduled are carried over)."""
        ...

    def commit(self, forward: Forward) -> None:
        """Make ``forward``'s cache the engine's state."""
        ...

    def forget(self, request_ids: Collection[int]) -> None:
        """Drop these sequences' cache rows (lazily)."""
        ...

    def reset(self) -> None:
        """Drop every cache row."""
        ...

    def history(self, seq: ShardSequence) -> Sequence[int]:
        """The ids the repetition penalty considers for ``seq``."""
        ...


def forget_rows(batch: KVBatch, request_ids: Collection[int]) -> KVBatch:
    """``batch`` with the rows of ``request_ids`` renamed ``FORGOTTEN`` (no copy)."""
    if not any(r in request_ids for r in batch.rows):
        return batch
    rows = tuple(FORGOTTEN if r in request_ids else r for r in batch.rows)
    return replace(batch, rows=rows)


def in_batch_order(items: Sequence[WorkItem], batch: KVBatch) -> list[WorkItem]:
    """``items`` in ``batch``'s row order when they are exactly its rows, else as given.

    Keeping the row order lets a step whose rows did not change reuse the cache as is.
    """
    by_id = {item.seq.request_id: item for item in items}
    if len(by_id) == len(batch.rows) and set(by_id) == set(batch.rows):
        return [by_id[r] for r in batch.rows]
    return list(items)
