"""Load tensors by their Hugging Face names from a directory of safetensors files.

Handles a single ``model.safetensors`` and sharded checkpoints with
``model.safetensors.index.json``. Tensors are read lazily (memory-mapped) straight onto
the target device and cast to the target dtype. With tensor parallelism each rank reads
only its slice of a sharded tensor (``get_sharded``, ``get_rows``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from tgis.shard.errors import StartupError
from tgis.shard.parallel.group import SINGLE, TensorParallel

INDEX_FILE = "model.safetensors.index.json"


class Weights:
    """Name → tensor access over every safetensors file of a model directory."""

    def __init__(
        self,
        model_dir: Path,
        device: torch.device,
        dtype: torch.dtype,
        tp: TensorParallel = SINGLE,
    ) -> None:
        self.device = device
        self.dtype = dtype
        self.tp = tp
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

    def _cast(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.is_floating_point() and tensor.dtype != self.dtype:
            tensor = tensor.to(self.dtype)
        return tensor.contiguous()

    def shape(self, name: str) -> tuple[int, ...]:
        """The full (unsharded) shape of ``name``, read from the file header."""
        return tuple(self._handle(name).get_slice(name).get_shape())

    def get(self, name: str) -> torch.Tensor:
        """The whole tensor ``name`` on the target device; floating tensors cast to the dtype."""
        return self._cast(self._handle(name).get_tensor(name))

    def get_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of ``name`` (dimension 0), reading only those rows."""
        return self._cast(self._handle(name).get_slice(name)[start:stop])

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
        return self._cast(torch.cat([view[start:stop] for start, stop in merged]))

    def get_sharded(self, name: str, dim: int) -> torch.Tensor:
        """This rank's equal part of ``name`` along ``dim`` (0 or 1); the whole tensor with
        one rank. Reads only the slice from the file."""
        if not self.tp.is_parallel:
            return self.get(name)
        size = self.shape(name)[dim]
        start, stop = self.tp.split(size, f"dimension {dim} of {name}")
        view = self._handle(name).get_slice(name)
        return self._cast(view[start:stop] if dim == 0 else view[:, start:stop])

    def close(self) -> None:
        """Drop the file handles (the loaded tensors stay valid)."""
        self._handles.clear()


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
