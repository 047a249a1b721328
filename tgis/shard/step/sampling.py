"""Choose the next token of every row of a batch, with per-row parameters, in bulk.

The logits of each row go through, in this order (TGIS's ``HeterogeneousNextTokenChooser``):

1. min_new_tokens: every EOS id gets ``-inf`` while the row has generated fewer tokens
   (unless the row's grammar allows nothing but EOS: then EOS wins).
2. length penalty (rows past their min phase): EOS score ``s`` → ``s + |s| * (decay ** k - 1)``
   with ``k = generated - start_index`` when ``k > 0``.
3. repetition penalty over the prompt and generated ids: ``x * p`` if ``x < 0`` else ``x / p``;
   then OpenAI's presence and frequency penalties over the generated ids and its logit
   bias (``logit_adjustments.py``).
4. guided decoding: every token the row's grammar forbids gets ``-inf`` (``guided.py``).
5. only if some row samples: temperature, vLLM's min-p, top-k, top-p, typical-p (greedy
   rows untouched).
6. greedy rows take the argmax (lowest id on ties); sampled rows draw from the softmax by
   inverting its cumulative distribution at one uniform number.

The random numbers are counter-based: a row's uniform number is a fixed function of the
sequence's seed and the number of tokens it has generated (an integer hash,
``uniform_draws``). So a seeded sequence draws the same tokens alone, in any batch and
after a preemption, needs no generator object, and a draw costs one pass over the
vocabulary (an exponential race needed a hashed number per vocabulary entry: 30-50 ms for
32 rows of a 128k vocabulary on a CPU core). A batch with only plain greedy rows (no
processing at all) is ``SamplingBatch.plain`` and takes the argmax directly.

The processed scores are returned too: token details (logprobs, ranks, top-n) are computed
from them. Building the parameter tensors loops over rows; the processing does not.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tgis.shard.step.guided import TokenMasks
from tgis.shard.step.logit_adjustments import LogitAdjustments, min_p_column, min_p_filter
from tgis.shard.step.random_draws import stream_key, uniform_draws
from tgis.shard_api.messages import SamplingParams

NEG_INF = float("-inf")


@dataclass(frozen=True)
class SamplingRow:
    """One row's inputs: its parameters, seed and the ids it has seen so far."""

    params: SamplingParams
    token_ids: Sequence[int]  # prompt + generated so far
    num_generated: int
    seed: int = 0  # the sequence's random stream (sampled rows)
    eos_forced: bool = False  # its grammar allows only EOS: min_new_tokens does not mask it


@dataclass(frozen=True)
class _Penalties:
    rows: torch.Tensor  # [R] rows with a repetition penalty
    ids: torch.Tensor  # [R, L] ids seen by those rows (padded by repeating an id)
    penalty: torch.Tensor  # [R, 1]


@dataclass(frozen=True)
class _Warpers:
    sample_rows: torch.Tensor  # [S] rows that sample
    stream_keys: torch.Tensor  # [S] int64: each sampled row's (seed, step) key
    temperature: torch.Tensor | None  # [B, 1], 1.0 for rows that do not scale
    min_p: torch.Tensor | None  # [B, 1], 0.0 = disabled
    top_k: tuple[int, ...] | None  # per row, 0 = disabled
    top_p: torch.Tensor | None  # [B, 1], 1.0 = disabled
    typical_p: torch.Tensor | None  # [B, 1], 1.0 = disabled


class SamplingBatch:
    """The per-row parameters of one step as tensors on the logits' device."""

    def __init__(
        self,
        rows: Sequence[SamplingRow],
        eos_token_ids: Sequence[int],
        vocab_size: int,
        device: torch.device,
        masks: TokenMasks | None = None,
    ) -> None:
        self.size = len(rows)
        self.masks = masks
        self.vocab_size = vocab_size
        eos = [i for i in eos_token_ids if 0 <= i < vocab_size]
        self.eos_ids = torch.tensor(eos, dtype=torch.long, device=device) if eos else None
        self.min_tokens_mask = self._min_tokens_mask(rows, device)
        self.eos_boost = self._eos_boost(rows, device)
        self.penalties = self._penalties(rows, device)
        self.adjustments = LogitAdjustments.build(rows, device)
        self.warpers = self._warpers(rows, device)
        self.plain = (
            self.warpers is None
            and self.penalties is None
            and self.adjustments is None
            and self.eos_boost is None
            and (self.min_tokens_mask is None or self.eos_ids is None)
            and masks is None
        )
        """Greedy rows only, nothing to process: the scores are the logits."""

    @staticmethod
    def _min_tokens_mask(rows: Sequence[SamplingRow], device: torch.device) -> torch.Tensor | None:
        mask = [r.num_generated < r.params.min_new_tokens and not r.eos_forced for r in rows]
        return torch.tensor(mask, device=device)[:, None] if any(mask) else None

    @staticmethod
    def _eos_boost(rows: Sequence[SamplingRow], device: torch.device) -> torch.Tensor | None:
        boost = []
        for r in rows:
            lp = r.params.length_penalty
            past = r.num_generated - lp.start_index if lp is not None else 0
            if lp is None or r.num_generated < r.params.min_new_tokens or past <= 0:
                boost.append(0.0)
            else:
                boost.append(lp.decay_factor**past - 1.0)
        if not any(boost):
            return None
        return torch.tensor(boost, dtype=torch.float32, device=device)[:, None]

    @staticmethod
    def _penalties(rows: Sequence[SamplingRow], device: torch.device) -> _Penalties | None:
        chosen = [
            i for i, r in enumerate(rows) if r.params.repetition_penalty != 1.0 and r.token_ids
        ]
        if not chosen:
            return None
        width = max(len(rows[i].token_ids) for i in chosen)
        ids = [
            list(rows[i].token_ids) + [rows[i].token_ids[0]] * (width - len(rows[i].token_ids))
            for i in chosen
        ]
        return _Penalties(
            rows=torch.tensor(chosen, dtype=torch.long, device=device),
            ids=torch.tensor(ids, dtype=torch.long, device=device),
            penalty=torch.tensor(
                [rows[i].params.repetition_penalty for i in chosen], device=device
            )[:, None],
        )

    @staticmethod
    def _warpers(rows: Sequence[SamplingRow], device: torch.device) -> _Warpers | None:
        sampled = [i for i, r in enumerate(rows) if not r.params.is_greedy]
        if not sampled:
            return None
        keys = [stream_key(rows[i].seed, rows[i].num_generated) for i in sampled]
        # Greedy rows get the neutral value of every warper, so their scores are unchanged.
        params = [r.params if not r.params.is_greedy else SamplingParams() for r in rows]
        temperature = [p.temperature if p.temperature > 0 else 1.0 for p in params]
        top_k = tuple(p.top_k for p in params)
        top_p = [p.top_p if 0 < p.top_p < 1 else 1.0 for p in params]
        typical_p = [p.typical_p if p.typical_p_active else 1.0 for p in params]

        def column(values: list[float]) -> torch.Tensor | None:
            if all(v == 1.0 for v in values):
                return None
            return torch.tensor(values, dtype=torch.float32, device=device)[:, None]

        return _Warpers(
            sample_rows=torch.tensor(sampled, dtype=torch.long, device=device),
            stream_keys=torch.tensor(keys, dtype=torch.long, device=device),
            temperature=column(temperature),
            min_p=min_p_column(rows, device),
            top_k=top_k if any(top_k) else None,
            top_p=column(top_p),
            typical_p=column(typical_p),
        )


def process_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Steps 1-5 on float32 ``logits`` [rows, vocab]; returns new scores (input untouched)."""
    scores = logits.float().clone()
    if batch.eos_ids is not None:
        _eos_rules(scores, batch.eos_ids, batch)
    if batch.penalties is not None:
        pen = batch.penalties
        sub = scores[pen.rows]
        seen = sub.gather(1, pen.ids)
        seen = torch.where(seen < 0, seen * pen.penalty, seen / pen.penalty)
        scores[pen.rows] = sub.scatter(1, pen.ids, seen)
    if batch.adjustments is not None:
        batch.adjustments.apply_(scores)
    if batch.masks is not None:
        batch.masks.apply_(scores)
    return scores if batch.warpers is None else _warp(scores, batch.warpers)


def _warp(scores: torch.Tensor, warpers: _Warpers) -> torch.Tensor:
    """Step 5: temperature, min-p, top-k, top-p, typical-p."""
    if warpers.temperature is not None:
        scores = scores / warpers.temperature
    if warpers.min_p is not None:
        scores = min_p_filter(scores, warpers.min_p)
    if warpers.top_k is not None:
        scores = _top_k(scores, warpers.top_k)
    if warpers.top_p is not None:
        scores = _top_p(scores, warpers.top_p)
    if warpers.typical_p is not None:
        scores = _typical_p(scores, warpers.typical_p)
    return scores


def _eos_rules(scores: torch.Tensor, eos_ids: torch.Tensor, batch: SamplingBatch) -> None:
    """Steps 1-2 in place: min_new_tokens' EOS mask, then the length penalty's boost."""
    eos_scores = scores[:, eos_ids]
    if batch.min_tokens_mask is not None:
        eos_scores = eos_scores.masked_fill(batch.min_tokens_mask, NEG_INF)
    if batch.eos_boost is not None:
        boosted = eos_scores + eos_scores.abs() * batch.eos_boost
        eos_scores = torch.where(batch.eos_boost != 0, boosted, eos_scores)
    scores[:, eos_ids] = eos_scores


def _top_k(scores: torch.Tensor, top_k: tuple[int, ...]) -> torch.Tensor:
    vocab = scores.shape[-1]
    max_k = min(max(top_k), vocab)
    k = torch.tensor([min(x, max_k) if x > 0 else max_k for x in top_k], device=scores.device)
    kth = torch.topk(scores, max_k, dim=-1).values.gather(1, (k - 1)[:, None])
    disabled = torch.tensor([x == 0 for x in top_k], device=scores.device)[:, None]
    kth = kth.masked_fill(disabled, NEG_INF)
    return scores.masked_fill(scores < kth, NEG_INF)


# Top-p looks for each row's nucleus among its most likely tokens first, this many, then
# this many, and sorts the whole vocabulary only for rows whose nucleus is wider still: a
# full sort of 32 rows of a 128k vocabulary takes ~150 ms on a CPU core, a top-256 ~3 ms.
_TOP_P_CANDIDATES = (256, 4096)


def _top_p(scores: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep each row's smallest set of most likely tokens whose mass reaches ``top_p``
    (HF's TopPLogitsWarper: a token goes when the mass of the tokens above it is already
    at least ``top_p``; the most likely token always stays); rows with ``top_p`` 1 are
    untouched."""
    rows = (top_p[:, 0] < 1).nonzero()[:, 0]
    if rows.numel() == 0:
        return scores
    vocab = scores.shape[-1]
    sub, mass = scores[rows], top_p[rows]
    probs = sub.softmax(dim=-1)
    remove = torch.ones_like(sub, dtype=torch.bool)
    pending = torch.arange(rows.numel(), device=scores.device)
    counts = [c for c in _TOP_P_CANDIDATES if c < vocab]
    for stage, count in enumerate(counts):
        top, ids = probs[pending].topk(count, dim=-1)  # descending
        above = top.cumsum(dim=-1) - top  # the mass of the tokens ranked above each one
        # The nucleus ends inside these candidates once they hold at least top_p.
        held = top.sum(dim=-1)
        found = held >= mass[pending, 0]
        done = pending[found]
        gone = above[found] >= mass[done]
        gone[:, 0] = False
        remove[done] = remove[done].scatter(1, ids[found], gone)
        if stage + 1 < len(counts):
            # A row the next list cannot cover even if all its extra tokens were as likely
            # as this list's last goes straight to the sort.
            reach = held + (counts[stage + 1] - count) * top[:, -1]
            hopeless = ~found & (reach < mass[pending, 0])
            if hopeless.any():
                remove[pending[hopeless]] = _sorted_top_p_removals(
                    sub[pending[hopeless]], mass[pending[hopeless]]
                )
            found |= hopeless
        pending = pending[~found]
        if pending.numel() == 0:
            break
    if pending.numel():  # a nucleus wider than every candidate list: sort the vocabulary
        remove[pending] = _sorted_top_p_removals(sub[pending], mass[pending])
    scores = scores.clone()
    scores[rows] = sub.masked_fill(remove, NEG_INF)
    return scores


def _sorted_top_p_removals(scores: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The tokens top-p removes, found by sorting each whole row (HF's computation)."""
    sorted_scores, sorted_ids = torch.sort(scores, descending=False, dim=-1)
    cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
    remove = cumulative <= 1 - top_p
    remove[:, -1] = False  # always keep the most likely token
    return remove.scatter(1, sorted_ids, remove)


def _typical_p(scores: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
    normalized = torch.log_softmax(scores, dim=-1)
    entropy = -(normalized * normalized.exp()).nansum(-1, keepdim=True)
    shifted = (-normalized - entropy).abs()
    sorted_shifted, sorted_ids = torch.sort(shifted, descending=False, dim=-1)
    cumulative = scores.gather(-1, sorted_ids).softmax(dim=-1).cumsum(dim=-1)
    last = (cumulative < mass).sum(dim=1).clamp(max=scores.shape[-1] - 1)
    last = last.masked_fill(mass[:, 0] >= 1, scores.shape[-1] - 1)
    remove = sorted_shifted > sorted_shifted.gather(1, last[:, None])
    return scores.masked_fill(remove.scatter(1, sorted_ids, remove), NEG_INF)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` (the first maximum; a row's NaN counts as its maximum), through
    numpy for float CPU tensors, where torch's reduction is ~10x slower (BENCHMARKS.md)."""
    if x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64):
        return torch.from_numpy(x.detach().numpy().argmax(axis=-1))
    return x.argmax(dim=-1)


def choose_tokens(scores: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Step 6: argmax for greedy rows, a seeded draw for sampled rows → ids [rows]."""
    tokens = argmax_rows(scores)
    warpers = batch.warpers
    if warpers is None:
        return tokens
    probs = scores[warpers.sample_rows].softmax(dim=-1)
    drawn = draw_from(probs, uniform_draws(warpers.stream_keys))
    tokens[warpers.sample_rows] = drawn.to(tokens.dtype)
    return tokens


# The inverse-CDF draw sums the vocabulary in blocks of this many tokens, finds the block
# holding the draw, then accumulates only that block.
_DRAW_BLOCK = 1024


def draw_from(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """For each row of ``probs`` [rows, vocab] (non-negative, any total), the first token
    whose cumulative probability exceeds ``uniform`` (float64 in (0, 1), one per row) times
    the row's total: a draw from the row's distribution, in which a token of probability 0
    is never drawn.

    Two levels, so that no [rows, vocab] prefix sum is written: block totals, the block
    where the draw lands, then that block's own prefix sum in float64. A block's total
    and its prefix sum round apart by ~1e-7 of the block's mass, which is all the draw
    misplaces (to the block's last possible token)."""
    rows, vocab = probs.shape
    block = min(_DRAW_BLOCK, vocab)
    full = vocab // block
    # Block totals in the probabilities' own dtype (a float64 sum would first copy the
    # whole [rows, vocab] tensor to float64), accumulated across blocks in float64.
    totals = probs[:, : full * block].view(rows, full, block).sum(dim=-1).double()
    if full * block < vocab:
        tail = probs[:, full * block :].sum(dim=-1, keepdim=True).double()
        totals = torch.cat((totals, tail), dim=1)
    cumulative = totals.cumsum(dim=-1)
    target = uniform[:, None].to(cumulative.dtype) * cumulative[:, -1:]
    chosen = torch.searchsorted(cumulative, target, right=True).clamp(max=totals.shape[1] - 1)
    before = cumulative.gather(1, (chosen - 1).clamp(min=0)).masked_fill(chosen == 0, 0.0)
    ids = chosen * block + torch.arange(block, device=probs.device)
    inside = ids < vocab
    weights = probs.gather(1, ids.clamp(max=vocab - 1)).double().masked_fill(~inside, 0.0)
    within = torch.searchsorted(weights.cumsum(dim=-1), target - before, right=True)
    # Past the block's end by that rounding: the block's last token of positive probability.
    positions = torch.arange(block, device=probs.device).expand_as(weights)
    last_positive = positions.masked_fill(weights <= 0, -1).amax(dim=-1, keepdim=True)
    within = torch.where(within >= block, last_positive, within)
    return (chosen * block + within)[:, 0]


def sample(logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Process ``logits`` and choose one token per row → (token ids, processed scores);
    a plain batch's scores are ``logits`` themselves."""
    if batch.plain:
        return argmax_rows(logits), logits
    scores = process_logits(logits, batch)
    return choose_tokens(scores, batch), scores
