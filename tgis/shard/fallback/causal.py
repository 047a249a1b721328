"""The transformers fallback for decoder-only models (any ``AutoModelForCausalLM``).

One forward per step for every scheduled sequence. The batch is a ``KVBatch``: each row's
cache left-padded to the longest, then this step's new tokens (a decode token, a prompt
chunk or a whole prompt) in ``[rows, N]`` columns, right-padded to the longest ``N``.
(When padding many decode rows to a long prompt chunk would more than double the work,
the decode rows and the prompt chunks run as two forwards instead.)
The attention mask hides every padding column, explicit ``position_ids`` give each token
its true position (models without them, e.g. BLOOM, derive ALiBi from the mask), and
padding queries always see their row's own tokens, so no attention row is fully masked.
A prompt-tuning prefix's virtual tokens are placeholder ids at positions ``0..P-1``
(``step.plan``): a step that computes any of them feeds ``inputs_embeds`` (the model's
input embeddings, the prefix rows in place of the placeholders'), at the same positions,
so the result is transformers' ``inputs_embeds = concat(prefix, embed(ids))``.

A step whose rows computed different numbers of tokens leaves masked holes after the short
rows; the next step packs the batch again (``kv.select``). While the same rows keep
decoding one token each, the cache is reused as is: the step feeds ``[rows, 1]`` ids and
transformers appends one column.
"""

from __future__ import annotations

import inspect
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tgis.shard.fallback.engine import Forward, Part, combine, forget_rows, in_batch_order
from tgis.shard.fallback.kv import KVBatch, cache_tensors, select
from tgis.shard.step.plan import WorkItem
from tgis.shard.step.sequence import Sequence as ShardSequence
from tgis.shard.step.token_details import first_input_detail, token_details
from tgis.shard_api.messages import TokenDetail

PAD_ID = 0  # any valid id: padding columns are masked
# A step pads every row to its longest; when that would compute more than this many tokens
# (padding included) per real token, decode rows and prompt chunks run as two forwards.
MAX_PADDING_RATIO = 2


@dataclass(frozen=True)
class _Layout:
    """The inputs of one step and which logits columns are needed."""

    input_ids: torch.Tensor  # [B, N]
    positions: torch.Tensor  # [B, N]
    attention_mask: torch.Tensor  # [B, cached + N]
    packed: bool  # every row computes N tokens (no holes afterwards)
    keep: tuple[int, ...]  # new-token columns whose logits are needed
    # Prompt-tuning prefix rows of this step: (row, embeddings of its first columns), for
    # the placeholder ids whose embeddings the prefix replaces.
    prefix_rows: tuple[tuple[int, torch.Tensor], ...] = ()

    @classmethod
    def build(cls, items: Sequence[WorkItem], cached: KVBatch, device: torch.device) -> _Layout:
        """Lay out ``items`` (in ``cached``'s row order) as one right-padded block."""
        width = max(item.num_tokens for item in items)
        ids: list[list[int]] = []
        positions: list[list[int]] = []
        new_mask: list[list[int]] = []
        keep: set[int] = set()
        prefix_rows: list[tuple[int, torch.Tensor]] = []
        for row, item in enumerate(items):
            n, pad = item.num_tokens, width - item.num_tokens
            ids.append(item.seq.token_ids[item.start : item.end] + [PAD_ID] * pad)
            positions.append(list(range(item.start, item.end)) + [item.end - 1] * pad)
            new_mask.append([1] * n + [0] * pad)
            keep.update(_needed_columns(item))
            prefix = item.seq.prefix
            if prefix is not None and item.start < prefix.shape[0]:
                prefix_rows.append((row, prefix[item.start : min(item.end, prefix.shape[0])]))
        mask = torch.tensor(new_mask, dtype=torch.long, device=device)
        return cls(
            input_ids=torch.tensor(ids, dtype=torch.long, device=device),
            positions=torch.tensor(positions, dtype=torch.long, device=device),
            attention_mask=torch.cat([cached.mask, mask], dim=1),
            packed=all(item.num_tokens == width for item in items),
            keep=tuple(sorted(keep)) or (width - 1,),
            prefix_rows=tuple(prefix_rows),
        )


def _needed_columns(item: WorkItem) -> list[int]:
    """Columns (offsets in this step's tokens) whose logits ``item`` needs."""
    columns = [item.num_tokens - 1] if item.samples else []
    return columns + list(range(_detail_count(item)))


def _detail_count(item: WorkItem) -> int:
    """How many of this step's positions score a prompt token for input details."""
    if not item.prompt_details:
        return 0
    last_scored = min(item.end, item.seq.prompt_len - 1)  # position p scores token p + 1
    return max(last_scored - item.start, 0)


class HfCausalEngine:
    """Batched forward passes of a transformers causal LM over a ``KVBatch``."""

    def __init__(self, model: Any, device: torch.device, empty: KVBatch) -> None:
        self.model = model
        self.device = device
        self._empty = empty
        self._batch = empty
        params = inspect.signature(model.forward).parameters
        self._takes_positions = "position_ids" in params
        self._takes_logits_to_keep = "logits_to_keep" in params

    def reset(self) -> None:
        """Drop every cache row."""
        self._batch = self._empty

    def forget(self, request_ids: Collection[int]) -> None:
        """Drop these sequences' rows at the next re-layout."""
        self._batch = forget_rows(self._batch, request_ids)

    def commit(self, forward: Forward) -> None:
        """Keep the cache the step produced."""
        self._batch = forward.batch

    def history(self, seq: ShardSequence) -> Sequence[int]:
        """Prompt and generated ids: the repetition penalty sees both."""
        return seq.token_ids

    def run(self, work: Sequence[WorkItem], live: Collection[int]) -> Forward:
        """Compute every item of ``work``: one forward, or two when padding would cost more
        than it saves (see ``_groups``)."""
        parts = [self._run_group(group) for group in self._groups(work)]
        return combine(parts, self._batch, live)

    def _groups(self, work: Sequence[WorkItem]) -> list[list[WorkItem]]:
        """All items in one forward, unless padding the decode rows to the longest prompt
        chunk would more than double the tokens computed: then decode rows and prompt
        chunks run as two forwards."""
        items = in_batch_order(work, self._batch)
        decode = [item for item in items if item.num_tokens == 1]
        chunks = [item for item in items if item.num_tokens > 1]
        total = sum(item.num_tokens for item in items)
        padded = len(items) * max(item.num_tokens for item in items)
        if not decode or not chunks or padded <= MAX_PADDING_RATIO * total:
            return [items]
        return [decode, chunks]

    def _run_group(self, items: Sequence[WorkItem]) -> Part:
        """One forward over ``items``."""
        rows = tuple(item.seq.request_id for item in items)
        cached = self._cached_rows(items)
        layout = _Layout.build(items, cached, self.device)
        logits, cache = self._forward(layout, cached)
        keys, values = cache_tensors(cache)
        column = {c: i for i, c in enumerate(layout.keep)}
        samples = [(r, item) for r, item in enumerate(items) if item.samples]
        sample_logits = None
        if samples:
            row_index = torch.tensor([r for r, _ in samples], device=self.device)
            col_index = torch.tensor(
                [column[item.num_tokens - 1] for _, item in samples], device=self.device
            )
            sample_logits = logits[row_index, col_index].float()
        return Part(
            sample_items=tuple(item for _, item in samples),
            logits=sample_logits,
            batch=KVBatch(rows, keys, values, layout.attention_mask, layout.packed),
            input_details=self._input_details(items, logits, column),
        )

    def _cached_rows(self, items: Sequence[WorkItem]) -> KVBatch:
        """The cache rows of ``items``, packed; a sequence starting its prompt gets an
        empty row even if a stale row had its id (ids below -1 match no row)."""
        wanted = [item.seq.request_id if item.start > 0 else -2 - i for i, item in enumerate(items)]
        return select(self._batch, wanted)

    def _forward(self, layout: _Layout, cached: KVBatch) -> tuple[torch.Tensor, Any]:
        kwargs: dict[str, Any] = {
            **self._inputs(layout),
            "attention_mask": layout.attention_mask,
            "past_key_values": cached.cache(),
            "use_cache": True,
        }
        if self._takes_positions:
            kwargs["position_ids"] = layout.positions
        keep = torch.tensor(layout.keep, dtype=torch.long, device=self.device)
        if self._takes_logits_to_keep:
            kwargs["logits_to_keep"] = keep
        out = self.model(**kwargs)
        logits = out.logits if self._takes_logits_to_keep else out.logits[:, keep]
        return logits, out.past_key_values

    def _inputs(self, layout: _Layout) -> dict[str, torch.Tensor]:
        """``input_ids``, or ``inputs_embeds`` with the prefix rows in place of their
        placeholders when a prompt-tuning prefix has positions in this step."""
        if not layout.prefix_rows:
            return {"input_ids": layout.input_ids}
        embeds = self.model.get_input_embeddings()(layout.input_ids)
        for row, rows in layout.prefix_rows:
            embeds[row, : rows.shape[0]] = rows.to(embeds.dtype)
        return {"inputs_embeds": embeds}

    def _input_details(
        self, items: Sequence[WorkItem], logits: torch.Tensor, column: dict[int, int]
    ) -> dict[int, list[TokenDetail]]:
        """Prompt-token details of this step's positions, for the sequences that asked."""
        result: dict[int, list[TokenDetail]] = {}
        for r, item in enumerate(items):
            seq = item.seq
            if not item.prompt_details:
                continue
            details = [first_input_detail(seq.token_ids[0], seq.details)] if item.start == 0 else []
            count = _detail_count(item)
            if count:
                cols = torch.tensor([column[c] for c in range(count)], device=self.device)
                first = item.start + 1  # position p's logits score token p + 1
                targets = torch.tensor(
                    seq.token_ids[first : first + count], dtype=torch.long, device=self.device
                )
                details += token_details(logits[r, cols].float(), targets, [seq.details] * count)
            result[seq.request_id] = details
        return result
