"""Drafting with an MLP speculator (``mlp_speculator.py``) on the shard: it needs, per
sequence, the target's final hidden row of the position that produced the sequence's last
known token, which each step leaves behind (``observe``: the last row of a plain item, the
row of the last kept token of a verified one). A sequence asking for drafts
(``WorkItem.spec_tokens``) gets up to ``n_predict`` greedy drafts from it (EOS left out
while min_new_tokens masks it); one without that row (none kept yet) gets none, and
decodes plainly. Verification (``step/speculation.py``) keeps the output exact.
"""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass, replace

import torch

from tgis.shard.native.attention.block_tables import BlockTables
from tgis.shard.native.speculation.draft_model import mask_eos_drafts
from tgis.shard.native.speculation.mlp_speculator import MLPSpeculator
from tgis.shard.step.plan import WorkItem
from tgis.shard.step.sampling import argmax_rows

__all__ = ["MLPDrafter"]


@dataclass
class MLPDrafter:
    """The speculator and the target's EOS ids."""

    model: MLPSpeculator
    name: str = ""
    eos_token_ids: tuple[int, ...] = ()

    @torch.inference_mode()
    def draft(self, work: SequenceOf[WorkItem], tables: BlockTables) -> tuple[WorkItem, ...]:
        """``work`` with every item that asks for drafts, and has its hidden row, given
        them (``drafts`` set, its ``end`` past them); the others unchanged."""
        del tables  # no cache of its own
        asking = [
            i
            for i, item in enumerate(work)
            if item.spec_tokens
            and item.seq.draft_hidden is not None
            and item.seq.draft_hidden[0] == len(item.seq.token_ids) - 2
        ]
        if not asking:
            return tuple(work)
        items = [work[i] for i in asking]
        hidden = [item.seq.draft_hidden for item in items]
        state = torch.stack([row for _, row in hidden])  # type: ignore[misc]
        tokens = torch.tensor([item.seq.token_ids[-1] for item in items], device=state.device)
        depth = min(self.model.n_predict, max(item.spec_tokens for item in items))
        drafts: list[list[int]] = [[] for _ in items]
        for step in range(depth):
            state, logits = self.model.step(step, state, tokens)
            mask_eos_drafts(logits, items, step, self.eos_token_ids)
            tokens = argmax_rows(logits)
            for row, token in enumerate(tokens.tolist()):
                if items[row].spec_tokens > step:
                    drafts[row].append(int(token))
        out = list(work)
        for index, item, drafted in zip(asking, items, drafts, strict=True):
            out[index] = replace(item, end=item.start + 1 + len(drafted), drafts=tuple(drafted))
        return tuple(out)

    def observe(
        self,
        work: SequenceOf[WorkItem],
        query_starts: SequenceOf[int],
        hidden: torch.Tensor,
        sampled: Mapping[int, object],
        accepted: Mapping[int, SequenceOf[object]],
    ) -> None:
        """Keep, per sequence, the hidden row of the position before its last known token
        once the step's tokens are added (when the step computed that position)."""
        keep: list[tuple[WorkItem, int, int]] = []
        for item, first in zip(work, query_starts, strict=True):
            rid = item.seq.request_id
            known = len(item.seq.token_ids) + (rid in sampled) + len(accepted.get(rid, ()))
            position = known - 2
            if item.start <= position < item.end:
                keep.append((item, position, first + position - item.start))
        if not keep:
            return
        rows = hidden[torch.tensor([row for _, _, row in keep], device=hidden.device)]
        for (item, position, _), row in zip(keep, rows, strict=True):
            item.seq.draft_hidden = (position, row)
