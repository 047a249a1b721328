"""Prompt-lookup drafts for speculative decoding (HF TGI's ``--speculate`` n-gram mode,
vLLM's ``ngram`` method): the tokens that followed the latest earlier occurrence of the
sequence's last ``n`` tokens, trying ``n`` from ``max_n`` down to ``min_n``.

Text that copies from its context (code edits, extraction, summaries quoting the source)
repeats n-grams of the prompt and of itself, so what followed them last time is a good
guess. :class:`NgramIndex` keeps, for every n-gram of the sequence that has a token after
it, where that token is (the latest occurrence wins), so adding a token costs
``max_n - min_n + 1`` dictionary writes and a proposal as many reads, whatever the
sequence's length.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["NgramIndex"]


class NgramIndex:
    """The n-grams (``min_n`` to ``max_n`` tokens) of a growing token sequence."""

    def __init__(self, min_n: int, max_n: int, tokens: Iterable[int] = ()) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min ({min_n}) <= max ({max_n})")
        self.min_n = min_n
        self.max_n = max_n
        self.tokens: list[int] = []
        self._after: dict[tuple[int, ...], int] = {}
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        """Append ``tokens``: each n-gram ending just before a new token now has it after."""
        seq, after = self.tokens, self._after
        for token in tokens:
            end = len(seq)
            for n in range(self.min_n, min(self.max_n, end) + 1):
                after[tuple(seq[end - n : end])] = end
            seq.append(token)

    def propose(self, count: int) -> list[int]:
        """Up to ``count`` tokens that followed the latest earlier occurrence of the longest
        matching suffix (none: no suffix of ``min_n`` or more tokens occurred before)."""
        seq = self.tokens
        if count < 1:
            return []
        for n in range(min(self.max_n, len(seq)), self.min_n - 1, -1):
            start = self._after.get(tuple(seq[len(seq) - n :]))
            if start is not None:
                return seq[start : start + count]
        return []
