"""One linear layer's weight in group-quantized form, whatever checkpoint format it came from.

Every integer format tgis reads (GPTQ v1 and v2, AWQ, compressed-tensors' packed and int
layouts, int8 quantized at load) is unpacked at load into the same ``GroupQuantized``:

- ``q`` uint8 [out, in], the unsigned integers (0 .. 2^bits - 1);
- ``scales`` and ``zeros`` float32 [out, groups];
- ``g_idx`` int64 [in], the group of each input column (``i // group_size`` unless the
  checkpoint was quantized in activation order);

and the weight it stands for is ``W[o, i] = scales[o, g] * (q[o, i] - zeros[o, g])`` with
``g = g_idx[i]``. The formats differ only in how they pack and offset these numbers, so
slicing for tensor parallelism (``rows``, ``cols``), fusing q/k/v or gate/up (``concat``)
and dequantizing are written once, here; the kernels (``native/linear/quantized_linear.py``) start
from this form too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tgis.shard.checkpoints.quantized.fp8_matrix import Fp8Matrix, concat_fp8
from tgis.shard.errors import StartupError


@dataclass(frozen=True)
class GroupQuantized:
    """A [out, in] weight as ``scales * (q - zeros)`` per group of input columns."""

    q: torch.Tensor  # uint8 [out, in]
    scales: torch.Tensor  # float32 [out, groups]
    zeros: torch.Tensor  # float32 [out, groups]
    g_idx: torch.Tensor  # int64 [in], values in [0, groups)
    bits: int
    compute_dtype: torch.dtype  # the model's activations

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.q.shape[0]), int(self.q.shape[1])

    @property
    def num_groups(self) -> int:
        return int(self.scales.shape[1])

    def in_order(self) -> bool:
        """Whether the groups follow the input columns (no activation order)."""
        return bool((self.g_idx[1:] >= self.g_idx[:-1]).all())

    def in_group_order(self) -> GroupOrdered | str:
        """The integers with the input columns sorted by group (what every kernel reads),
        or why they cannot be: groups of unequal size (a tensor-parallel slice of an
        activation-ordered layer)."""
        order = None
        g_idx = self.g_idx
        if not self.in_order():
            order = torch.argsort(g_idx, stable=True)
            g_idx = g_idx[order]
        counts = torch.bincount(g_idx, minlength=self.num_groups)
        size = int(counts[0])
        if not bool((counts == size).all()):
            return "groups of unequal size"
        q = self.q if order is None else self.q.index_select(1, order)
        return GroupOrdered(q, order, size)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The dense weight [out, in], computed in float32, in ``dtype`` (default: the
        compute dtype)."""
        scales = self.scales[:, self.g_idx]
        zeros = self.zeros[:, self.g_idx]
        dense = scales * (self.q.float() - zeros)
        return dense.to(dtype or self.compute_dtype)

    def rows(self, ranges: Sequence[tuple[int, int]]) -> GroupQuantized:
        """The output rows of every [start, stop) in ``ranges``, in that order."""
        index = torch.cat([torch.arange(a, b) for a, b in ranges]).to(self.q.device)
        return GroupQuantized(
            self.q.index_select(0, index),
            self.scales.index_select(0, index),
            self.zeros.index_select(0, index),
            self.g_idx,
            self.bits,
            self.compute_dtype,
        )

    def cols(self, start: int, stop: int) -> GroupQuantized:
        """Input columns [start, stop), keeping only the groups they use (renumbered in
        order)."""
        g_idx = self.g_idx[start:stop]
        used = torch.unique(g_idx)  # sorted
        return GroupQuantized(
            self.q[:, start:stop].contiguous(),
            self.scales.index_select(1, used),
            self.zeros.index_select(1, used),
            torch.searchsorted(used, g_idx),
            self.bits,
            self.compute_dtype,
        )


@dataclass(frozen=True)
class GroupOrdered:
    """A ``GroupQuantized``'s integers with the input columns in group order: group ``g``
    is columns ``g * group_size`` to ``(g + 1) * group_size``; ``order`` is the gather
    that puts an activation-ordered layer's inputs in that order (None: already)."""

    q: torch.Tensor  # uint8 [out, in]
    order: torch.Tensor | None
    group_size: int


def concat(parts: Sequence[GroupQuantized]) -> GroupQuantized | None:
    """The parts stacked along the output rows (fused q/k/v or gate/up), or None when their
    groups differ (different activation orders: one kernel cannot read them together)."""
    first = parts[0]
    for part in parts[1:]:
        if part.bits != first.bits or part.num_groups != first.num_groups:
            return None
        if part.g_idx is not first.g_idx and not torch.equal(part.g_idx, first.g_idx):
            return None
    return GroupQuantized(
        torch.cat([p.q for p in parts]),
        torch.cat([p.scales for p in parts]),
        torch.cat([p.zeros for p in parts]),
        first.g_idx,
        first.bits,
        first.compute_dtype,
    )


def unpack_int32(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Unsigned ``bits``-bit integers packed low bits first into int32 ``words`` along
    ``dim`` (0 or 1), as uint8 with that dimension ``32 / bits`` times longer."""
    if 32 % bits:
        raise ValueError(f"{bits}-bit values do not fill 32-bit words evenly")
    per_word = 32 // bits
    shifts = torch.arange(0, 32, bits, device=words.device, dtype=torch.int32)
    mask = (1 << bits) - 1
    if dim == 0:
        values = (words.unsqueeze(1) >> shifts.view(1, -1, 1)) & mask  # [rows, per, cols]
        return values.reshape(words.shape[0] * per_word, words.shape[1]).to(torch.uint8)
    values = (words.unsqueeze(2) >> shifts.view(1, 1, -1)) & mask  # [rows, cols, per]
    return values.reshape(words.shape[0], words.shape[1] * per_word).to(torch.uint8)


def groups_in_order(in_features: int, group_size: int, device: torch.device) -> torch.Tensor:
    """``i // group_size`` for every input column (``group_size`` <= 0: one group)."""
    size = in_features if group_size <= 0 else group_size
    return torch.arange(in_features, device=device) // size


def expect_shape(name: str, tensor: torch.Tensor, shape: tuple[int, ...], why: str) -> None:
    """StartupError naming ``name`` unless ``tensor`` has ``shape`` (``why``: what the
    expected shape follows from)."""
    if tuple(tensor.shape) != shape:
        raise StartupError(f"{name} has shape {list(tensor.shape)}; expected {list(shape)} ({why})")


def expect_dtype(name: str, tensor: torch.Tensor, dtypes: tuple[torch.dtype, ...]) -> None:
    """StartupError naming ``name`` unless ``tensor`` is one of ``dtypes``."""
    if tensor.dtype not in dtypes:
        names = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise StartupError(
            f"{name} is {str(tensor.dtype).removeprefix('torch.')}; expected {names}"
        )


def fuse_rows(
    parts: Sequence[torch.Tensor | GroupQuantized | Fp8Matrix],
) -> torch.Tensor | GroupQuantized | Fp8Matrix | None:
    """Several layers' weights stacked along the output rows (fused q/k/v, gate/up), or
    None when they cannot be one matrix: dense and quantized parts mixed, or quantized
    parts whose groups differ."""
    if len(parts) == 1:
        return parts[0]
    dense = [p for p in parts if isinstance(p, torch.Tensor)]
    if len(dense) == len(parts):
        return torch.cat(dense)
    fp8 = [p for p in parts if isinstance(p, Fp8Matrix)]
    if len(fp8) == len(parts):
        return concat_fp8(fp8)
    quantized = [p for p in parts if isinstance(p, GroupQuantized)]
    return concat(quantized) if len(quantized) == len(parts) else None
