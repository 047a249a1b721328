"""The paged KV cache: per layer, K and V tensors of fixed-size blocks.

Shapes: ``[num_blocks, block_size, num_kv_heads, head_dim]``. Token ``p`` of a sequence
lives in block ``block_table[p // block_size]`` at offset ``p % block_size``, i.e. in the
flat slot ``block_table[p // block_size] * block_size + p % block_size``. The router owns
the allocation (which block ids a sequence gets); the shard owns the tensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

BLOCK_SIZE = 16


@dataclass(frozen=True)
class KVCacheSpec:
    """What one cache block holds, for sizing and allocation."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    block_size: int = BLOCK_SIZE

    @property
    def bytes_per_block(self) -> int:
        """Bytes of K and V of every layer for one block."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem


class KVCache:
    """Per-layer K and V block tensors, zeroed (masked positions must never hold NaN)."""

    def __init__(self, spec: KVCacheSpec, num_blocks: int, device: torch.device) -> None:
        self.spec = spec
        self.num_blocks = num_blocks
        self.block_size = spec.block_size
        shape = (num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
        self.k = [zeros(shape, spec.dtype, device) for _ in range(spec.num_layers)]
        self.v = [zeros(shape, spec.dtype, device) for _ in range(spec.num_layers)]

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The (K, V) block tensors of layer ``index``."""
        return self.k[index], self.v[index]


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed tensor; on the CPU from the operating system's zero pages (numpy's calloc),
    so a large cache costs memory only as it fills, and start-up does not write it."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)
