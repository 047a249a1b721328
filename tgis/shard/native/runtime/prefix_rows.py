"""Prompt-tuning prefixes in the native engine: where a sequence's virtual tokens go in a
step.

A sequence with a prefix of ``P`` virtual tokens has ``P`` placeholder ids (the model's pad
id) before its input ids, so every count (computed tokens, blocks, positions, preemption
and recompute) treats the virtual tokens as prompt tokens. Only the embeddings differ: for
the rows of a step at positions below ``P``, ``embedding_rows`` gathers the prefix's rows
(``Sequence.prefix``, from ``adapters/prefixes.py``), which the model puts in place of the
placeholders' embeddings (``EmbeddingRows``). The input-token details of those positions
score the placeholder, as TGIS reports the pad token's logprobs there.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf
from typing import TYPE_CHECKING

import torch

from tgis.shard.native.models.decoder import EmbeddingRows

if TYPE_CHECKING:
    from tgis.shard.step.plan import WorkItem


def embedding_rows(work: SequenceOf[WorkItem], query_starts: list[int]) -> EmbeddingRows | None:
    """The prefix rows of a step, or None when no scheduled position is a virtual token.

    ``query_starts[i]`` is the first row of ``work[i]`` in the flattened batch.
    """
    index: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    for item, row in zip(work, query_starts, strict=True):
        prefix = item.seq.prefix
        if prefix is None or item.start >= prefix.shape[0]:
            continue
        stop = min(item.end, prefix.shape[0])
        index.append(torch.arange(row, row + stop - item.start, device=prefix.device))
        values.append(prefix[item.start : stop])
    if not index:
        return None
    return EmbeddingRows(index=torch.cat(index), values=torch.cat(values))
