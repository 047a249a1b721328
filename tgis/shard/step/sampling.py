"""Choose the next token of every row of a batch, with per-row parameters, in bulk.

The logits of each row go through, in this order (TGIS's ``HeterogeneousNextTokenChooser``):

1. min_new_tokens: every EOS id gets ``-inf`` while the row has generated fewer tokens.
2. length penalty (rows past their min phase): EOS score ``s`` → ``s + |s| * (decay ** k - 1)``
   with ``k = generated - start_index`` when ``k > 0``.
3. repetition penalty over the prompt and generated ids: ``x * p`` if ``x < 0`` else ``x / p``.
4. only if some row samples: temperature, top-k, top-p, typical-p (greedy rows untouched).
5. greedy rows take the argmax (lowest id on ties); sampled rows draw from the softmax by an
   exponential race, ``argmax(p / E)`` with ``E ~ Exp(1)`` per vocabulary entry.

The random numbers are counter-based: the noise of a row is a fixed function of the
sequence's seed, the number of tokens it has generated and the vocabulary index (an integer
hash, ``exponential_noise``). So a seeded sequence draws the same tokens alone, in any batch
and after a preemption, needs no generator object, and the whole batch's noise is one
vectorised computation. A batch with only plain greedy rows (no processing at all) is
``SamplingBatch.plain`` and takes the argmax directly.

The processed scores are returned too: token details (logprobs, ranks, top-n) are computed
from them. Building the parameter tensors loops over rows; the processing does not.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tgis.shard_api.messages import SamplingParams

NEG_INF = float("-inf")


@dataclass(frozen=True)
class SamplingRow:
    """One row's inputs: its parameters, seed and the ids it has seen so far."""

    params: SamplingParams
    token_ids: Sequence[int]  # prompt + generated so far
    num_generated: int
    seed: int = 0  # the sequence's random stream (sampled rows)


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
    ) -> None:
        self.size = len(rows)
        self.vocab_size = vocab_size
        eos = [i for i in eos_token_ids if 0 <= i < vocab_size]
        self.eos_ids = torch.tensor(eos, dtype=torch.long, device=device) if eos else None
        self.min_tokens_mask = self._min_tokens_mask(rows, device)
        self.eos_boost = self._eos_boost(rows, device)
        self.penalties = self._penalties(rows, device)
        self.warpers = self._warpers(rows, device)
        self.plain = (
            self.warpers is None
            and self.penalties is None
            and self.eos_boost is None
            and (self.min_tokens_mask is None or self.eos_ids is None)
        )
        """Greedy rows only, nothing to process: the scores are the logits."""

    @staticmethod
    def _min_tokens_mask(rows: Sequence[SamplingRow], device: torch.device) -> torch.Tensor | None:
        mask = [r.num_generated < r.params.min_new_tokens for r in rows]
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
            top_k=top_k if any(top_k) else None,
            top_p=column(top_p),
            typical_p=column(typical_p),
        )


def process_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Steps 1-4 on float32 ``logits`` [rows, vocab]; returns new scores (input untouched)."""
    scores = logits.float().clone()
    if batch.eos_ids is not None:
        eos_scores = scores[:, batch.eos_ids]
        if batch.min_tokens_mask is not None:
            eos_scores = eos_scores.masked_fill(batch.min_tokens_mask, NEG_INF)
        if batch.eos_boost is not None:
            boosted = eos_scores + eos_scores.abs() * batch.eos_boost
            eos_scores = torch.where(batch.eos_boost != 0, boosted, eos_scores)
        scores[:, batch.eos_ids] = eos_scores
    if batch.penalties is not None:
        pen = batch.penalties
        sub = scores[pen.rows]
        seen = sub.gather(1, pen.ids)
        seen = torch.where(seen < 0, seen * pen.penalty, seen / pen.penalty)
        scores[pen.rows] = sub.scatter(1, pen.ids, seen)
    warpers = batch.warpers
    if warpers is not None:
        if warpers.temperature is not None:
            scores = scores / warpers.temperature
        if warpers.top_k is not None:
            scores = _top_k(scores, warpers.top_k)
        if warpers.top_p is not None:
            scores = _top_p(scores, warpers.top_p)
        if warpers.typical_p is not None:
            scores = _typical_p(scores, warpers.typical_p)
    return scores


def _top_k(scores: torch.Tensor, top_k: tuple[int, ...]) -> torch.Tensor:
    vocab = scores.shape[-1]
    max_k = min(max(top_k), vocab)
    k = torch.tensor([min(x, max_k) if x > 0 else max_k for x in top_k], device=scores.device)
    kth = torch.topk(scores, max_k, dim=-1).values.gather(1, (k - 1)[:, None])
    disabled = torch.tensor([x == 0 for x in top_k], device=scores.device)[:, None]
    kth = kth.masked_fill(disabled, NEG_INF)
    return scores.masked_fill(scores < kth, NEG_INF)


def _top_p(scores: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    sorted_scores, sorted_ids = torch.sort(scores, descending=False, dim=-1)
    cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
    remove = (cumulative <= 1 - top_p) & (top_p < 1)
    remove[:, -1] = False  # always keep the most likely token
    return scores.masked_fill(remove.scatter(1, sorted_ids, remove), NEG_INF)


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
    """Step 5: argmax for greedy rows, a seeded draw for sampled rows → ids [rows]."""
    tokens = argmax_rows(scores)
    warpers = batch.warpers
    if warpers is None:
        return tokens
    probs = scores[warpers.sample_rows].softmax(dim=-1)
    noise = exponential_noise(warpers.stream_keys, scores.shape[-1])
    tokens[warpers.sample_rows] = argmax_rows(probs / noise)
    return tokens


def sample(logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Process ``logits`` and choose one token per row → (token ids, processed scores);
    a plain batch's scores are ``logits`` themselves."""
    if batch.plain:
        return argmax_rows(logits), logits
    scores = process_logits(logits, batch)
    return choose_tokens(scores, batch), scores


# ---- counter-based random numbers ------------------------------------------------------------
#
# A 32-bit integer hash (xor-shift and multiply rounds). Every product stays below 2**63
# (32-bit values times constants below 2**31), so the same arithmetic is exact in Python
# ints and in int64 tensors on any device.

_MASK = 0xFFFFFFFF
_M1 = 0x7FEB352D
_M2 = 0x2C1B3C6D


def _mix(x: int) -> int:
    x ^= x >> 16
    x = (x * _M1) & _MASK
    x ^= x >> 15
    x = (x * _M2) & _MASK
    return x ^ (x >> 16)


def _mix_tensor(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = (x * _M1) & _MASK
    x = x ^ (x >> 15)
    x = (x * _M2) & _MASK
    return x ^ (x >> 16)


def stream_key(seed: int, step: int) -> int:
    """The 32-bit key of a sequence's ``step``-th draw (``seed``: any non-negative int)."""
    key = _mix(seed & _MASK)
    key = _mix(key ^ ((seed >> 32) & _MASK))
    return _mix(key ^ (step & _MASK))


_VOCAB_HASH: dict[tuple[int, torch.device], torch.Tensor] = {}


def exponential_noise(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """``Exp(1)`` noise [rows, vocab] (float32): a fixed function of each row's key and the
    vocabulary index, on the keys' device."""
    cached = _VOCAB_HASH.get((vocab, keys.device))
    if cached is None:
        index = torch.arange(vocab, dtype=torch.long, device=keys.device)
        cached = _VOCAB_HASH[(vocab, keys.device)] = _mix_tensor(_mix_tensor(index) ^ 0x9E3779B9)
    bits = _mix_tensor(keys[:, None] ^ cached[None, :])
    uniform = ((bits >> 8).float() + 0.5) * (1.0 / (1 << 24))  # in (0, 1)
    return -torch.log(uniform)
