"""The paged KV cache: per layer, K and V tensors of fixed-size blocks.

Shapes: ``[num_blocks, block_size, num_kv_heads, head_dim]``. Token ``p`` of a sequence
lives in block ``block_table[p // block_size]`` at offset ``p % block_size``, i.e. in the
flat slot ``block_table[p // block_size] * block_size + p % block_size``. The router owns
the allocation (which block ids a sequence gets); the shard owns the tensors.
"""

from __future__ import annotations

import logging
import math
import mmap
import time
from dataclasses import dataclass

import torch

BLOCK_SIZE = 16

log = logging.getLogger(__name__)


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
    """Per-layer K and V block tensors, zeroed (masked positions must never hold NaN).

    On the CPU the memory comes from the operating system's zero pages, committed as
    blocks are first written unless ``commit``: the prefix cache keeps freed blocks cached
    and hands out untouched ones first, so with it the cache fills to its size anyway, and
    committing at start turns page faults in the first steps, and a memory limit that
    cannot hold the cache, into start-up costs."""

    def __init__(
        self, spec: KVCacheSpec, num_blocks: int, device: torch.device, commit: bool = False
    ) -> None:
        self.spec = spec
        self.num_blocks = num_blocks
        self.block_size = spec.block_size
        shape = (num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
        started = time.perf_counter()
        self.k = [zeros(shape, spec.dtype, device, commit) for _ in range(spec.num_layers)]
        self.v = [zeros(shape, spec.dtype, device, commit) for _ in range(spec.num_layers)]
        if commit and device.type == "cpu":
            log.info(
                "KV cache: %.2f GiB committed in %.2f s (prefix caching fills all of it)",
                num_blocks * spec.bytes_per_block / 2**30,
                time.perf_counter() - started,
            )

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The (K, V) block tensors of layer ``index``."""
        return self.k[index], self.v[index]


def zeros(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, commit: bool = False
) -> torch.Tensor:
    """A zeroed tensor; on the CPU an anonymous mapping of the operating system's zero
    pages, so it costs memory only as it is written, unless ``commit`` writes it now. (Not
    numpy's calloc: numpy asks for huge pages, whose first touch can stall for compaction.)"""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    memory = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    flat = torch.frombuffer(memory, dtype=torch.uint8)[:nbytes]  # the tensor keeps the map
    if commit:
        flat.zero_()
    return flat.view(dtype).view(shape)
