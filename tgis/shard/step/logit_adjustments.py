"""OpenAI's and vLLM's logit adjustments, beside TGIS's own processing (``sampling.py``).

* **presence and frequency penalties** (OpenAI's definition): over the tokens the sequence
  has generated so far (not its prompt), a token's logit loses ``presence_penalty`` once if
  it occurs and ``frequency_penalty`` per occurrence;
* **logit bias**: a fixed value added to given tokens' logits (-100 bans a token, 100 all
  but forces it);
* **min-p** (vLLM's ``min_p``, applied by ``sampling.py`` after the temperature): a sampled
  row keeps the tokens whose probability is at least ``min_p`` times its most likely
  token's.

Each is built only for the rows that ask for it; a batch where none does pays nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from tgis.shard_api.messages import SamplingParams

__all__ = ["LogitAdjustments", "min_p_column", "min_p_filter"]


class SamplingRow(Protocol):
    """What these adjustments read of a row (``sampling.SamplingRow``)."""

    @property
    def params(self) -> SamplingParams: ...
    @property
    def token_ids(self) -> Sequence[int]: ...
    @property
    def num_generated(self) -> int: ...


NEG_INF = float("-inf")


@dataclass(frozen=True)
class _Bias:
    """Values added to single scores: entry n adds ``values[n]`` at (``rows[n]``, ``ids[n]``)."""

    rows: torch.Tensor  # [N]
    ids: torch.Tensor  # [N]
    values: torch.Tensor  # [N]


@dataclass(frozen=True)
class LogitAdjustments:
    """A step's presence/frequency penalties and logit biases, for the rows that have any."""

    penalties: _Bias | None  # minus the penalties: one entry per generated token
    bias: _Bias | None

    @classmethod
    def build(cls, rows: Sequence[SamplingRow], device: torch.device) -> LogitAdjustments | None:
        penalties = _output_penalties(rows, device)
        bias = _bias(rows, device)
        if penalties is None and bias is None:
            return None
        return cls(penalties, bias)

    def apply_(self, scores: torch.Tensor) -> None:
        """Adjust ``scores`` [rows, vocab] in place (entries for the same token add up)."""
        for entries in (self.penalties, self.bias):
            if entries is not None:
                scores.index_put_((entries.rows, entries.ids), entries.values, accumulate=True)


def _output_penalties(rows: Sequence[SamplingRow], device: torch.device) -> _Bias | None:
    """One entry per generated token of each penalised row: minus its frequency penalty,
    and minus the presence penalty too at a token's first occurrence (so the entries of a
    token seen ``c`` times add up to ``-(presence + c * frequency)``). Built on the host,
    where the ids are: no [rows, vocab] tensor of counts."""
    row_ids: list[int] = []
    token_ids: list[int] = []
    values: list[float] = []
    for i, row in enumerate(rows):
        presence, frequency = row.params.presence_penalty, row.params.frequency_penalty
        if not (presence or frequency) or row.num_generated <= 0:
            continue
        seen: set[int] = set()
        for token in row.token_ids[len(row.token_ids) - row.num_generated :]:
            row_ids.append(i)
            token_ids.append(token)
            values.append(-frequency - (presence if token not in seen else 0.0))
            seen.add(token)
    if not row_ids:
        return None
    return _Bias(
        rows=torch.tensor(row_ids, dtype=torch.long, device=device),
        ids=torch.tensor(token_ids, dtype=torch.long, device=device),
        values=torch.tensor(values, dtype=torch.float32, device=device),
    )


def _bias(rows: Sequence[SamplingRow], device: torch.device) -> _Bias | None:
    entries = [(i, t, b) for i, r in enumerate(rows) for t, b in r.params.logit_bias]
    if not entries:
        return None
    row_ids, token_ids, values = zip(*entries, strict=True)
    return _Bias(
        rows=torch.tensor(row_ids, dtype=torch.long, device=device),
        ids=torch.tensor(token_ids, dtype=torch.long, device=device),
        values=torch.tensor(values, dtype=torch.float32, device=device),
    )


def min_p_column(rows: Sequence[SamplingRow], device: torch.device) -> torch.Tensor | None:
    """[B, 1] each sampled row's min_p (0: none), or None when no row has one."""
    values = [
        r.params.min_p if not r.params.is_greedy and 0 < r.params.min_p <= 1 else 0.0 for r in rows
    ]
    if not any(values):
        return None
    return torch.tensor(values, dtype=torch.float32, device=device)[:, None]


def min_p_filter(scores: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Remove each row's tokens less likely than ``min_p`` times its most likely token
    (rows with ``min_p`` 0 keep everything). In logits: ``p / p_max < min_p`` is
    ``s - s_max < log(min_p)``, so no softmax is needed."""
    floor = scores.max(dim=-1, keepdim=True).values + min_p.log()
    return scores.masked_fill(scores < floor, NEG_INF)
