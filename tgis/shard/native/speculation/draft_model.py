"""Speculative decoding with a draft model (``--speculator-name``): a small model that
shares the target's vocabulary drafts tokens on the shard, which the target then verifies
exactly as it verifies prompt-lookup drafts (``step/speculation.py``).

The draft model keeps its own paged KV cache with the target's geometry in blocks: block
``b`` of the draft cache belongs to whoever holds block ``b`` of the target's, so the
router's block tables serve both and nothing is allocated twice. A sequence's draft cache
is filled lazily: when the router asks for drafts (``WorkItem.spec_tokens``), the draft
model first computes the positions it has not seen (``Sequence.draft_computed`` up to the
last known token: the whole prompt the first time), which gives the first draft; each
further draft is one more single-token step of the draft model. Drafts are greedy (the
argmax of the draft's logits, EOS left out where the target's min_new_tokens masks it):
verification keeps the output exact whatever they are.

Positions the draft model wrote after the last confirmed draft hold stale keys and values;
``Sequence.draft_computed`` stops before them, so they are computed again before use.
"""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass, replace
from typing import Protocol

import torch

from tgis.shard.native.attention.block_tables import BlockTables, flatten
from tgis.shard.native.attention.interface import AttentionBackend
from tgis.shard.native.attention.kv_cache import KVCache
from tgis.shard.native.models import CausalLM
from tgis.shard.step.plan import WorkItem
from tgis.shard.step.sampling import argmax_rows

__all__ = ["DraftModel", "Drafter", "draft_computed_after", "mask_eos_drafts"]


class Drafter(Protocol):
    """What drafts on the shard: a draft model, or an MLP speculator (``mlp_drafter.py``)."""

    def draft(self, work: SequenceOf[WorkItem], tables: BlockTables) -> tuple[WorkItem, ...]:
        """``work`` with the items asking for drafts given them."""
        ...

    def observe(
        self,
        work: SequenceOf[WorkItem],
        query_starts: SequenceOf[int],
        hidden: torch.Tensor,
        sampled: Mapping[int, object],
        accepted: Mapping[int, SequenceOf[object]],
    ) -> None:
        """See the step's final hidden rows (``work``'s from ``query_starts``) once its
        tokens are sampled (``sampled``) and its drafts verified (``accepted``)."""
        ...


@dataclass
class DraftModel:
    """The draft model and its KV cache (as many blocks as the target's)."""

    model: CausalLM
    kv_cache: KVCache
    attention: AttentionBackend
    device: torch.device
    name: str = ""
    eos_token_ids: tuple[int, ...] = ()

    def observe(
        self,
        work: SequenceOf[WorkItem],
        query_starts: SequenceOf[int],
        hidden: torch.Tensor,
        sampled: Mapping[int, object],
        accepted: Mapping[int, SequenceOf[object]],
    ) -> None:
        """Nothing: the draft model reads its own cache."""

    def draft(self, work: SequenceOf[WorkItem], tables: BlockTables) -> tuple[WorkItem, ...]:
        """``work`` with every item that asks for drafts given them (``drafts`` set, its
        ``end`` past them); the others unchanged."""
        asking = [i for i, item in enumerate(work) if item.spec_tokens]
        if not asking:
            return tuple(work)
        items = [work[i] for i in asking]
        # Catch up: every position from the first the draft model lacks to the last known.
        catch_up = [replace(item, start=item.seq.draft_computed, drafts=()) for item in items]
        drafts = [[t] for t in self._next_tokens(catch_up, tables, 0)]
        for step in range(1, max(item.spec_tokens for item in items)):
            going = [i for i, item in enumerate(items) if item.spec_tokens > step]
            single = [
                replace(
                    items[i],
                    start=items[i].start + step,
                    end=items[i].start + step + 1,
                    new_block_ids=(),
                    drafts=(drafts[i][-1],),
                )
                for i in going
            ]
            for i, token in zip(going, self._next_tokens(single, tables, step), strict=True):
                drafts[i].append(token)
        out = list(work)
        for index, item, drafted in zip(asking, items, drafts, strict=True):
            out[index] = replace(item, end=item.start + 1 + len(drafted), drafts=tuple(drafted))
        return tuple(out)

    @torch.inference_mode()
    def _next_tokens(
        self, items: SequenceOf[WorkItem], tables: BlockTables, drafted: int
    ) -> list[int]:
        """Run the draft model over ``items`` (writing its cache); the argmax of each item's
        last position, the ``drafted``-th draft (EOS out while min_new_tokens masks it)."""
        layout = flatten(items, tables, self.kv_cache.block_size)
        input_ids, positions, slot_mapping = layout.to_device(self.device)
        metadata = self.attention.prepare(layout, self.device, slot_mapping)
        hidden = self.model.forward(input_ids, positions, self.kv_cache, metadata)
        last = torch.as_tensor(layout.query_starts + layout.query_lens - 1, device=self.device)
        logits = self.model.compute_logits(hidden[last]).float()
        mask_eos_drafts(logits, items, drafted, self.eos_token_ids)
        return [int(t) for t in argmax_rows(logits).tolist()]


def mask_eos_drafts(
    logits: torch.Tensor, items: SequenceOf[WorkItem], drafted: int, eos_token_ids: SequenceOf[int]
) -> None:
    """No EOS as the ``drafted``-th draft of an item (a row of ``logits``) whose
    min_new_tokens masks it there, as the target's sampling would."""
    short = [
        row
        for row, item in enumerate(items)
        if item.seq.num_generated + drafted < item.seq.sampling.min_new_tokens
    ]
    eos = [t for t in eos_token_ids if 0 <= t < logits.shape[-1]]
    if short and eos:
        logits[torch.tensor(short)[:, None], torch.tensor(eos)[None, :]] = float("-inf")


def draft_computed_after(item: WorkItem, confirmed: int) -> int:
    """``item``'s sequence's draft-cache positions still valid once ``confirmed`` of its
    drafts are confirmed: up to the last confirmed draft, and not past the last position
    the draft model wrote (the last known token and all drafts but the last)."""
    return min(item.start + len(item.drafts), item.start + 1 + confirmed)
