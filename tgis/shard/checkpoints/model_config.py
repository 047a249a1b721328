"""Read a model directory's ``config.json`` and ``generation_config.json`` (no transformers).

Only the fields every architecture shares live here; each model class parses its own
architecture-specific fields from ``raw``. A vision-language checkpoint is read as its
language model (``text_config.text_model_config``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tgis.model_files import MAX_SEQUENCE_LENGTH_KEYS
from tgis.shard.checkpoints.text_config import text_model_config
from tgis.shard.errors import StartupError


@dataclass(frozen=True)
class ModelConfig:
    """The architecture-independent facts of a Hugging Face model directory."""

    model_dir: Path
    model_type: str
    architecture: str
    vocab_size: int
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]
    torch_dtype: str | None  # the checkpoint's dtype name, if the config says
    raw: dict[str, Any]

    @classmethod
    def from_dir(cls, model_dir: Path) -> ModelConfig:
        """Parse ``model_dir/config.json`` (and ``generation_config.json`` when present)."""
        raw = _read_json(model_dir / "config.json")
        if raw is None:
            raise StartupError(f"no config.json in {model_dir}")
        raw = text_model_config(raw)
        architectures = raw.get("architectures") or []
        model_type = str(raw.get("model_type", ""))
        if not architectures and not model_type:
            raise StartupError(
                f"{model_dir}/config.json names neither architectures nor model_type"
            )
        generation = _read_json(model_dir / "generation_config.json") or {}
        eos = _as_ids(raw.get("eos_token_id"))
        eos += tuple(i for i in _as_ids(generation.get("eos_token_id")) if i not in eos)
        vocab_size = raw.get("vocab_size")
        if not isinstance(vocab_size, int) or vocab_size < 1:
            raise StartupError(f"{model_dir}/config.json has no valid vocab_size")
        dtype = raw.get("dtype") or raw.get("torch_dtype")
        return cls(
            model_dir=model_dir,
            model_type=model_type,
            architecture=str(architectures[0]) if architectures else "",
            vocab_size=vocab_size,
            max_position_embeddings=_max_positions(raw),
            eos_token_ids=eos,
            torch_dtype=str(dtype) if dtype else None,
            raw=raw,
        )


def _max_positions(raw: dict[str, Any]) -> int:
    """The first integer among TGIS's max-sequence-length keys (0 if none)."""
    for key in MAX_SEQUENCE_LENGTH_KEYS:
        value = raw.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return 0


def _read_json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise StartupError(f"cannot read {path}: {e}") from None
    if not isinstance(data, dict):
        raise StartupError(f"{path} does not hold a JSON object")
    return data


def _as_ids(value: Any) -> tuple[int, ...]:
    """An ``eos_token_id`` value (absent, an int or a list of ints) as a tuple."""
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    if isinstance(value, list):
        return tuple(dict.fromkeys(int(v) for v in value if v is not None))
    raise StartupError(f"unexpected eos_token_id value {value!r}")
