"""What both engines do with a forward pass's logits: sample, then commit the step.

`sample_tokens` turns the logits of the sequences whose prompt is complete into one token
each (rows with NaN logits, or whose grammar cannot go on, fail on their own);
`start_masks` queues the guided-decoding masks of those rows before the forward pass, so that
they are filled while it runs; `commit_step` applies a successful step to the sequences'
state. Shared by the native `ModelRunner` and the transformers `HfRunner`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from collections.abc import Sequence as SequenceOf

import torch

from tgis.shard.step.guided import Grammars, PendingMasks, TokenMasks
from tgis.shard.step.plan import ResolvedStep, WorkItem
from tgis.shard.step.sampling import NEG_INF, SamplingBatch, SamplingRow, argmax_rows, sample
from tgis.shard.step.sequence import Sequence
from tgis.shard.step.token_details import token_details
from tgis.shard_api.messages import InputTokenDetails, SequenceError, ShardInfo, TokenDetail


def start_masks(
    items: SequenceOf[WorkItem], grammars: Grammars, device: torch.device
) -> PendingMasks | None:
    """Queue the guided-decoding masks of the sampling rows ``items`` (None: no row has a
    grammar); call before the forward pass, pass to ``sample_tokens`` after it."""
    guides = [item.seq.guide for item in items]
    if all(g is None for g in guides):
        return None
    return grammars.start_masks(guides, device)


def sample_tokens(
    logits: torch.Tensor,
    items: SequenceOf[WorkItem],
    info: ShardInfo,
    history: Callable[[Sequence], SequenceOf[int]],
    masks: PendingMasks | None = None,
) -> tuple[dict[int, TokenDetail], list[SequenceError]]:
    """One token (with its requested details) per row of ``logits`` / item of ``items``.

    ``history`` gives the ids the repetition penalty considers for a sequence. A row whose
    logits hold a NaN fails on its own (its choice is NaN: the argmax of a row with a NaN
    is the NaN, and its softmax is NaN throughout); so does a row whose grammar cannot go
    on (``masks``: from ``start_masks``).
    """
    items = list(items)
    token_masks = masks.result() if masks is not None else None
    if all(item.seq.plain_greedy for item in items):
        return _plain_greedy_tokens(logits, items, info, token_masks)
    eos_only = token_masks.eos_only if token_masks is not None else (False,) * len(items)
    rows = [
        SamplingRow(
            params=item.seq.sampling,
            token_ids=history(item.seq) if item.seq.sampling.needs_history else (),
            num_generated=item.seq.num_generated,
            seed=item.seq.seed,
            eos_forced=forced,
        )
        for item, forced in zip(items, eos_only, strict=True)
    ]
    batch = SamplingBatch(rows, info.eos_token_ids, info.vocab_size, logits.device, token_masks)
    tokens, scores = sample(logits, batch)
    nan = nan_choices(logits, scores, tokens, batch)
    errors: list[SequenceError] = []
    if bool(nan.any()):
        bad = nan.tolist()
        errors = [
            SequenceError(item.seq.request_id, "the model produced NaN logits")
            for item, b in zip(items, bad, strict=True)
            if b
        ]
    errors += _mask_errors(items, token_masks, {e.request_id for e in errors})
    wanted = [item.seq.details if item.seq.details.generated_tokens else None for item in items]
    details = token_details(scores, tokens, wanted)
    failed = {e.request_id for e in errors}
    sampled = {
        item.seq.request_id: d
        for item, d in zip(items, details, strict=True)
        if item.seq.request_id not in failed
    }
    return sampled, errors


def nan_choices(
    logits: torch.Tensor, scores: torch.Tensor, tokens: torch.Tensor, batch: SamplingBatch
) -> torch.Tensor:
    """Which rows' choice ``tokens`` (from ``sample``) comes from NaN logits: the chosen
    score is NaN (a row's argmax or softmax with a NaN is NaN), or the row samples and
    holds a NaN anywhere (its draw can land on a finite score)."""
    nan = torch.isnan(scores.gather(1, tokens[:, None])[:, 0])
    if batch.warpers is not None:
        nan[batch.warpers.sample_rows] |= torch.isnan(logits[batch.warpers.sample_rows]).any(-1)
    return nan


def _mask_errors(
    items: SequenceOf[WorkItem], masks: TokenMasks | None, failed: set[int]
) -> list[SequenceError]:
    """The rows whose grammar cannot go on (and that did not fail otherwise): their
    constraint failed, not the engine."""
    if masks is None or not masks.errors:
        return []
    return [
        SequenceError(items[row].seq.request_id, message, constraint=True)
        for row, message in sorted(masks.errors.items())
        if items[row].seq.request_id not in failed
    ]


def _plain_greedy_tokens(
    logits: torch.Tensor, items: list[WorkItem], info: ShardInfo, masks: TokenMasks | None
) -> tuple[dict[int, TokenDetail], list[SequenceError]]:
    """``sample_tokens`` for greedy rows without penalties: the argmax, EOS masked while a
    row is short of its min_new_tokens (unless its grammar allows only EOS), then what the
    grammars forbid."""
    eos_only = masks.eos_only if masks is not None else (False,) * len(items)
    short = [
        i
        for i, item in enumerate(items)
        if item.seq.num_generated < item.seq.sampling.min_new_tokens and not eos_only[i]
    ]
    eos = [t for t in info.eos_token_ids if 0 <= t < info.vocab_size]
    eos_masked = bool(short and eos)
    scores = logits.clone() if eos_masked or masks is not None else logits
    if eos_masked:
        rows = torch.tensor(short, dtype=torch.long, device=logits.device)
        ids = torch.tensor(eos, dtype=torch.long, device=logits.device)
        scores[rows[:, None], ids[None, :]] = NEG_INF
    if masks is not None:
        masks.apply_(scores)
    tokens = argmax_rows(scores)
    nan = torch.isnan(scores.gather(1, tokens[:, None].to(scores.device))[:, 0])
    bad = nan.tolist() if bool(nan.any()) else None
    wanted = [item.seq.details if item.seq.details.generated_tokens else None for item in items]
    details = token_details(scores, tokens, wanted)
    errors = [
        SequenceError(item.seq.request_id, "the model produced NaN logits")
        for i, item in enumerate(items)
        if bad is not None and bad[i]
    ]
    errors += _mask_errors(items, masks, {e.request_id for e in errors})
    failed = {e.request_id for e in errors}
    sampled = {
        item.seq.request_id: detail
        for item, detail in zip(items, details, strict=True)
        if item.seq.request_id not in failed
    }
    return sampled, errors


def commit_step(
    sequences: dict[int, Sequence],
    resolved: ResolvedStep,
    sampled: dict[int, TokenDetail],
    input_details: dict[int, list[TokenDetail]],
    errors: SequenceOf[SequenceError] = (),
    accepted: Mapping[int, SequenceOf[TokenDetail]] | None = None,
) -> tuple[InputTokenDetails, ...]:
    """Register new sequences, advance the scheduled ones, forget the failed ones; return the
    input-token details of every prompt this step completed. ``accepted``: the tokens after
    the sampled one that a drafted sequence's step confirmed; its drafts after them are
    not computed (their KV entries are overwritten later)."""
    accepted = accepted or {}
    for seq in resolved.new:
        sequences[seq.request_id] = seq
    completed: list[InputTokenDetails] = []
    failed = {e.request_id for e in errors}
    for item in resolved.work:
        seq = item.seq
        seq.block_table[item.prior_blocks :] = item.new_block_ids
        seq.input_details.extend(input_details.get(seq.request_id, ()))
        seq.num_computed = item.end
        detail = sampled.get(seq.request_id)
        if detail is not None:
            seq.token_ids.append(detail.token_id)
            if seq.guide is not None:
                seq.guide.consume(detail.token_id)
        if item.drafts:
            more = accepted.get(seq.request_id, ())
            seq.token_ids.extend(d.token_id for d in more)
            seq.num_computed = item.end - len(item.drafts) + len(more)
        if item.completes_prompt and item.prompt_details and seq.request_id not in failed:
            completed.append(InputTokenDetails(seq.request_id, tuple(seq.input_details)))
            seq.input_details = []
    for rid in failed:
        sequences.pop(rid, None)
    return tuple(completed)
