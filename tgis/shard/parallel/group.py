"""This rank's place in the tensor-parallel group, and the collectives the layers use.

With one rank (`SINGLE`) every collective is a no-op, so model code is written once. With
more, the all-reduce is traceable by ``torch.compile`` (``collective_op.py``), so compiled
steps hold it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tgis.shard.errors import StartupError
from tgis.shard.parallel import collective_op


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    world_size: int = 1
    group: Any = None
    """The process group for tensor collectives (NCCL on GPU, gloo on CPU); None = default."""
    control_group: Any = None
    """A gloo group for the control messages (rank 0's commands, the outcomes), without a
    collective timeout."""

    @property
    def is_parallel(self) -> bool:
        return self.world_size > 1

    def split(self, size: int, what: str) -> tuple[int, int]:
        """This rank's [start, stop) of `size` items split evenly; StartupError if uneven."""
        if size % self.world_size:
            raise StartupError(
                f"{what} ({size}) is not divisible by the number of shards ({self.world_size})"
            )
        part = size // self.world_size
        return self.rank * part, (self.rank + 1) * part

    def padded_split(self, size: int) -> tuple[int, int, int]:
        """[start, stop) of this rank's part of `size` items split into equal parts of
        ceil(size / world) (the last part may be short or empty), and the part size."""
        part = -(-size // self.world_size)
        start = min(self.rank * part, size)
        return start, min(start + part, size), part

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place (inside a compiled step too)."""
        if self.is_parallel:
            collective_op.all_reduce(x, self.group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's `x` (same shape everywhere) along the last dimension."""
        if not self.is_parallel:
            return x
        return torch.cat(collective_op.all_gather(x, self.group, self.world_size), dim=-1)


SINGLE = TensorParallel()
