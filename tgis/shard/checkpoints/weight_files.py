"""Which files of a model directory are its weights, and whether a set of them is complete.

The rules follow TGIS: weight files are the top-level files with the requested extension
(names containing ``arguments``, ``args``, ``training``, ``optimizer`` or ``scheduler`` are
training artefacts, not weights); an index (``*.safetensors.index.json``) names the files of
a sharded set, which is complete when every one of them is there. Meta files are the
configuration, tokenizer and generation files fetched along with the weights. Shared by
``hub`` (what to fetch, what the cache already holds) and ``convert`` (what to convert).
"""

from __future__ import annotations

import json
from pathlib import Path

SAFETENSORS = ".safetensors"
PYTORCH = ".bin"
META_EXTENSIONS = (".json", ".py", ".model", ".md")
# Tokenizer files whose extension is not one of META_EXTENSIONS (BPE merges, WordPiece vocab).
TOKENIZER_FILES = ("merges.txt", "vocab.txt")
# TGIS's filter: files with these words in their name are training artefacts, not weights.
NON_INFERENCE_WORDS = ("arguments", "args", "training", "optimizer", "scheduler")


class WeightsError(Exception):
    """A one-line, user-facing reason why the weights cannot be prepared."""


class AlreadyConverted(WeightsError):
    """convert-to-safetensors: the directory already holds safetensors weights."""


def is_inference_file(name: str) -> bool:
    """False for training artefacts (``training_args.bin``, ``optimizer.bin`` ...)."""
    return not any(word in name for word in NON_INFERENCE_WORDS)


def is_weight_file(name: str, extension: str) -> bool:
    """A top-level weight file name with this extension (not an index, not training state)."""
    return (
        "/" not in name
        and name.endswith(extension)
        and not name.endswith(".index.json")
        and is_inference_file(name)
    )


def index_file_name(name: str, extension: str) -> bool:
    """A top-level index of weight files with this extension (``*.safetensors.index.json``)."""
    return "/" not in name and name.endswith(f"{extension}.index.json") and is_inference_file(name)


def is_meta_file(name: str) -> bool:
    """Configuration, tokenizer and generation files fetched along with the weights."""
    return (
        "/" not in name
        and is_inference_file(name)
        and (name.endswith(META_EXTENSIONS) or name in TOKENIZER_FILES)
    )


def local_weight_files(directory: Path, extension: str) -> list[Path]:
    """The weight files with ``extension`` directly inside ``directory`` (sorted)."""
    if not directory.is_dir():
        return []
    return sorted(
        p for p in directory.iterdir() if is_weight_file(p.name, extension) and p.is_file()
    )


def missing_indexed_files(directory: Path, extension: str) -> list[str]:
    """Files an index of ``extension`` weights names that are not in ``directory``."""
    missing: set[str] = set()
    for index in directory.glob(f"*{extension}.index.json"):
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map", {})
        except (OSError, ValueError, AttributeError):
            missing.add(index.name)  # unreadable index: treat the set as incomplete
            continue
        missing.update(f for f in set(weight_map.values()) if not (directory / f).is_file())
    return sorted(missing)


def complete_weight_files(directory: Path, extension: str) -> list[Path]:
    """The ``extension`` weight files of ``directory``; [] when none or the set is incomplete."""
    files = local_weight_files(directory, extension)
    if not files or missing_indexed_files(directory, extension):
        return []
    return files


def bin_sources(model_dir: Path) -> list[Path]:
    """The .bin weight files convert-to-safetensors would convert (checked without torch).

    Raises AlreadyConverted when safetensors weights exist (remove them to re-convert) and
    WeightsError when there is nothing (complete) to convert.
    """
    existing = local_weight_files(model_dir, SAFETENSORS)
    if existing:
        names = ", ".join(p.name for p in existing[:3]) + (" ..." if len(existing) > 3 else "")
        raise AlreadyConverted(
            f"{model_dir} already has .safetensors weights ({names}); remove them first to "
            "re-convert"
        )
    sources = local_weight_files(model_dir, PYTORCH)
    if not sources:
        raise WeightsError(f"no PyTorch .bin weight files to convert in {model_dir}")
    missing = missing_indexed_files(model_dir, PYTORCH)
    if missing:
        raise WeightsError(
            f"the .bin index of {model_dir} names missing files: {', '.join(missing)}"
        )
    return sources
