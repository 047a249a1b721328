"""Resolve a client-supplied id to a directory inside a store, safely.

One rule for every store a request can name: prompt-tuning prefixes (``PREFIX_STORE_PATH``,
TGIS's ``prefix_id``) and, later, PEFT adapters (``ADAPTER_CACHE``, ``adapter_id``). An id
must fully match ``[/\\w\\-]+``, must not be absolute or contain ``..``, and its real path
(symlinks followed) must stay inside the store's real path. Nested ids (``a/b``) are allowed,
and so are symlinks that lead somewhere else inside the store.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

VALID_ID = re.compile(r"[/\w\-]+")


class StoreErrorKind(enum.Enum):
    """What went wrong, which decides the gRPC status once this is wired into serving."""

    INVALID = "invalid"  # bad id, malformed or oversized content: INVALID_ARGUMENT
    NOT_FOUND = "not_found"  # nothing stored under a valid id: NOT_FOUND


class StoreError(Exception):
    """A request's prefix or adapter cannot be used; fails that request alone."""

    def __init__(self, kind: StoreErrorKind, message: str, tgis_type: str = "Exception") -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        # The Python class TGIS's shard raises for this error; TGIS shows it to clients.
        self.tgis_type = tgis_type

    @property
    def tgis_message(self) -> str:
        """The text TGIS's shard returns for this error (§10.4): not-found messages as they
        are, everything else as ``Unexpected <class '...'>: message``."""
        if self.kind is StoreErrorKind.NOT_FOUND:
            return self.message
        return f"Unexpected <class '{self.tgis_type}'>: {self.message}"


class BadIdError(StoreError):
    """An id refused by the path rule itself (characters, absolute, ``..``, leading out of
    the store), as opposed to a problem with what is stored under a valid id; a store may
    word these its own way (the adapter cache does)."""

    def __init__(self, message: str) -> None:
        super().__init__(StoreErrorKind.INVALID, message)


def invalid(message: str, tgis_type: str = "Exception") -> StoreError:
    """A StoreError of kind INVALID."""
    return StoreError(StoreErrorKind.INVALID, message, tgis_type)


@dataclass(frozen=True)
class ItemStore:
    """A directory of items named by ids; ``noun`` names them in messages (``prefix``)."""

    root: Path
    noun: str = "prefix"

    def resolve(self, item_id: str) -> Path:
        """The real path of ``item_id``'s directory (it need not exist).

        Raises BadIdError (a StoreError of kind INVALID) for ids with other characters,
        absolute ids, ``..`` components, and ids whose real path leaves the store.
        """
        if not VALID_ID.fullmatch(item_id):
            raise BadIdError(
                f"Invalid {self.noun} id {item_id}, must contain only alphanumeric, _ and - and /"
            )
        parts = PurePosixPath(item_id).parts
        if item_id.startswith("/") or ".." in parts:
            raise self._outside(item_id)
        return self._inside(self.root / item_id, item_id)

    def file(self, item_dir: Path, name: str, item_id: str) -> Path | None:
        """The real path of file ``name`` in ``item_dir`` (from ``resolve``), None if there
        is no such regular file; BadIdError if it is a symlink leading out."""
        path = item_dir / name
        if not path.is_file():
            return None
        return self._inside(path, item_id)

    def _inside(self, path: Path, item_id: str) -> Path:
        try:
            root = self.root.resolve()
            real = path.resolve()
        except (OSError, RuntimeError):  # symlink loops
            raise self._outside(item_id) from None
        if real == root or not real.is_relative_to(root):
            raise self._outside(item_id)
        return real

    def _outside(self, item_id: str) -> BadIdError:
        return BadIdError(f"Invalid {self.noun} id {item_id}")
