"""Prompt-tuning prefixes in the native engine: where a sequence's virtual tokens come from
and where they go in a step.

A sequence with a prefix of ``P`` virtual tokens has ``P`` placeholder ids (the model's pad
id) before its input ids, so every count (computed tokens, blocks, positions, preemption
and recompute) treats the virtual tokens as prompt tokens. Only the embeddings differ: for
the rows of a step at positions below ``P``, ``embedding_rows`` gathers the prefix's rows,
which the model puts in place of the placeholders' embeddings (``EmbeddingRows``). The
input-token details of those positions score the placeholder, as TGIS reports the pad
token's logprobs there.

``Prefixes`` answers the router's ``PrefixLookup`` and gives each new sequence its tensor,
from the ``PrefixStore`` cache (``PREFIX_STORE_PATH``), or refuses when no store is set
(``NO_PREFIXES``: also the transformers engine's).
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tgis.shard.adapter_store import StoreError
from tgis.shard.models.layers import EmbeddingRows
from tgis.shard.prefix_store import PrefixEmbeddings, PrefixStore, not_found
from tgis.shard_api.messages import NewSequence

if TYPE_CHECKING:
    from tgis.shard.step_plan import WorkItem


class PrefixUnavailable(Exception):
    """A new sequence's prefix cannot be used: that sequence fails alone."""


@dataclass(frozen=True)
class Prefixes:
    """This rank's prompt-tuning prefixes: a store (None: ``PREFIX_STORE_PATH`` unset,
    every id is not found, as TGIS answers) and the id of the placeholder tokens."""

    store: PrefixStore | None
    placeholder_id: int = 0

    def lookup(self, prefix_id: str) -> int:
        """Load ``prefix_id`` (or find it cached) and return its virtual tokens; StoreError
        with TGIS's message otherwise."""
        return self._get(prefix_id).length

    def embeddings(self, ns: NewSequence) -> torch.Tensor:
        """The decoder embeddings [prefix_length, hidden] of ``ns``'s prefix; raises
        PrefixUnavailable when the prefix is missing, malformed, or no longer as long as
        the router counted."""
        try:
            prefix = self._get(ns.prefix_id)
        except StoreError as e:
            raise PrefixUnavailable(
                f"Error retrieving prompt prefix '{ns.prefix_id}': {e.tgis_message}"
            ) from None
        if prefix.decoder is None or prefix.length != ns.prefix_length:
            raise PrefixUnavailable(
                f"prompt prefix '{ns.prefix_id}' has {prefix.length} virtual tokens but the "
                f"router counted {ns.prefix_length} (it changed in the store after the "
                "router looked it up; the router keeps a length for up to an hour)"
            )
        return prefix.decoder

    def _get(self, prefix_id: str) -> PrefixEmbeddings:
        if self.store is None:
            raise not_found(prefix_id)
        return self.store.get(prefix_id)


NO_PREFIXES = Prefixes(store=None)
"""An engine without a prefix store: every prefix id is not found."""


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
