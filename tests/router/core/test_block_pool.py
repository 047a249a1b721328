"""The KV block pool (router/core/block_pool.py) against a naive model of it: a
hypothesis state machine allocates, shares, registers, matches and releases blocks for a
handful of owners, and after every step checks reference counts, that no held block is
ever handed out again or evicted, that empty blocks go before cached ones, and that cached
blocks are evicted in the order they were freed."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tgis.router.core.block_pool import BlockPool

NUM_BLOCKS = 12
HASHES = [bytes([i]) * 4 for i in range(6)]  # few, so registrations collide


class PoolMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(NUM_BLOCKS, 4)
        self.owners: list[list[int]] = []  # each owner's table, in order
        # The naive model.
        self.refs = [0] * NUM_BLOCKS
        self.hash_of: dict[int, bytes] = {}
        self.idle_order: list[int] = []  # freed cached blocks, oldest first

    def _free(self) -> int:
        return sum(1 for r in self.refs if r == 0)

    @rule(count=st.integers(0, NUM_BLOCKS))
    def allocate(self, count: int) -> None:
        if count > self._free():
            with pytest.raises(RuntimeError, match="KV blocks exhausted"):
                self.pool.allocate(count)
            return
        empty = {b for b in range(NUM_BLOCKS) if self.refs[b] == 0 and b not in self.hash_of}
        taken = self.pool.allocate(count)
        assert len(set(taken)) == count
        assert all(self.refs[b] == 0 for b in taken), "a held block handed out"
        from_empty = min(count, len(empty))
        assert set(taken[:from_empty]) <= empty, "a cached block evicted before an empty one"
        evicted = taken[from_empty:]
        assert evicted == self.idle_order[: len(evicted)], "not the oldest cached blocks"
        for block in evicted:
            del self.hash_of[block]
        del self.idle_order[: len(evicted)]
        for block in taken:
            self.refs[block] = 1
        self.owners.append(taken)

    @precondition(lambda self: self.owners)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        table = self.owners.pop(data.draw(st.integers(0, len(self.owners) - 1)))
        for block in reversed(table):
            self.refs[block] -= 1
            if self.refs[block] == 0 and block in self.hash_of:
                self.idle_order.append(block)
        self.pool.release(list(table))

    @precondition(lambda self: any(self.owners))
    @rule(data=st.data(), digest=st.sampled_from(HASHES))
    def register(self, data: st.DataObject, digest: bytes) -> None:
        table = data.draw(st.sampled_from([t for t in self.owners if t]))
        block = data.draw(st.sampled_from(table))
        expected = block not in self.hash_of and digest not in self.hash_of.values()
        assert self.pool.register(block, digest) == expected
        if expected:
            self.hash_of[block] = digest

    @rule(chain=st.lists(st.sampled_from(HASHES), max_size=4))
    def match_and_share(self, chain: list[bytes]) -> None:
        by_hash = {d: b for b, d in self.hash_of.items()}
        expected = []
        for digest in chain:
            if digest not in by_hash:
                break
            expected.append(by_hash[digest])
        found = self.pool.match(chain)
        assert found == expected
        if len(set(found)) != len(found):
            return  # a chain naming one block twice is not a table
        assert self.pool.idle_among(found) == sum(1 for b in found if self.refs[b] == 0)
        self.pool.share(found)
        for block in found:
            if self.refs[block] == 0:
                self.idle_order.remove(block)
            self.refs[block] += 1
        self.owners.append(list(found))

    @invariant()
    def counts_agree(self) -> None:
        pool = self.pool
        assert [pool.refs(b) for b in range(NUM_BLOCKS)] == self.refs
        assert pool.num_free == self._free() and pool.num_used == NUM_BLOCKS - self._free()
        assert pool.num_cached == len(self.hash_of)
        assert pool.num_idle == len(self.idle_order)
        assert all(pool.hash_of(b) == self.hash_of.get(b) for b in range(NUM_BLOCKS))
        held = [b for t in self.owners for b in t]
        assert all(self.refs[b] == held.count(b) for b in range(NUM_BLOCKS))


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_misuse_is_refused() -> None:
    pool = BlockPool(2, 4)
    (block,) = pool.allocate(1)
    pool.release([block])
    with pytest.raises(RuntimeError, match="released more often than held"):
        pool.release([block])
    with pytest.raises(RuntimeError, match="registered while nobody holds it"):
        pool.register(block, b"h")
    with pytest.raises(ValueError, match="at least one block"):
        BlockPool(0, 4)
