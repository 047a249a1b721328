"""KV-cache block accounting: which of the shard's blocks each sequence owns.

The shard owns the tensors; the router decides which block ids each sequence writes to.
This is a plain free list: the scheduler allocates a sequence's blocks when it admits it
(enough for every token it knows) and one more whenever a decode crosses a block boundary,
and frees them all at once when the sequence finishes, is cancelled or is preempted. It
never over-commits: `allocate` and `grow` fail rather than hand out a block twice, so the
scheduler checks `missing` against `num_free` first (and preempts when a decode needs a
block and none is free).
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

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Blocks owned by some sequence (the used-KV gauge)."""
        return self.num_blocks - len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return blocks_for(num_tokens, self.block_size)

    def missing(self, owned: list[int], new_length: int) -> int:
        """Blocks `owned` lacks to hold `new_length` tokens."""
        return max(self.blocks_for(new_length) - len(owned), 0)

    def allocate(self, count: int) -> list[int]:
        """`count` free blocks; RuntimeError (nothing taken) if fewer are free."""
        if count > len(self._free):
            raise RuntimeError(f"KV blocks exhausted: {count} wanted, {len(self._free)} free")
        return [self._free.pop() for _ in range(count)]

    def grow(self, owned: list[int], new_length: int) -> tuple[int, ...]:
        """Allocate the blocks `owned` lacks to hold `new_length` tokens; returns the new ids."""
        new = tuple(self.allocate(self.missing(owned, new_length)))
        owned.extend(new)
        return new

    def release(self, owned: list[int]) -> None:
        """Return a sequence's blocks (finished, cancelled or preempted)."""
        self._free.extend(reversed(owned))
        owned.clear()
