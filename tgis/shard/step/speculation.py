"""Verifying drafted tokens (speculative decoding): one forward pass computes a sequence's
last known token and ``k`` drafted tokens after it; this module samples each of those
``1 + k`` positions exactly as plain decoding would sample it and keeps the run the drafts
confirm.

Position ``j`` (0 for the last known token, ``j`` for draft ``j``) is sampled as the
sequence's ``g + j``-th token (``g``: tokens generated so far) with the history plain
decoding would have by then, the prompt, the generated tokens and the first ``j`` drafts:
min_new_tokens, the length and repetition penalties, the warpers and the counter-based
random number (``sampling.uniform_draws`` keyed by ``g + j``) are those of that token. So
token ``j`` is the token plain decoding samples there, provided drafts ``1..j`` are the
tokens it sampled before; the output is the first token, then token ``j`` for as long as
draft ``j`` equals token ``j - 1``. Greedy and seeded sequences therefore produce exactly
the tokens they produce without drafts, and unseeded ones keep the same distribution.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf

import torch

from tgis.shard.step.plan import WorkItem
from tgis.shard.step.results import nan_choices
from tgis.shard.step.sampling import SamplingBatch, SamplingRow, sample
from tgis.shard.step.token_details import token_details
from tgis.shard_api.messages import SequenceError, ShardInfo, TokenDetail

__all__ = ["Verified", "accepted_run", "verify_drafts"]

Verified = tuple[dict[int, list[TokenDetail]], list[SequenceError]]
"""Per drafted sequence the tokens it gets (1 to k + 1, in order), and the sequences that
failed on their own."""


def verification_rows(items: SequenceOf[WorkItem]) -> list[SamplingRow]:
    """The ``1 + k`` sampling rows of each drafted item, in order."""
    rows: list[SamplingRow] = []
    for item in items:
        seq = item.seq
        params = seq.sampling
        penalised = params.needs_history
        for j in range(len(item.drafts) + 1):
            history = seq.token_ids + list(item.drafts[:j]) if penalised else ()
            rows.append(SamplingRow(params, history, seq.num_generated + j, seq.seed))
    return rows


def accepted_run(tokens: SequenceOf[int], drafts: SequenceOf[int]) -> int:
    """How many of ``tokens`` (one per position, ``len(drafts) + 1``) are kept: the first,
    then each next one while the draft before it equals the token sampled before it."""
    kept = 1
    while kept <= len(drafts) and tokens[kept - 1] == drafts[kept - 1]:
        kept += 1
    return kept


def verify_drafts(logits: torch.Tensor, items: SequenceOf[WorkItem], info: ShardInfo) -> Verified:
    """Sample the ``1 + k`` rows of ``logits`` of each of ``items`` (in order) and keep the
    confirmed run of each; a sequence with a NaN in a kept row fails alone."""
    rows = verification_rows(items)
    batch = SamplingBatch(rows, info.eos_token_ids, info.vocab_size, logits.device)
    tokens, scores = sample(logits, batch)
    nan = nan_choices(logits, scores, tokens, batch)
    wanted = [
        item.seq.details if item.seq.details.generated_tokens else None
        for item in items
        for _ in range(len(item.drafts) + 1)
    ]
    details = token_details(scores, tokens, wanted)
    token_ids, bad = tokens.tolist(), nan.tolist()
    result: dict[int, list[TokenDetail]] = {}
    errors: list[SequenceError] = []
    first = 0
    for item in items:
        count = len(item.drafts) + 1
        kept = accepted_run(token_ids[first : first + count], item.drafts)
        rid = item.seq.request_id
        if any(bad[first : first + kept]):
            errors.append(SequenceError(rid, "the model produced NaN logits"))
        else:
            result[rid] = details[first : first + kept]
        first += count
    return result, errors
