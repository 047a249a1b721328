"""Load tensors by their Hugging Face names from a directory of safetensors files.

Handles a single ``model.safetensors`` and sharded checkpoints with
``model.safetensors.index.json``. Tensors are read lazily (memory-mapped) straight onto
the target device and cast to the target dtype. With tensor parallelism each rank reads
only its slice of a sharded tensor (``get_sharded``, ``get_rows``).

Linear layers are read by module (``linear``): dense, or, in a quantized checkpoint, in
the layout its format stores (``quantized/``: GPTQ, AWQ, compressed-tensors, FP8) or
quantized as read (int8, fp8 at load), so the model families never see the format.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from tgis.shard.checkpoints.quantized.matrix import GroupQuantized
from tgis.shard.checkpoints.quantized.readers import layout_reader
from tgis.shard.checkpoints.quantized.scheme import QuantScheme
from tgis.shard.checkpoints.quantized.source import LayoutReader, LinearMatrix
from tgis.shard.errors import StartupError
from tgis.shard.parallel.group import SINGLE, TensorParallel

INDEX_FILE = "model.safetensors.index.json"
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# safetensors' dtype names, as a file's header gives them.
STORED_DTYPES = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
}


class Weights:
    """Name → tensor access over every safetensors file of a model directory."""

    def __init__(
        self,
        model_dir: Path,
        device: torch.device,
        dtype: torch.dtype,
        tp: TensorParallel = SINGLE,
        quantization: QuantScheme | None = None,
    ) -> None:
        self.device = device
        self.dtype = dtype
        self.tp = tp
        self.layout: LayoutReader | None = layout_reader(quantization)
        self._file_of = _index(model_dir)
        self._handles: dict[Path, Any] = {}

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def _handle(self, name: str) -> Any:
        path = self._file_of.get(name)
        if path is None:
            raise StartupError(f"weight '{name}' not found in the safetensors files")
        handle = self._handles.get(path)
        if handle is None:
            handle = safe_open(str(path), framework="pt", device=str(self.device))
            self._handles[path] = handle
        return handle

    def _cast(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        """``tensor`` in the model's dtype; StartupError for FP8 values, which mean nothing
        without their scale (a quantized LM head or embedding tgis does not read)."""
        if tensor.dtype in FP8_DTYPES:
            raise StartupError(
                f"{name} is stored as {str(tensor.dtype).removeprefix('torch.')}, which tgis "
                "reads only in the linear layers of a quantized checkpoint"
            )
        if tensor.is_floating_point() and tensor.dtype != self.dtype:
            tensor = tensor.to(self.dtype)
        return tensor.contiguous()

    def shape(self, name: str) -> tuple[int, ...]:
        """The full (unsharded) shape of ``name``, read from the file header."""
        return tuple(self._handle(name).get_slice(name).get_shape())

    def stored_dtype(self, name: str) -> torch.dtype:
        """The dtype ``name`` is stored in, read from the file header."""
        stored = self._handle(name).get_slice(name).get_dtype()
        if stored not in STORED_DTYPES:
            raise StartupError(f"{name} is stored as {stored}, a dtype tgis does not read")
        return STORED_DTYPES[stored]

    def raw(self, name: str) -> torch.Tensor:
        """The tensor ``name`` as stored (no cast) on the target device."""
        tensor: torch.Tensor = self._handle(name).get_tensor(name)
        return tensor

    def get(self, name: str) -> torch.Tensor:
        """The whole tensor ``name`` on the target device; floating tensors cast to the dtype."""
        return self._cast(self._handle(name).get_tensor(name), name)

    def get_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of ``name`` (dimension 0), reading only those rows."""
        return self._cast(self._handle(name).get_slice(name)[start:stop], name)

    def get_row_ranges(self, name: str, ranges: Sequence[tuple[int, int]]) -> torch.Tensor:
        """The rows of every [start, stop) in ``ranges`` (dimension 0), concatenated in that
        order; reads only those rows (adjacent ranges are read as one)."""
        merged: list[tuple[int, int]] = []
        for start, stop in ranges:
            if merged and merged[-1][1] == start:
                merged[-1] = (merged[-1][0], stop)
            else:
                merged.append((start, stop))
        view = self._handle(name).get_slice(name)
        return self._cast(torch.cat([view[start:stop] for start, stop in merged]), name)

    def get_part(self, name: str, *index: slice) -> torch.Tensor:
        """The part of ``name`` at ``index`` (a slice per leading dimension), reading only
        that part (one expert's rows of a 3-D tensor of experts, say)."""
        return self._cast(self._handle(name).get_slice(name)[index], name)

    def get_sharded(self, name: str, dim: int) -> torch.Tensor:
        """This rank's equal part of ``name`` along ``dim`` (0 or 1); the whole tensor with
        one rank. Reads only the slice from the file."""
        if not self.tp.is_parallel:
            return self.get(name)
        size = self.shape(name)[dim]
        start, stop = self.tp.split(size, f"dimension {dim} of {name}")
        view = self._handle(name).get_slice(name)
        return self._cast(view[start:stop] if dim == 0 else view[:, start:stop], name)

    def linear_shape(self, module: str) -> tuple[int, int]:
        """The full [out, in] shape of linear layer ``module``'s weight."""
        if self.layout is not None and self.layout.holds(self, module):
            return self.layout.shape(self, module)
        out, in_ = self.shape(f"{module}.weight")[:2]
        return out, in_

    def linear(
        self,
        module: str,
        rows: Sequence[tuple[int, int]] | None = None,
        cols: tuple[int, int] | None = None,
    ) -> LinearMatrix:
        """Linear layer ``module``'s weight: the output rows of every [start, stop) in
        ``rows`` (in that order), or input columns [start, stop) (``cols``), or all of it.
        Dense in the model's dtype, group-quantized (``quantized/matrix.py``) or FP8
        (``quantized/fp8_matrix.py``)."""
        if self.layout is None or not self.layout.holds(self, module):
            return self._dense_linear(f"{module}.weight", rows, cols)
        matrix = self.layout.read(self, module, self.dtype)
        if isinstance(matrix, torch.Tensor):  # FP8 scaled per group or block, read dense
            return _slice_dense(matrix.to(self.dtype), rows, cols)
        if rows is not None:
            return matrix.rows(rows)
        if cols is not None:
            if isinstance(matrix, GroupQuantized):
                check_group_split(module, matrix, cols, self.tp.world_size)
            return matrix.cols(*cols)
        return matrix

    def _dense_linear(
        self, name: str, rows: Sequence[tuple[int, int]] | None, cols: tuple[int, int] | None
    ) -> torch.Tensor:
        """A dense weight's rows or columns, reading only those."""
        if rows is not None:
            return self.get_row_ranges(name, rows)
        if cols is not None:
            return self._cast(self._handle(name).get_slice(name)[:, cols[0] : cols[1]], name)
        return self.get(name)

    def close(self) -> None:
        """Drop the file handles (the loaded tensors stay valid)."""
        self._handles.clear()


def _slice_dense(
    matrix: torch.Tensor, rows: Sequence[tuple[int, int]] | None, cols: tuple[int, int] | None
) -> torch.Tensor:
    if rows is not None:
        return torch.cat([matrix[a:b] for a, b in rows])
    return matrix if cols is None else matrix[:, cols[0] : cols[1]].contiguous()


def check_group_split(
    module: str, matrix: GroupQuantized, cols: tuple[int, int], world_size: int
) -> None:
    """StartupError, naming the ``--num-shard`` values that work, when this rank's input
    columns ``cols`` of a layer quantized in column order cut one of its groups (a layer
    in activation order keeps every group's scales on every rank instead)."""
    if not matrix.in_order() or matrix.num_groups <= 1:
        return
    in_features = matrix.shape[1]
    size = int((matrix.g_idx == 0).sum())  # the group size (the last group may be short)
    if cols[0] % size == 0 and (cols[1] % size == 0 or cols[1] == in_features):
        return
    working = [n for n in range(1, 65) if in_features % n == 0 and (in_features // n) % size == 0]
    raise StartupError(
        f"{module}: {in_features} input features in groups of {size} cannot be split "
        f"between {world_size} shards (each would cut a group); --num-shard values that "
        f"work: {', '.join(map(str, working[:8]))}"
    )


def _index(model_dir: Path) -> dict[str, Path]:
    index_path = model_dir / INDEX_FILE
    if index_path.is_file():
        weight_map = json.loads(index_path.read_text(encoding="utf-8")).get("weight_map", {})
        files = {name: model_dir / file for name, file in weight_map.items()}
        missing = sorted({str(p.name) for p in files.values() if not p.is_file()})
        if missing:
            raise StartupError(f"{INDEX_FILE} names missing files: {', '.join(missing)}")
        return files
    paths = sorted(model_dir.glob("*.safetensors"))
    if not paths:
        raise StartupError(f"no safetensors weights found in {model_dir}")
    files = {}
    for path in paths:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                if name in files:
                    raise StartupError(f"weight '{name}' appears in more than one file")
                files[name] = path
    return files
