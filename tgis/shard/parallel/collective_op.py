"""The layers' all-reduce as the custom operator ``tgis::all_reduce``, and the rank-local
mode in which start-up compiles each rank's step without waiting on its peers.

A compiled step (``native/graphs/compiled.py``) is one graph of every layer, so the
row-parallel layers' and the vocabulary embedding's all-reduce must be inside it. Under
``torch.compile`` the all-reduce is the opaque operator ``tgis::all_reduce``: it mutates its
input and calls the process group's all-reduce, the same call as the eager step's, so
inductor keeps the sum in place between its fused kernels, gloo runs it on the CPU, and on
CUDA the NCCL all-reduce inside it is captured by CUDA graphs as the eager step's is. Run
eagerly, ``all_reduce`` calls the group directly (a custom operator's dispatch costs tens of
microseconds a call).

``rank_local()``: while it is open the tensor collectives leave each rank's values as they
are (an all-gather repeats this rank's part), so a rank compiling its step at start-up runs
no collective that a peer might never join (a rank whose compilation fails would otherwise
leave the others waiting in the graph's first all-reduce). The values computed meanwhile
mean nothing and are thrown away; the ranks then agree on the outcome
(``distributed.first_failure``). A compiled graph reads the mode when it runs, not when it
is traced, so the graph compiled under it is the one that serves.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

_RANK_LOCAL = [False]


def _group(name: str) -> Any:
    """The process group named ``name``; None (the default group) for ""."""
    c10d = dist.distributed_c10d
    return c10d._resolve_process_group(c10d.GroupName(name)) if name else None


@torch.library.custom_op("tgis::all_reduce", mutates_args=("x",))
def all_reduce_op(x: torch.Tensor, group: str) -> None:
    """Sum ``x`` over the ranks of process group ``group`` ("" the default), in place."""
    if not _RANK_LOCAL[0]:
        dist.all_reduce(x, group=_group(group))


@all_reduce_op.register_fake
def _(x: torch.Tensor, group: str) -> None:
    return None


def all_reduce(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Sum ``x`` over the ranks of ``group`` (None: the default group), in place; as
    ``tgis::all_reduce`` while ``torch.compile`` traces it."""
    if torch.compiler.is_compiling():
        all_reduce_op(x, "" if group is None else group.group_name)
    elif not _RANK_LOCAL[0]:
        dist.all_reduce(x, group=group)
    return x


def all_gather(x: torch.Tensor, group: Any, world_size: int) -> list[torch.Tensor]:
    """Every rank's ``x`` (same shape everywhere), in rank order (eagerly only)."""
    if _RANK_LOCAL[0]:
        return [x] * world_size
    parts = [torch.empty_like(x) for _ in range(world_size)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return parts


@contextlib.contextmanager
def rank_local() -> Iterator[None]:
    """Tensor collectives that leave each rank's values as they are, while open."""
    _RANK_LOCAL[0] = True
    try:
        yield
    finally:
        _RANK_LOCAL[0] = False
