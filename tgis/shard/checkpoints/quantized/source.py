"""What a layout reader needs of a checkpoint: its tensors by name, as stored."""

from __future__ import annotations

from typing import Protocol

import torch

from tgis.shard.checkpoints.quantized.fp8_matrix import Fp8Matrix
from tgis.shard.checkpoints.quantized.matrix import GroupQuantized
from tgis.shard.errors import StartupError

LinearMatrix = torch.Tensor | GroupQuantized | Fp8Matrix
"""One linear layer's weight [out, in] as read: dense (in the model's dtype),
group-quantized, or FP8 with channel scales."""


class TensorSource(Protocol):
    """A checkpoint's tensors (``checkpoints/weights.py: Weights``)."""

    def __contains__(self, name: str) -> bool: ...

    def raw(self, name: str) -> torch.Tensor:
        """The tensor ``name`` as stored (no cast), on the target device."""
        ...

    def shape(self, name: str) -> tuple[int, ...]:
        """The full shape of ``name``."""
        ...

    def stored_dtype(self, name: str) -> torch.dtype:
        """The dtype ``name`` is stored in (no read of its values)."""
        ...


class LayoutReader(Protocol):
    """One quantization format's linear layers."""

    def holds(self, source: TensorSource, module: str) -> bool:
        """Whether the checkpoint stores ``module``'s weight in this format (layers it
        leaves dense, such as an ``ignore`` list, answer False)."""
        ...

    def shape(self, source: TensorSource, module: str) -> tuple[int, int]:
        """``module``'s weight shape [out, in]."""
        ...

    def read(self, source: TensorSource, module: str, compute_dtype: torch.dtype) -> LinearMatrix:
        """``module``'s whole weight: group-quantized, FP8 with channel scales, or dense
        float32 (FP8 scaled per group or block)."""
        ...


def quantized_weight(source: TensorSource, module: str, *scale_names: str) -> bool:
    """Whether ``<module>.weight`` comes with one of the ``scale_names`` (a quantized
    layer); StartupError when it is stored as integers or FP8 without one (a layer left
    dense is stored in a float type and is read as it is)."""
    name = f"{module}.weight"
    if name not in source:
        return False
    if any(f"{module}.{scale}" in source for scale in scale_names):
        return True
    dtype = source.stored_dtype(name)
    if dtype.is_floating_point and dtype.itemsize >= 2:
        return False
    raise StartupError(
        f"{name} is stored as {str(dtype).removeprefix('torch.')} but "
        f"{' or '.join(f'{module}.{s}' for s in scale_names)} is missing: its values "
        "cannot be read without their scale"
    )
