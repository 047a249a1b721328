"""This rank's place in the tensor-parallel group, and the collectives the layers use.

With one rank (`SINGLE`) every collective is a no-op, so model code is written once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from tgis.shard.errors import StartupError


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
        """Sum `x` over the ranks, in place."""
        if self.is_parallel:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's `x` (same shape everywhere) along the last dimension."""
        if not self.is_parallel:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


SINGLE = TensorParallel()
