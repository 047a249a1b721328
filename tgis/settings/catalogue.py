"""Every setting of the three programs, each declared once (``serving.py``, ``batching.py``,
``features.py``, ``engine.py``), and the lookups the programs make in them."""

from __future__ import annotations

from collections import Counter
from typing import Any

from tgis.settings import batching, engine, features, serving
from tgis.settings.declaration import UNSET, Process, Setting

__all__ = ["SETTINGS", "default", "of", "read_by"]

SETTINGS: tuple[Setting, ...] = (
    *serving.SETTINGS,
    *batching.SETTINGS,
    *features.SETTINGS,
    *engine.SETTINGS,
)


def _check_declared_once(settings: tuple[Setting, ...]) -> dict[str, Setting]:
    """Names, flags and variables each belong to one setting (ValueError otherwise)."""
    words = Counter(
        word for s in settings for word in (f"name:{s.name}", *s.flags, *(f"${v}" for v in s.env))
    )
    twice = sorted(word for word, count in words.items() if count > 1)
    if twice:
        raise ValueError(f"declared more than once: {', '.join(twice)}")
    return {s.name: s for s in settings}


_BY_NAME = _check_declared_once(SETTINGS)


def of(name: str) -> Setting:
    """The setting called ``name`` (KeyError if there is none)."""
    return _BY_NAME[name]


def read_by(process: Process) -> tuple[Setting, ...]:
    """The settings ``process`` reads, in declaration order."""
    return tuple(s for s in SETTINGS if s.reads(process))


def default(name: str, process: Process) -> Any:
    """The default ``process`` applies to setting ``name`` (for its config dataclass)."""
    value = of(name).default_for(process)
    if value is UNSET:
        raise KeyError(f"setting {name} has no default")
    return value
