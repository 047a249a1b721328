"""Files of a prefix or adapter read together with a digest of their bytes, so that what
the shard computes with has a version that changes when the store is rewritten.

The version of a prompt-tuning prefix or an adapter is a digest of the very bytes that were
parsed (read once, hashed, then parsed from memory), so it can never describe other contents
than the ones loaded, even when a file is replaced while it is read. The router's prefix
cache keys KV blocks by these versions (``router/core/prefix_cache.py``).
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as load_safetensors

__all__ = ["digest", "read_tensors", "version_of"]

VERSION_CHARS = 16
"""Hex characters of a version (64 bits of SHA-256)."""


def digest(data: bytes) -> str:
    """The SHA-256 of ``data``, in hex."""
    return hashlib.sha256(data).hexdigest()


def read_tensors(path: Path) -> tuple[Any, str]:
    """A ``.safetensors`` file as a dict of CPU tensors, anything else through
    ``torch.load(weights_only=True)``, and the digest of the bytes parsed. Raises whatever
    reading or parsing raises (``OSError``, the parsers' errors)."""
    data = path.read_bytes()
    if path.suffix == ".safetensors":
        state: Any = load_safetensors(data)
    else:
        state = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    return state, digest(data)


def version_of(digests: Iterable[str]) -> str:
    """One version for contents read from several files (in a fixed order)."""
    return digest("\n".join(digests).encode())[:VERSION_CHARS]
