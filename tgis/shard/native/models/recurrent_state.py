"""Per-sequence recurrent state beside the paged KV cache: the convolution and SSM states of
a hybrid model's Mamba layers, in a fixed pool of slots (``RecurrentStates``), and how one
step's sequences read and write them (``StateStep``).

The router owns the slots as it owns KV blocks (``ShardInfo.state_slots``,
``ScheduledSequence.state_slot``): a running sequence holds one from admission until it
finishes or is preempted. A chunk starting at position 0 starts from zeros (a new sequence,
or one resumed after a preemption, recomputed from scratch), any other from its slot. A
step's new states are staged while the layers run and written to the slots only when the
runner commits the step (``StateStep.commit``), so a step that fails leaves every slot as
it was, and the router may schedule the same chunk again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class StateSpec:
    """The shape of one slot: per Mamba layer a convolution state [K - 1, C] in the model's
    dtype and an SSM state [heads, head_dim, state_size] in float32."""

    num_layers: int
    conv_shape: tuple[int, int]
    ssm_shape: tuple[int, int, int]
    dtype: torch.dtype

    @property
    def bytes_per_slot(self) -> int:
        """Bytes one slot takes over every layer (its staged copy in a step not counted)."""
        conv = self.conv_shape[0] * self.conv_shape[1] * self.dtype.itemsize
        heads, dim, size = self.ssm_shape
        return self.num_layers * (conv + heads * dim * size * 4)


class RecurrentStates:
    """The pool: ``conv`` [layers, slots, K - 1, C] and ``ssm`` [layers, slots, H, P, N]."""

    def __init__(self, spec: StateSpec, num_slots: int, device: torch.device) -> None:
        self.spec = spec
        self.num_slots = num_slots
        self.conv = torch.zeros(
            spec.num_layers, num_slots, *spec.conv_shape, dtype=spec.dtype, device=device
        )
        self.ssm = torch.zeros(
            spec.num_layers, num_slots, *spec.ssm_shape, dtype=torch.float32, device=device
        )


@dataclass(frozen=True)
class Segment:
    """A sequence computing several tokens this step: rows ``start : start + length`` of the
    flattened batch, its slot, and whether it starts at position 0 (from zeros)."""

    start: int
    length: int
    slot: int
    fresh: bool


@dataclass
class StateStep:
    """One step's view of the pool: the sequences computing several tokens (``segments``,
    each scanned on its own) and those computing one (``single_rows`` of the batch, their
    ``single_slots``, and which of them start from zeros), batched together."""

    states: RecurrentStates
    segments: tuple[Segment, ...]
    single_rows: torch.Tensor  # [S] long
    single_slots: torch.Tensor  # [S] long
    single_fresh: torch.Tensor  # [S] bool
    # Every sequence of the step, in work order (the Triton scan's launch): first row,
    # rows, slot, starts from zeros.
    starts: torch.Tensor  # [sequences] long
    lengths: torch.Tensor  # [sequences] long
    slots: torch.Tensor  # [sequences] long
    fresh: torch.Tensor  # [sequences] bool
    # (a layer's pool of conv or SSM states, slots, their new states) until ``commit``.
    _staged: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=list)

    @classmethod
    def build(
        cls,
        states: RecurrentStates,
        starts: Sequence[int],
        lengths: Sequence[int],
        slots: Sequence[int],
        positions: Sequence[int],
    ) -> StateStep:
        """The step whose sequence ``i`` has rows ``starts[i]`` + ``lengths[i]``, slot
        ``slots[i]`` and first position ``positions[i]``."""
        device = states.conv.device
        segments = []
        rows, single_slots, fresh = [], [], []
        for start, length, slot, position in zip(starts, lengths, slots, positions, strict=True):
            if length == 1:
                rows.append(start)
                single_slots.append(slot)
                fresh.append(position == 0)
            else:
                segments.append(Segment(start, length, slot, position == 0))
        every = torch.tensor(
            [list(starts), list(lengths), list(slots), [int(p == 0) for p in positions]],
            dtype=torch.long,
        ).to(device)
        return cls(
            states,
            tuple(segments),
            torch.tensor(rows, dtype=torch.long, device=device),
            torch.tensor(single_slots, dtype=torch.long, device=device),
            torch.tensor(fresh, dtype=torch.bool, device=device),
            every[0],
            every[1],
            every[2],
            every[3].bool(),
        )

    def segment_state(self, layer: int, segment: Segment) -> tuple[torch.Tensor, torch.Tensor]:
        """The (conv, ssm) state a segment starts from."""
        conv, ssm = self.states.conv[layer, segment.slot], self.states.ssm[layer, segment.slot]
        if segment.fresh:
            return torch.zeros_like(conv), torch.zeros_like(ssm)
        return conv, ssm

    def single_states(
        self, layer: int, ssm: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The (conv [S, K - 1, C], ssm [S, H, P, N]) states the one-token sequences start
        from (copies; the SSM states only if ``ssm``)."""
        fresh = self.single_fresh
        any_fresh = bool(fresh.any())
        conv = self.states.conv[layer].index_select(0, self.single_slots)
        if any_fresh:  # where, not a product: a stale slot may hold NaN
            conv = torch.where(fresh[:, None, None], torch.zeros_like(conv), conv)
        if not ssm:
            return conv, None
        states = self.states.ssm[layer].index_select(0, self.single_slots)
        if any_fresh:
            states = torch.where(fresh[:, None, None, None], torch.zeros_like(states), states)
        return conv, states

    def stage(self, layer: int, slots: torch.Tensor, conv: torch.Tensor, ssm: torch.Tensor) -> None:
        """Keep layer ``layer``'s new states of ``slots`` until ``commit``."""
        self.stage_conv_rows(layer, slots, conv)
        self.stage_ssm(layer, slots, ssm)

    def stage_segment(
        self, layer: int, segment: Segment, conv: torch.Tensor, ssm: torch.Tensor
    ) -> None:
        slot = self._slot(segment, conv.device)
        self.stage(layer, slot, conv[None], ssm[None])

    def stage_conv(self, layer: int, segment: Segment, conv: torch.Tensor) -> None:
        self.stage_conv_rows(layer, self._slot(segment, conv.device), conv[None])

    def stage_conv_rows(self, layer: int, slots: torch.Tensor, conv: torch.Tensor) -> None:
        self._staged.append((self.states.conv[layer], slots, conv))

    def stage_ssm(self, layer: int, slots: torch.Tensor, ssm: torch.Tensor) -> None:
        self._staged.append((self.states.ssm[layer], slots, ssm))

    @staticmethod
    def _slot(segment: Segment, device: torch.device) -> torch.Tensor:
        return torch.tensor([segment.slot], dtype=torch.long, device=device)

    def commit(self) -> None:
        """Write every staged state into its slot (the step succeeded)."""
        for pool, slots, values in self._staged:
            pool.index_copy_(0, slots, values.to(pool.dtype))
        self._staged.clear()
