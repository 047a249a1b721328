"""The concurrency limiter: all-or-nothing permits, and a release that cannot corrupt them."""

from __future__ import annotations

import pytest

from tgis.router.intake.concurrency import ConcurrencyLimiter


def test_permits_are_all_or_nothing_up_to_the_limit() -> None:
    limiter = ConcurrencyLimiter(4)
    assert limiter.try_acquire(3)
    assert not limiter.try_acquire(2)  # only one left: nothing taken
    assert limiter.in_use == 3
    assert limiter.try_acquire(1)
    assert not limiter.try_acquire(1)
    limiter.release(4)
    assert limiter.try_acquire(4)


def test_an_excess_release_is_refused_and_changes_nothing() -> None:
    """A double release is a bug elsewhere; it must not leave a negative count, which
    would let more requests in than the limit for the rest of the server's life."""
    limiter = ConcurrencyLimiter(2)
    assert limiter.try_acquire(1)
    with pytest.raises(RuntimeError, match="more concurrency permits released"):
        limiter.release(2)
    assert limiter.in_use == 1
    assert limiter.try_acquire(1)
    assert not limiter.try_acquire(1)  # still exactly the limit
