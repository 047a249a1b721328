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

With a ``quantization_config`` in config.json (or ``--quantize``) the linear layers are
quantized too: random integers of the format's width and group size
(``RandomQuantizedLayout``: GPTQ, AWQ, compressed-tensors integer schemes), or a random
dense layer quantized as at load (FP8, int8), so that the kernels and the memory of a
quantized model can be measured without its checkpoint.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from tgis.shard.checkpoints.quantized.at_load import AtLoadReader
from tgis.shard.checkpoints.quantized.matrix import GroupQuantized, groups_in_order
from tgis.shard.checkpoints.quantized.scheme import QuantScheme
from tgis.shard.checkpoints.quantized.source import LayoutReader, TensorSource
from tgis.shard.checkpoints.weights import STORED_DTYPES, Weights
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
        quantization: QuantScheme | None = None,
    ) -> None:
        self.device = device
        self.dtype = dtype
        self.tp = tp
        self.layout = random_layout(quantization, device)
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


@dataclass(frozen=True)
class RandomQuantizedLayout:
    """Linear layers as random ``bits``-bit integers in groups of ``group_size`` input
    columns (-1: per channel), zero point at mid-range, scales near ``MATRIX_STD``'s."""

    bits: int
    group_size: int
    device: torch.device
    seed: int = DEFAULT_SEED

    def holds(self, source: TensorSource, module: str) -> bool:
        return f"{module}.weight" in source

    def shape(self, source: TensorSource, module: str) -> tuple[int, int]:
        out, in_ = source.shape(f"{module}.weight")[:2]
        return out, in_

    def read(self, source: TensorSource, module: str, compute_dtype: torch.dtype) -> GroupQuantized:
        out, in_ = self.shape(source, module)
        device = self.device
        generator = torch.Generator(device=device)
        generator.manual_seed(_seed(self.seed, module, "quantized"))
        levels = 1 << self.bits
        q = torch.randint(0, levels, (out, in_), generator=generator, device=device)
        groups = 1 if self.group_size <= 0 else math.ceil(in_ / self.group_size)
        # uniform integers have std levels / sqrt(12); scale them to MATRIX_STD
        scale = MATRIX_STD * math.sqrt(12) / levels
        scales = torch.full((out, groups), scale, device=device)
        return GroupQuantized(
            q.to(torch.uint8),
            scales,
            torch.full_like(scales, levels / 2),
            groups_in_order(in_, self.group_size, device),
            self.bits,
            compute_dtype,
        )


def random_layout(quantization: QuantScheme | None, device: torch.device) -> LayoutReader | None:
    """The dummy counterpart of ``quantization``'s layout (None: dense; MXFP4 experts are
    created in their dequantized, dense form)."""
    if quantization is None or quantization.method == "mxfp4":
        return None
    if not quantization.pre_quantized:
        return AtLoadReader(quantization.method)
    if quantization.method == "fp8":
        return AtLoadReader("fp8")
    bits, group_size = quantization.bits or 4, quantization.group_size or 128
    if quantization.method == "compressed-tensors":
        groups: Mapping[str, Any] = quantization.config.get("config_groups") or {}
        if not groups:  # --quantize compressed-tensors on a dense config.json
            return RandomQuantizedLayout(bits, group_size, device)
        first: Mapping[str, Any] = next(iter(groups.values()), {})
        weights: Mapping[str, Any] = first.get("weights") or {}
        if weights.get("type") == "float":
            return AtLoadReader("fp8")
        bits = int(weights.get("num_bits", 4))
        per_channel = weights.get("strategy", "group") in ("channel", "tensor")
        group_size = -1 if per_channel else int(weights.get("group_size") or 128)
    return RandomQuantizedLayout(bits, group_size, device)


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

    def get_dtype(self) -> str:
        return next(k for k, v in STORED_DTYPES.items() if v == self._weights.dtype)

    def __getitem__(self, index: Any) -> torch.Tensor:
        index = index if isinstance(index, tuple) else (index,)
        if len(index) > len(self._shape) or not all(isinstance(s, slice) for s in index):
            raise TypeError(f"unsupported index {index!r} of {self._name}")
        full = (*index, *[slice(None)] * (len(self._shape) - len(index)))
        bounds = [s.indices(size) for s, size in zip(full, self._shape, strict=True)]
        shape = tuple(len(range(*b)) for b in bounds)
        region = ",".join(f"{start}:{stop}:{step}" for start, stop, step in bounds)
        return self._weights.create(self._name, shape, region)
