"""Load tensors by their Hugging Face names from a directory of safetensors files.

Handles a single ``model.safetensors`` and sharded checkpoints with
``model.safetensors.index.json``. Tensors are read lazily (memory-mapped) straight onto
the target device and cast to the target dtype. A later tensor-parallel loader can add
``get_sharded(name, dim)`` here, reading only this rank's slice.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from tgis.shard.errors import StartupError

INDEX_FILE = "model.safetensors.index.json"


class Weights:
    """Name → tensor access over every safetensors file of a model directory."""

    def __init__(self, model_dir: Path, device: torch.device, dtype: torch.dtype) -> None:
        self.device = device
        self.dtype = dtype
        self._file_of = _index(model_dir)
        self._handles: dict[Path, Any] = {}

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def get(self, name: str) -> torch.Tensor:
        """The tensor ``name`` on the target device; floating tensors cast to the dtype."""
        path = self._file_of.get(name)
        if path is None:
            raise StartupError(f"weight '{name}' not found in the safetensors files")
        handle = self._handles.get(path)
        if handle is None:
            handle = safe_open(str(path), framework="pt", device=str(self.device))
            self._handles[path] = handle
        tensor: torch.Tensor = handle.get_tensor(name)
        if tensor.is_floating_point() and tensor.dtype != self.dtype:
            tensor = tensor.to(self.dtype)
        return tensor

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
