"""KV-cache block accounting: which of the shard's blocks each sequence owns.

The shard owns the tensors; the router decides which block ids each sequence writes
to. A sequence *reserves* enough blocks for its worst case (prompt + max_new_tokens)
when it is admitted, so a running sequence can never run out of blocks mid-generation;
blocks are *allocated* lazily as its length grows, and both are returned on free.
"""

from __future__ import annotations


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold `num_tokens` KV entries."""
    return -(-num_tokens // block_size)


class BlockAllocator:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("the KV cache needs at least one block of at least one token")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # Pop from the end: low ids first.
        self._free = list(range(num_blocks - 1, -1, -1))
        self._reserved = 0

    @property
    def unreserved(self) -> int:
        """Blocks neither allocated nor promised to a running sequence."""
        return self.num_blocks - self._reserved

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_reserve(self, num_tokens: int) -> bool:
        return blocks_for(num_tokens, self.block_size) <= self.unreserved

    def reserve(self, num_tokens: int) -> int:
        """Promise blocks for a sequence of up to `num_tokens`; returns the block count."""
        count = blocks_for(num_tokens, self.block_size)
        if count > self.unreserved:
            raise RuntimeError("KV blocks over-reserved")
        self._reserved += count
        return count

    def grow(self, owned: list[int], new_length: int) -> tuple[int, ...]:
        """Allocate the blocks `owned` lacks to hold `new_length` tokens; returns the new ids."""
        missing = blocks_for(new_length, self.block_size) - len(owned)
        if missing <= 0:
            return ()
        if missing > len(self._free):
            raise RuntimeError("KV blocks exhausted despite reservation")
        new = tuple(self._free.pop() for _ in range(missing))
        owned.extend(new)
        return new

    def release(self, owned: list[int], reserved: int) -> None:
        """Return a finished sequence's blocks and its reservation."""
        self._free.extend(reversed(owned))
        owned.clear()
        self._reserved -= reserved
