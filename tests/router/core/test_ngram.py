"""The n-gram proposer against a brute-force search of the same rule."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tgis.router.core.ngram import NgramIndex


def brute_force(tokens: list[int], min_n: int, max_n: int, count: int) -> list[int]:
    """The tokens after the latest earlier occurrence (one with a token after it) of the
    longest suffix of ``min_n``..``max_n`` tokens."""
    length = len(tokens)
    for n in range(min(max_n, length), min_n - 1, -1):
        suffix = tokens[length - n :]
        for start in range(length - n - 1, -1, -1):  # the occurrence ends before the last
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + count]
    return []


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 4), max_size=60),
    sizes=st.tuples(st.integers(1, 4), st.integers(0, 3)),
    count=st.integers(0, 6),
    split=st.integers(0, 60),
)
def test_proposals_equal_the_brute_force_search(
    tokens: list[int], sizes: tuple[int, int], count: int, split: int
) -> None:
    """Built at once or grown token by token (as a generated sequence grows), after every
    token."""
    min_n, max_n = sizes[0], sizes[0] + sizes[1]
    index = NgramIndex(min_n, max_n, tokens[:split])
    for i in range(min(split, len(tokens)), len(tokens) + 1):
        assert index.propose(count) == brute_force(tokens[:i], min_n, max_n, count)
        if i < len(tokens):
            index.extend([tokens[i]])
    assert len(index) == len(tokens)


def test_a_copied_span_is_proposed() -> None:
    source = [10, 11, 12, 13, 14, 15, 16]
    index = NgramIndex(1, 3, [1, 2, *source, 3, 4, 10, 11, 12])
    assert index.propose(3) == [13, 14, 15]
    assert index.propose(10) == [13, 14, 15, 16, 3, 4, 10, 11, 12]
    assert NgramIndex(1, 3, [1, 2, 3]).propose(4) == []
