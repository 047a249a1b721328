"""What both engines do with a forward pass's logits: sample, then commit the step.

`sample_tokens` turns the logits of the sequences whose prompt is complete into one token
each (rows with NaN logits fail on their own); `commit_step` applies a successful step to
the sequences' state. Shared by the native `ModelRunner` and the transformers `HfRunner`.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as SequenceOf

import torch

from tgis.shard.step.plan import ResolvedStep, WorkItem
from tgis.shard.step.sampling import NEG_INF, SamplingBatch, SamplingRow, argmax_rows, sample
from tgis.shard.step.sequence import Sequence
from tgis.shard.step.token_details import token_details
from tgis.shard_api.messages import InputTokenDetails, SequenceError, ShardInfo, TokenDetail


def sample_tokens(
    logits: torch.Tensor,
    items: SequenceOf[WorkItem],
    info: ShardInfo,
    history: Callable[[Sequence], SequenceOf[int]],
) -> tuple[dict[int, TokenDetail], list[SequenceError]]:
    """One token (with its requested details) per row of ``logits`` / item of ``items``.

    ``history`` gives the ids the repetition penalty considers for a sequence. A row whose
    logits hold a NaN fails on its own (its choice is NaN: the argmax of a row with a NaN
    is the NaN, and its softmax is NaN throughout).
    """
    items = list(items)
    if all(item.seq.plain_greedy for item in items):
        return _plain_greedy_tokens(logits, items, info)
    rows = [
        SamplingRow(
            params=item.seq.sampling,
            token_ids=history(item.seq) if item.seq.sampling.repetition_penalty != 1.0 else (),
            num_generated=item.seq.num_generated,
            seed=item.seq.seed,
        )
        for item in items
    ]
    batch = SamplingBatch(rows, info.eos_token_ids, info.vocab_size, logits.device)
    tokens, scores = sample(logits, batch)
    nan = torch.isnan(scores.gather(1, tokens[:, None])[:, 0])
    if batch.warpers is not None:  # a sampled row with a NaN can draw a non-NaN score
        nan[batch.warpers.sample_rows] |= torch.isnan(logits[batch.warpers.sample_rows]).any(-1)
    errors: list[SequenceError] = []
    if bool(nan.any()):
        bad = nan.tolist()
        errors = [
            SequenceError(item.seq.request_id, "the model produced NaN logits")
            for item, b in zip(items, bad, strict=True)
            if b
        ]
    wanted = [item.seq.details if item.seq.details.generated_tokens else None for item in items]
    details = token_details(scores, tokens, wanted)
    failed = {e.request_id for e in errors}
    sampled = {
        item.seq.request_id: d
        for item, d in zip(items, details, strict=True)
        if item.seq.request_id not in failed
    }
    return sampled, errors


def _plain_greedy_tokens(
    logits: torch.Tensor, items: list[WorkItem], info: ShardInfo
) -> tuple[dict[int, TokenDetail], list[SequenceError]]:
    """``sample_tokens`` for greedy rows without penalties: the argmax, EOS masked while a
    row is short of its min_new_tokens."""
    short = [
        i
        for i, item in enumerate(items)
        if item.seq.num_generated < item.seq.sampling.min_new_tokens
    ]
    eos = [t for t in info.eos_token_ids if 0 <= t < info.vocab_size]
    scores = logits
    if short and eos:
        scores = logits.clone()
        rows = torch.tensor(short, dtype=torch.long, device=logits.device)
        ids = torch.tensor(eos, dtype=torch.long, device=logits.device)
        scores[rows[:, None], ids[None, :]] = NEG_INF
    tokens = argmax_rows(scores)
    nan = torch.isnan(scores.gather(1, tokens[:, None].to(scores.device))[:, 0])
    bad = nan.tolist() if bool(nan.any()) else None
    wanted = [item.seq.details if item.seq.details.generated_tokens else None for item in items]
    details = token_details(scores, tokens, wanted)
    sampled: dict[int, TokenDetail] = {}
    errors: list[SequenceError] = []
    for i, (item, detail) in enumerate(zip(items, details, strict=True)):
        if bad is not None and bad[i]:
            errors.append(SequenceError(item.seq.request_id, "the model produced NaN logits"))
        else:
            sampled[item.seq.request_id] = detail
    return sampled, errors


def commit_step(
    sequences: dict[int, Sequence],
    resolved: ResolvedStep,
    sampled: dict[int, TokenDetail],
    input_details: dict[int, list[TokenDetail]],
    errors: SequenceOf[SequenceError] = (),
) -> tuple[InputTokenDetails, ...]:
    """Register new sequences, advance the scheduled ones, forget the failed ones; return the
    input-token details of every prompt this step completed."""
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
        if item.completes_prompt and item.prompt_details and seq.request_id not in failed:
            completed.append(InputTokenDetails(seq.request_id, tuple(seq.input_details)))
            seq.input_details = []
    for rid in failed:
        sequences.pop(rid, None)
    return tuple(completed)
