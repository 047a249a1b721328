"""KV-cache blocks: which of the shard's blocks each sequence holds, and which hold a cached
prompt prefix (``prefix_cache.py`` decides what is cached; this module only keeps count).

The shard owns the tensors; the router decides which block ids each sequence reads and
writes. Every block has a reference count (the sequences whose tables hold it) and may
carry a hash, the identity of the tokens it holds (``prefix_hashes.py``). A block is in one
of three places:

* **held**: reference count > 0; never handed out again until every holder lets go;
* **empty**: free and without a hash; handed out first (low ids first);
* **idle**: free with a hash, in least-recently-freed order; handed out, and its hash
  forgotten, only when no empty block is left (the oldest first).

So ``num_free`` (what admission and preemption count) includes the idle blocks: a cached
prefix never makes the scheduler preempt. A sequence's blocks are released last to first,
so its later blocks, the ones least likely to be shared, are evicted first. Nothing is
over-committed: ``allocate`` and ``grow`` fail rather than hand out a held block, so the
scheduler checks ``missing`` against ``num_free`` first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

__all__ = ["BlockHash", "BlockPool", "blocks_for"]

BlockHash = bytes
"""The identity of a full block's tokens and of everything before them."""


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold ``num_tokens`` KV entries."""
    return -(-num_tokens // block_size)


class BlockPool:
    """Reference-counted KV blocks, the hashed ones findable by hash."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("the KV cache needs at least one block of at least one token")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._refs = [0] * num_blocks
        self._hashes: list[BlockHash | None] = [None] * num_blocks
        self._by_hash: dict[BlockHash, int] = {}
        self._empty = list(range(num_blocks - 1, -1, -1))  # pop from the end: low ids first
        self._idle: OrderedDict[int, None] = OrderedDict()  # oldest first

    # ---- counts ---------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out: empty ones and idle cached ones."""
        return len(self._empty) + len(self._idle)

    @property
    def num_used(self) -> int:
        """Blocks held by some sequence (the used-KV gauge; idle cached blocks are free)."""
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        """Blocks with a hash, held or idle."""
        return len(self._by_hash)

    @property
    def num_idle(self) -> int:
        """Cached blocks no sequence holds."""
        return len(self._idle)

    def blocks_for(self, num_tokens: int) -> int:
        return blocks_for(num_tokens, self.block_size)

    def missing(self, owned: Sequence[int], new_length: int) -> int:
        """Blocks ``owned`` lacks to hold ``new_length`` tokens."""
        return max(self.blocks_for(new_length) - len(owned), 0)

    def refs(self, block: int) -> int:
        return self._refs[block]

    def hash_of(self, block: int) -> BlockHash | None:
        return self._hashes[block]

    # ---- holding and letting go -------------------------------------------------------------

    def allocate(self, count: int) -> list[int]:
        """``count`` blocks, held once each: empty ones first, then the oldest idle ones
        (their hashes forgotten). RuntimeError, nothing taken, if fewer are free."""
        if count > self.num_free:
            raise RuntimeError(f"KV blocks exhausted: {count} wanted, {self.num_free} free")
        taken = []
        for _ in range(count):
            if self._empty:
                block = self._empty.pop()
            else:
                block, _ = self._idle.popitem(last=False)
                digest = self._hashes[block]
                assert digest is not None
                del self._by_hash[digest]
                self._hashes[block] = None
            self._refs[block] = 1
            taken.append(block)
        return taken

    def grow(self, owned: list[int], new_length: int) -> tuple[int, ...]:
        """Allocate the blocks ``owned`` lacks to hold ``new_length`` tokens; returns the new
        ids."""
        new = tuple(self.allocate(self.missing(owned, new_length)))
        owned.extend(new)
        return new

    def share(self, blocks: Iterable[int]) -> None:
        """Hold cached blocks found by ``match`` once more (an idle one stops being free)."""
        for block in blocks:
            if self._refs[block] == 0:
                del self._idle[block]
            self._refs[block] += 1

    def release(self, owned: list[int]) -> None:
        """Let go of a sequence's blocks (finished, cancelled or preempted), last first: a
        block nobody holds any more becomes empty, or idle if it has a hash."""
        for block in reversed(owned):
            refs = self._refs[block] - 1
            if refs < 0:
                raise RuntimeError(f"KV block {block} released more often than held")
            self._refs[block] = refs
            if refs == 0:
                if self._hashes[block] is None:
                    self._empty.append(block)
                else:
                    self._idle[block] = None
        owned.clear()

    # ---- the cache --------------------------------------------------------------------------

    def match(self, hashes: Iterable[BlockHash]) -> list[int]:
        """The cached blocks of the longest run of ``hashes`` from the first (a chain: each
        hash covers everything before it, so the run stops at the first miss)."""
        found = []
        for digest in hashes:
            block = self._by_hash.get(digest)
            if block is None:
                break
            found.append(block)
        return found

    def idle_among(self, blocks: Iterable[int]) -> int:
        """How many of ``blocks`` no sequence holds (sharing them uses up free blocks)."""
        return sum(1 for block in blocks if self._refs[block] == 0)

    def register(self, block: int, digest: BlockHash) -> bool:
        """Make a held, fully written block findable by ``digest``. False (nothing done)
        when it already has a hash or another block holds the same tokens (two sequences
        computed one prefix at once: the second copy stays private and is empty when
        freed)."""
        if self._refs[block] == 0:
            raise RuntimeError(f"KV block {block} registered while nobody holds it")
        if self._hashes[block] is not None or digest in self._by_hash:
            return False
        self._hashes[block] = digest
        self._by_hash[digest] = block
        return True
