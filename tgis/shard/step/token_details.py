"""Logprobs, ranks and top-n alternatives of chosen tokens (TGIS's ``get_token_info``).

For a row of scores and the token at that row:

* logprob: ``log_softmax(scores)`` at the token;
* rank: ``1 + `` the number of ids whose score is strictly greater than the token's;
* top-n: with ``n = min(top_n, vocab)`` and ``t`` the n-th highest score (the dtype minimum
  if that is ``-inf``), every id scoring ``>= t`` in ascending id order, capped at ``4n``;
  sorted by logprob (descending, lower id first on ties) when logprobs are asked for,
  otherwise left in id order with logprob 0.

Generated tokens use the processed scores of the sampler; prompt tokens use the raw logits
of the previous position, and the first prompt position gets logprob NaN and rank 0.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tgis.shard_api.messages import DetailOptions, TokenDetail, TopToken


def first_input_detail(token_id: int, options: DetailOptions) -> TokenDetail:
    """The detail of prompt position 0, which no logits predict."""
    return TokenDetail(token_id=token_id, logprob=float("nan") if options.logprobs else 0.0)


def token_details(
    scores: torch.Tensor,
    token_ids: torch.Tensor,
    options: Sequence[DetailOptions | None],
) -> list[TokenDetail]:
    """One TokenDetail per row of ``scores`` [rows, vocab] for ``token_ids`` [rows].

    Rows whose options are None (or ask for nothing) get the bare token id. Only the
    quantities some row asks for are computed, in bulk.
    """
    ids = token_ids.tolist()
    wanted = [
        i for i, o in enumerate(options) if o is not None and (o.logprobs or o.ranks or o.top_n > 0)
    ]
    details = [TokenDetail(token_id=t) for t in ids]
    if not wanted:
        return details
    opts = [options[i] for i in wanted]
    rows = torch.tensor(wanted, dtype=torch.long, device=scores.device)
    sub = scores[rows]
    chosen = token_ids[rows][:, None]
    logprobs = None
    if any(o.logprobs or o.top_n > 0 for o in opts if o is not None):
        logprobs = torch.log_softmax(sub, dim=-1)
    chosen_logprobs = logprobs.gather(1, chosen)[:, 0].tolist() if logprobs is not None else None
    ranks = None
    if any(o.ranks for o in opts if o is not None):
        ranks = (1 + (sub > sub.gather(1, chosen)).sum(dim=-1)).tolist()
    tops = top_tokens(sub, logprobs, opts)
    for j, (i, o) in enumerate(zip(wanted, opts, strict=True)):
        assert o is not None
        details[i] = TokenDetail(
            token_id=ids[i],
            logprob=chosen_logprobs[j] if o.logprobs and chosen_logprobs is not None else 0.0,
            rank=int(ranks[j]) if o.ranks and ranks is not None else 0,
            top_tokens=tops[j],
        )
    return details


def top_tokens(
    scores: torch.Tensor,
    logprobs: torch.Tensor | None,
    options: Sequence[DetailOptions | None],
) -> list[tuple[TopToken, ...]]:
    """The top-n alternatives of each row of ``scores`` (empty for rows with top_n 0)."""
    vocab = scores.shape[-1]
    ns = [min(o.top_n, vocab) if o is not None else 0 for o in options]
    result: list[tuple[TopToken, ...]] = [() for _ in ns]
    max_n = max(ns, default=0)
    if max_n == 0:
        return result
    values = torch.topk(scores, max_n, dim=-1).values
    index = torch.tensor([max(n - 1, 0) for n in ns], device=scores.device)[:, None]
    threshold = values.gather(1, index)
    threshold = threshold.masked_fill(threshold == float("-inf"), torch.finfo(scores.dtype).min)
    disabled = torch.tensor([n == 0 for n in ns], device=scores.device)[:, None]
    threshold = threshold.masked_fill(disabled, float("inf"))
    hits = (scores >= threshold).nonzero()
    hit_logprobs = (
        logprobs[hits[:, 0], hits[:, 1]].tolist() if logprobs is not None else [0.0] * len(hits)
    )
    per_row: list[list[tuple[int, float]]] = [[] for _ in ns]
    for (row, token_id), logprob in zip(hits.tolist(), hit_logprobs, strict=True):
        if len(per_row[row]) < 4 * ns[row]:
            per_row[row].append((token_id, logprob))
    for row, entries in enumerate(per_row):
        option = options[row]
        if not entries or option is None:
            continue
        if option.logprobs:
            entries.sort(key=lambda e: (-e[1], e[0]))
            result[row] = tuple(TopToken(t, lp) for t, lp in entries)
        else:
            result[row] = tuple(TopToken(t, 0.0) for t, _ in entries)
    return result
