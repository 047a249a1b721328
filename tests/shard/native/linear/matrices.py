"""Random group-quantized matrices and the dense weight they stand for, computed by indexing
alone (float64): the oracle of the quantized kernels' tests."""

from __future__ import annotations

import torch

from tgis.shard.checkpoints.quantized.matrix import GroupQuantized


def random_matrix(
    out: int,
    in_: int,
    bits: int,
    group: int,
    act_order: bool = False,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
) -> GroupQuantized:
    """Random integers, scales and zero points (the edges 0 and 2^bits - 1 included)."""
    gen = torch.Generator().manual_seed(seed)
    groups = 1 if group <= 0 else in_ // group
    size = in_ if group <= 0 else group
    g_idx = torch.arange(in_) // size
    if act_order:
        g_idx = g_idx[torch.randperm(in_, generator=gen)]
    levels = 1 << bits
    zeros = torch.randint(0, levels, (out, groups), generator=gen).float()
    zeros[0, 0], zeros[-1, -1] = 0, levels - 1
    return GroupQuantized(
        torch.randint(0, levels, (out, in_), generator=gen).to(torch.uint8),
        torch.rand(out, groups, generator=gen) * 0.02 + 0.001,
        zeros,
        g_idx,
        bits,
        dtype,
    )


def reference(m: GroupQuantized) -> torch.Tensor:
    """The dense weight, by indexing each column's group (float64)."""
    out, in_ = m.shape
    w = torch.empty(out, in_, dtype=torch.float64)
    for i in range(in_):
        g = int(m.g_idx[i])
        w[:, i] = m.scales[:, g].double() * (m.q[:, i].double() - m.zeros[:, g].double())
    return w
