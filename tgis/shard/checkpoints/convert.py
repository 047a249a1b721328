"""Convert PyTorch ``.bin`` checkpoints to safetensors, in place, the way TGIS does.

Every top-level ``*.bin`` weight file of a model directory (``pytorch_model.bin``,
``pytorch_model-00001-of-00002.bin`` ...; training artefacts such as ``training_args.bin``
are skipped) becomes the same name without the ``pytorch_`` prefix and with the
``.safetensors`` extension, next to it. A sharded checkpoint (several files, or a
``*.bin.index.json``) also gets ``model.safetensors.index.json`` mapping every tensor name to
its new file.

Files are loaded with ``torch.load(weights_only=True)`` (no arbitrary pickles). Safetensors
cannot store tensors that share memory, so for every group of names on one storage:

* names that are the same view of a tensor another kept name holds, and that the model's
  config ties (``tie_word_embeddings`` → ``lm_head.weight`` and the class's
  ``_tied_weights_keys``), are dropped, as ``transformers`` does on save; the file's metadata
  records ``{dropped: kept}`` (TGIS's convention) and the loader re-ties them;
* every other name gets its own copy.

Each file is written under a temporary name, read back and compared bit for bit with the
original tensors, and only then renamed; the index is written last.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from tgis.shard.checkpoints.weight_files import (
    PYTORCH,
    SAFETENSORS,
    AlreadyConverted,
    WeightsError,
    bin_sources,
    index_file_name,
)

__all__ = ["AlreadyConverted", "ConversionError", "ConvertedFile", "convert_directory"]

SAFETENSORS_INDEX = "model.safetensors.index.json"
_PARTIAL_SUFFIX = ".partial"

Report = Callable[[str], None]


class ConversionError(WeightsError):
    """The checkpoint cannot be converted; the message says why (one line)."""


@dataclass
class ConvertedFile:
    """One .bin file and what it became."""

    source: Path
    target: Path
    tensors: list[str] = field(default_factory=list)  # names stored in the target
    dropped: dict[str, str] = field(default_factory=dict)  # tied name → the name kept
    copied: list[str] = field(default_factory=list)  # names given their own storage
    nbytes: int = 0

    def summary(self) -> str:
        """One report line: the file, its tensors, the tied names dropped and the copies."""
        details = [f"{len(self.tensors)} tensors"]
        if self.dropped:
            details.append(
                "dropped tied " + ", ".join(f"{k} (= {v})" for k, v in self.dropped.items())
            )
        if self.copied:
            details.append(f"copied {len(self.copied)} shared tensor(s)")
        return f"{self.source.name} → {self.target.name}: {'; '.join(details)}"


def safetensors_name(bin_name: str) -> str:
    """``pytorch_model-00001-of-00002.bin`` → ``model-00001-of-00002.safetensors``."""
    return bin_name.removesuffix(PYTORCH).removeprefix("pytorch_") + SAFETENSORS


def _discard(_: str) -> None:
    return None


def convert_directory(
    model_dir: Path, *, report: Report = _discard, progress: bool = True
) -> list[ConvertedFile]:
    """Convert every .bin weight file of ``model_dir``; return what was written.

    Raises AlreadyConverted when safetensors weights exist (remove them to re-convert),
    WeightsError when there is nothing complete to convert, and ConversionError for anything
    that prevents a faithful conversion. On error only the original files are left.
    """
    sources = bin_sources(model_dir)
    bin_indexes = [p for p in model_dir.iterdir() if index_file_name(p.name, PYTORCH)]
    targets = [model_dir / safetensors_name(p.name) for p in sources]
    if len(set(targets)) != len(targets):
        raise ConversionError(
            f"the .bin files of {model_dir} would convert to clashing safetensors names"
        )

    tied = TiedNames(model_dir)
    converted: list[ConvertedFile] = []
    written: list[Path] = []
    try:
        for number, (source, target) in enumerate(zip(sources, targets, strict=True), 1):
            partial = target.with_name("." + target.name + _PARTIAL_SUFFIX)
            written.append(partial)
            desc = f"[{number}/{len(sources)}] {source.name} → {target.name}"
            converted.append(_convert_file(source, target, partial, tied, desc, progress))
        index_partial: Path | None = None
        if len(converted) > 1 or bin_indexes:
            index_partial = model_dir / ("." + SAFETENSORS_INDEX + _PARTIAL_SUFFIX)
            written.append(index_partial)
            _write_index(index_partial, converted, bin_indexes)
        for file in converted:
            os.replace(file.target.with_name("." + file.target.name + _PARTIAL_SUFFIX), file.target)
        if index_partial is not None:
            os.replace(index_partial, model_dir / SAFETENSORS_INDEX)
    except BaseException:
        for path in written:
            path.unlink(missing_ok=True)
        raise
    for file in converted:
        report(file.summary())
    return converted


class TiedNames:
    """Which tensor names the model's config ties to another (only read when needed)."""

    def __init__(self, model_dir: Path) -> None:
        self.model_dir = model_dir

    def __call__(self, name: str) -> bool:
        exact, patterns = self._names
        return name in exact or any(p.fullmatch(name) for p in patterns)

    @cached_property
    def _names(self) -> tuple[set[str], list[re.Pattern[str]]]:
        """Exact names, and the keys that are regular expressions (transformers 5 allows)."""
        try:
            raw = json.loads((self.model_dir / "config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return set(), []
        if not isinstance(raw, dict) or not _ties_word_embeddings(raw, self.model_dir):
            return set(), []
        exact: set[str] = {"lm_head.weight"}
        for architecture in raw.get("architectures") or []:
            exact.update(_class_tied_keys(str(architecture)))
        patterns: list[re.Pattern[str]] = []
        for key in exact:
            if re.fullmatch(r"[\w.]+", key):
                continue
            with contextlib.suppress(re.error):
                patterns.append(re.compile(key))
        return exact, patterns


def _ties_word_embeddings(raw: dict[str, Any], model_dir: Path) -> bool:
    value = raw.get("tie_word_embeddings")
    if isinstance(value, bool):
        return value
    # Not in config.json: the config class's default decides (True for most, False for Llama).
    try:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
        text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
        return bool(getattr(text_config, "tie_word_embeddings", False))
    except Exception:
        return False  # unknown: keep (copy) rather than drop


def _class_tied_keys(architecture: str) -> list[str]:
    try:
        import transformers

        cls = getattr(transformers, architecture, None)
    except Exception:
        return []
    keys = getattr(cls, "_tied_weights_keys", None)
    if isinstance(keys, dict):  # transformers 5: {tied name: source name}
        return [str(k) for k in keys]
    if isinstance(keys, list | tuple | set):
        return [str(k) for k in keys]
    return []


def _load_state_dict(path: Path) -> dict[str, torch.Tensor]:
    try:
        try:
            loaded = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as e:
            if "mmap" not in str(e):
                raise
            loaded = torch.load(path, map_location="cpu", weights_only=True)  # legacy format
    except Exception as e:
        raise ConversionError(
            f"cannot load {path.name} with torch.load(weights_only=True): "
            f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
        ) from None
    if isinstance(loaded, dict) and isinstance(loaded.get("state_dict"), dict):
        loaded = loaded["state_dict"]
    if not isinstance(loaded, dict):
        raise ConversionError(f"{path.name} does not hold a state dict ({type(loaded).__name__})")
    tensors = {str(k): v for k, v in loaded.items() if isinstance(v, torch.Tensor)}
    if not tensors:
        raise ConversionError(f"{path.name} holds no tensors")
    return tensors


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.storage_offset() == b.storage_offset()
    )


def _unshare(
    tensors: dict[str, torch.Tensor], tied: Callable[[str], bool]
) -> tuple[dict[str, torch.Tensor], dict[str, str], list[str]]:
    """Drop tied duplicates and copy the other names that share storage."""
    groups: dict[tuple[str, int], list[str]] = defaultdict(list)
    for name, tensor in tensors.items():
        if tensor.numel() == 0:
            continue
        groups[(tensor.device.type, tensor.untyped_storage().data_ptr())].append(name)
    dropped: dict[str, str] = {}
    copied: list[str] = []
    result = dict(tensors)
    for names in groups.values():
        if len(names) < 2:
            continue
        names = sorted(names)
        keepers = [n for n in names if not tied(n)]
        for name in names:
            if name in keepers:
                continue
            twin = next((k for k in keepers if _same_view(tensors[k], tensors[name])), None)
            if twin is not None:
                dropped[name] = twin
        remaining = [n for n in names if n not in dropped]
        for name in remaining[1:]:
            result[name] = tensors[name].clone(memory_format=torch.contiguous_format)
            copied.append(name)
    for name in dropped:
        del result[name]
    return {k: v.contiguous() for k, v in result.items()}, dropped, copied


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    try:
        return torch.equal(
            a.contiguous().reshape(-1).view(torch.uint8),
            b.contiguous().reshape(-1).view(torch.uint8),
        )
    except RuntimeError:
        return torch.equal(a, b)


def _convert_file(
    source: Path,
    target: Path,
    partial: Path,
    tied: Callable[[str], bool],
    desc: str,
    progress: bool,
) -> ConvertedFile:
    original = _load_state_dict(source)
    bar = tqdm(total=2 * len(original), desc=desc, unit="tensor", disable=not progress)
    try:
        bar.set_postfix_str("load")
        tensors, dropped, copied = _unshare(original, tied)
        bar.update(len(original))
        bar.set_postfix_str("write")
        metadata = {"format": "pt", **dropped}
        try:
            save_file(tensors, str(partial), metadata=metadata)
        except OSError as e:
            raise ConversionError(f"cannot write {partial}: {e}") from None
        bar.set_postfix_str("verify")
        with safe_open(str(partial), framework="pt", device="cpu") as f:
            stored = set(f.keys())
            if stored != set(tensors):
                raise ConversionError(f"{target.name} does not hold the expected tensor names")
            for name, tensor in original.items():
                reloaded = f.get_tensor(dropped.get(name, name))
                if not _bitwise_equal(tensor, reloaded):
                    raise ConversionError(
                        f"tensor '{name}' of {source.name} does not read back equal from "
                        f"{target.name}"
                    )
                bar.update(1)
        bar.set_postfix_str("done")
    finally:
        bar.close()
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    return ConvertedFile(source, target, sorted(tensors), dropped, sorted(copied), nbytes)


def _write_index(path: Path, converted: list[ConvertedFile], bin_indexes: list[Path]) -> None:
    weight_map: dict[str, str] = {}
    dropped: set[str] = set()
    for file in converted:
        for name in file.tensors:
            if name in weight_map:
                raise ConversionError(
                    f"tensor '{name}' is in both {weight_map[name]} and {file.target.name}"
                )
            weight_map[name] = file.target.name
        dropped.update(file.dropped)
    for index in bin_indexes:
        try:
            listed = json.loads(index.read_text(encoding="utf-8")).get("weight_map", {})
        except (OSError, ValueError, AttributeError) as e:
            raise ConversionError(f"cannot read {index.name}: {e}") from None
        lost = sorted(n for n in listed if n not in weight_map and n not in dropped)
        if lost:
            more = f" (+{len(lost) - 5} more)" if len(lost) > 5 else ""
            raise ConversionError(
                f"{index.name} lists tensors not found in the .bin files: "
                f"{', '.join(lost[:5])}{more}"
            )
    index_data = {
        "metadata": {"total_size": sum(f.nbytes for f in converted)},
        "weight_map": dict(sorted(weight_map.items())),
    }
    path.write_text(json.dumps(index_data, indent=2) + "\n", encoding="utf-8")
