"""Counter-based random numbers for sampling (``sampling.py``): a sampled row's uniform
number is a fixed function of its sequence's seed and of how many tokens it has generated,
so a seeded sequence draws the same tokens alone, in any batch and after a preemption.

A 32-bit integer hash (xor-shift and multiply rounds). Every product stays below 2**63
(32-bit values times constants below 2**31), so the same arithmetic is exact in Python ints
and in int64 tensors on any device.
"""

from __future__ import annotations

import torch

__all__ = ["stream_key", "uniform_draws"]

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


def uniform_draws(keys: torch.Tensor) -> torch.Tensor:
    """One uniform number in (0, 1) per stream key (float64, 53 random bits): a fixed
    function of the key, on the keys' device."""
    high = _mix_tensor(keys ^ 0x9E3779B9)
    low = _mix_tensor(keys ^ 0x85EBCA6B)
    bits = (high << 21) | (low >> 11)  # 53 bits
    return (bits.double() + 0.5) * (1.0 / (1 << 53))
