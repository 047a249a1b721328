"""Exceptions that carry a meaning across the shard's layers."""

from __future__ import annotations


class StartupError(Exception):
    """The shard cannot start: bad option, unsupported model, missing weights (one line)."""


class InvalidStepError(ValueError):
    """The router sent a Step the shard cannot apply (unknown id, bad block table, ...).

    Raised before any state changes, so the shard's state is as before the Step. The
    servicer turns it into ``INVALID_ARGUMENT``.
    """
