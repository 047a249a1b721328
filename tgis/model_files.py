"""Find a model's files on local disk: the embedded model, a directory, or the local HF cache.

Nothing is ever downloaded here. Used by the launcher (to find config.json and
tokenizer.json) and by the shard (to find the weights); no torch import.
"""

from __future__ import annotations

import os
from pathlib import Path

from tgis.embedded_model import MODEL_DIR as EMBEDDED_MODEL_DIR

MAX_SEQUENCE_LENGTH_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "seq_length",
    "max_sequence_length",
    "max_seq_length",
    "seq_len",
)
"""config.json keys holding the model's context length, in the order TGIS tries them (the
launcher's default ``--max-sequence-length`` and the shard's ``max_position_embeddings``)."""


class ModelNotFoundError(ValueError):
    """The model is neither a local directory nor in the local Hugging Face cache."""


def hf_hub_cache() -> Path:
    """The hub cache directory, as huggingface_hub resolves it (without importing it)."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "TRANSFORMERS_CACHE"):
        value = os.environ.get(var)
        if value:
            return Path(value)
    hf_home = os.environ.get("HF_HOME")
    if hf_home:
        return Path(hf_home) / "hub"
    return Path.home() / ".cache" / "huggingface" / "hub"


def _cached_snapshot(model_id: str, revision: str | None, cache: Path) -> Path | None:
    repo_dir = cache / ("models--" + model_id.replace("/", "--"))
    if not repo_dir.is_dir():
        return None
    ref = revision or "main"
    ref_file = repo_dir / "refs" / ref
    commit = ref_file.read_text().strip() if ref_file.is_file() else ref
    snapshot = repo_dir / "snapshots" / commit
    return snapshot if (snapshot / "config.json").is_file() else None


def resolve_model_dir(model_name: str | None, revision: str | None = None) -> Path:
    """Return the directory holding config.json for `model_name`.

    None or "" selects the embedded tiny model. A path to a directory with config.json
    is used as is. Otherwise the name is looked up as a model id in the local HF cache.
    """
    if not model_name:
        return EMBEDDED_MODEL_DIR
    as_path = Path(model_name).expanduser()
    if (as_path / "config.json").is_file():
        return as_path.resolve()
    cache = hf_hub_cache()
    snapshot = _cached_snapshot(model_name, revision, cache)
    if snapshot is not None:
        return snapshot
    raise ModelNotFoundError(
        f"model '{model_name}' not found: not a directory with config.json and not in the "
        f"local Hugging Face cache ({cache}); nothing is downloaded at serve time"
    )
