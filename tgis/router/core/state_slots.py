"""Recurrent-state slots (``ShardInfo.state_slots``): the shard holds a Mamba layer's
per-sequence state in a fixed pool beside the KV cache, and the router decides which slot
each running sequence uses, as it decides its KV blocks. A sequence takes one when it is
admitted and gives it back when it finishes, is cancelled or is preempted (recompute
preemption: its state is rebuilt from position 0 when it is resumed, in whichever slot it
gets then)."""

from __future__ import annotations

__all__ = ["StateSlots"]


class StateSlots:
    """The free slots, lowest first."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError("a model with recurrent state needs at least one state slot")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # pop from the end: low ids first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self) -> int:
        """A free slot; RuntimeError if none is (admission is capped by the slot count)."""
        if not self._free:
            raise RuntimeError(f"all {self.num_slots} state slots are in use")
        return self._free.pop()

    def give_back(self, slot: int) -> None:
        if slot in self._free or not 0 <= slot < self.num_slots:
            raise RuntimeError(f"state slot {slot} given back while not held")
        self._free.append(slot)
