"""Random weights in place of a checkpoint (``--load-format dummy``), for benchmarks.

``DummyWeights`` answers the models' weight requests exactly as ``Weights`` does (the same
names, the same slicing for tensor parallelism, so every rank gets the shapes real weights
would give it), but from the family's checkpoint layout (``checkpoint_shapes``: name → full
shape) instead of safetensors files: nothing is read but ``config.json``. Each requested
slice is allocated on the target device in the target dtype and initialised in place:
matrices (and embeddings) from normal(0, 0.02), biases zeros, norm weights ones.

Values are a fixed function of (seed, tensor name, requested slice), drawn from a generator
on the target device: a rank gets the same weights at every start, and ranks that hold the
same slice (norms, biases, replicated KV heads) hold the same values, so tensor-parallel
replicas agree.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from typing import Any

import torch

from tgis.shard.checkpoints.weights import Weights
from tgis.shard.errors import StartupError
from tgis.shard.parallel.group import SINGLE, TensorParallel

Shapes = Mapping[str, tuple[int, ...]]

DEFAULT_SEED = 0
MATRIX_STD = 0.02


def parameter_count(shapes: Shapes) -> int:
    """Elements of every tensor of a checkpoint layout (the model's parameter count)."""
    return sum(math.prod(shape) for shape in shapes.values())


class DummyWeights(Weights):
    """``Weights`` over a checkpoint layout: each requested slice is created, never read."""

    def __init__(
        self,
        shapes: Shapes,
        device: torch.device,
        dtype: torch.dtype,
        tp: TensorParallel = SINGLE,
        seed: int = DEFAULT_SEED,
    ) -> None:
        self.device = device
        self.dtype = dtype
        self.tp = tp
        self.shapes = dict(shapes)
        self.seed = seed
        self.created = 0
        """Elements created so far (this rank's parameters once the model is built)."""

    def __contains__(self, name: str) -> bool:
        return name in self.shapes

    def _handle(self, name: str) -> _DummyHandle:
        if name not in self.shapes:
            raise StartupError(f"weight '{name}' is not in the model's checkpoint layout")
        return _DummyHandle(self)

    def close(self) -> None:
        """Nothing to close (no files)."""

    def create(self, name: str, shape: tuple[int, ...], region: str) -> torch.Tensor:
        """A new tensor of ``shape`` on the device for ``region`` (the slice) of ``name``."""
        tensor = torch.empty(shape, dtype=self.dtype, device=self.device)
        self.created += tensor.numel()
        if tensor.is_meta:  # shapes without memory (checks of big layouts)
            return tensor
        if tensor.dim() >= 2:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(_seed(self.seed, name, region))
            tensor.normal_(0.0, MATRIX_STD, generator=generator)
        elif name.endswith("bias"):
            tensor.zero_()
        else:  # norm weights
            tensor.fill_(1.0)
        return tensor


def _seed(seed: int, name: str, region: str) -> int:
    """A 63-bit generator seed for one slice of one tensor (stable across processes)."""
    digest = hashlib.blake2b(f"{seed}/{name}/{region}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class _DummyHandle:
    """What ``Weights`` asks of a ``safe_open`` handle, creating tensors instead of reading."""

    def __init__(self, weights: DummyWeights) -> None:
        self._weights = weights

    def get_tensor(self, name: str) -> torch.Tensor:
        return self._weights.create(name, self._weights.shapes[name], "all")

    def get_slice(self, name: str) -> _DummySlice:
        return _DummySlice(self._weights, name)


class _DummySlice:
    """A ``safe_open`` slice: its shape, and indexing by slices creates that part."""

    def __init__(self, weights: DummyWeights, name: str) -> None:
        self._weights = weights
        self._name = name
        self._shape = weights.shapes[name]

    def get_shape(self) -> list[int]:
        return list(self._shape)

    def __getitem__(self, index: Any) -> torch.Tensor:
        index = index if isinstance(index, tuple) else (index,)
        if len(index) > len(self._shape) or not all(isinstance(s, slice) for s in index):
            raise TypeError(f"unsupported index {index!r} of {self._name}")
        full = (*index, *[slice(None)] * (len(self._shape) - len(index)))
        bounds = [s.indices(size) for s, size in zip(full, self._shape, strict=True)]
        shape = tuple(len(range(*b)) for b in bounds)
        region = ",".join(f"{start}:{stop}:{step}" for start, stop, step in bounds)
        return self._weights.create(self._name, shape, region)
