"""TGIS prompt-tuning prefixes (``prefix_id``): load, check and cache them (§10.4).

A prefix lives in ``<PREFIX_STORE_PATH>/<id>/`` as ``decoder.pt`` and/or ``encoder.pt``
(2-D tensors saved with ``torch.save``, read with ``weights_only=True``), or as a PEFT
prompt-tuning adapter (``adapter_model.safetensors`` or ``adapter_model.bin`` holding
``prompt_embeddings``; decoder-only models only). Each tensor is checked and converted to
the serving dtype with TGIS's messages, then kept in an LRU cache bounded by bytes
(``PROMPT_CACHE_SIZE_MB``). A prefix many threads ask for at once is read once.

For encoder-decoder models (the transformers fallback, ``fallback/seq2seq.py``) the
engine appends the decoder-start embedding to ``decoder`` and puts ``encoder`` before the
input's embeddings.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tgis.shard.adapters.single_flight import SingleFlight
from tgis.shard.adapters.store_paths import ItemStore, StoreError, StoreErrorKind, invalid
from tgis.shard.adapters.stored_files import read_tensors, version_of

SIZE_UNIT = 512  # TGIS rounds every tensor's size up to a multiple of 512 bytes
DECODER_FILE = "decoder.pt"
ENCODER_FILE = "encoder.pt"
PEFT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
PEFT_KEY = "prompt_embeddings"

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PrefixEmbeddings:
    """One prefix's tensors, checked, in the serving dtype, on the serving device."""

    decoder: torch.Tensor | None
    encoder: torch.Tensor | None = None
    version: str = ""  # of the files read (``stored_files.version_of``)

    @property
    def length(self) -> int:
        """Virtual tokens: the rows of both tensors (without a decoder-start embedding)."""
        return sum(t.shape[0] for t in self._tensors())

    @property
    def nbytes(self) -> int:
        """The cache space it takes: each tensor rounded up to 512 bytes, as TGIS counts."""
        return sum(_rounded_size(t) for t in self._tensors())

    def _tensors(self) -> tuple[torch.Tensor, ...]:
        return tuple(t for t in (self.decoder, self.encoder) if t is not None)


@dataclass(frozen=True)
class PrefixLoad:
    """One read of a prefix from disk (cache misses only), for the load metrics."""

    prefix_id: str
    seconds: float
    error: Exception | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


LoadHook = Callable[[PrefixLoad], None]


@dataclass(frozen=True)
class TensorRules:
    """What every prefix tensor must satisfy for this model."""

    embedding_dim: int
    dtype: torch.dtype
    max_length: int
    is_encoder_decoder: bool

    def check(self, value: Any) -> torch.Tensor:
        """``value`` as a 2-D tensor of the serving dtype, or StoreError with TGIS's message."""
        if not isinstance(value, torch.Tensor) or value.dim() != 2:
            raise invalid("Invalid prefix embedding tensor")
        length, dim = value.shape
        if length == 0 or length > self.max_length:
            raise invalid(f"Invalid prefix embedding length of {length}")
        if self.is_encoder_decoder and length % 2 != 0:
            raise invalid("Encoder/decoder prefix tensor must be of even length")
        if dim != self.embedding_dim:
            raise invalid(
                f"Prefix embedding tensor dim {dim} does not match model ({self.embedding_dim})"
            )
        converted = value.to(self.dtype)
        if not bool(converted.isfinite().all()):
            if not bool(value.isfinite().all()):
                raise invalid("Prefix contains non-finite elements")
            raise invalid(
                "Prefix contains non-finite elements after conversion "
                f"from {value.dtype} to {self.dtype}"
            )
        return converted


class PrefixStore:
    """Prefixes by id from a store directory, through a thread-safe LRU cache of bytes."""

    def __init__(
        self,
        store_path: Path,
        embedding_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        max_length: int,
        cache_bytes: int,
        is_encoder_decoder: bool = False,
        on_load: LoadHook | None = None,
    ) -> None:
        self.store = ItemStore(Path(store_path), "prefix")
        self.rules = TensorRules(embedding_dim, dtype, max_length, is_encoder_decoder)
        self.device = device
        self.cache_bytes = cache_bytes
        self.on_load = on_load
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, PrefixEmbeddings] = OrderedDict()  # oldest first
        self._used = 0
        self._loading: SingleFlight[PrefixEmbeddings] = SingleFlight(self._lock)

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return self._used

    def cached_ids(self) -> list[str]:
        """The cached ids, least recently used first."""
        with self._lock:
            return list(self._entries)

    def get(self, prefix_id: str) -> PrefixEmbeddings:
        """The prefix ``prefix_id``, from the cache or read from disk (once, however many
        threads ask at the same time). Raises StoreError; failures are not cached."""
        with self._lock:
            hit = self._entries.get(prefix_id)
            if hit is not None:
                self._entries.move_to_end(prefix_id)
                return hit
            flight = self._loading.join(prefix_id)
        return self._loading.land(flight, lambda: self._load_and_insert(prefix_id))

    def _load_and_insert(self, prefix_id: str) -> PrefixEmbeddings:
        start = time.perf_counter()
        try:
            prefix = self._load(prefix_id)
            self._insert(prefix_id, prefix)
        except Exception as e:
            self._report(PrefixLoad(prefix_id, time.perf_counter() - start, e))
            raise
        self._report(PrefixLoad(prefix_id, time.perf_counter() - start))
        return prefix

    def _report(self, load: PrefixLoad) -> None:
        if self.on_load is not None:
            self.on_load(load)

    def _insert(self, prefix_id: str, prefix: PrefixEmbeddings) -> None:
        size = prefix.nbytes
        if size > self.cache_bytes:
            raise invalid(
                f"Prefix ID object {prefix_id} exceeds the allowed cache size", "ValueError"
            )
        with self._lock:
            while self._used + size > self.cache_bytes:
                _, evicted = self._entries.popitem(last=False)
                self._used -= evicted.nbytes
            self._entries[prefix_id] = prefix
            self._used += size

    def _load(self, prefix_id: str) -> PrefixEmbeddings:
        item_dir = self.store.resolve(prefix_id)
        if _is_peft(item_dir):
            return self._load_peft(prefix_id, item_dir)
        decoder, decoder_digest = self._read(prefix_id, item_dir, DECODER_FILE)
        encoder, encoder_digest = (
            self._read(prefix_id, item_dir, ENCODER_FILE)
            if self.rules.is_encoder_decoder
            else (None, "")
        )
        if decoder is None and encoder is None:
            raise not_found(prefix_id)
        version = version_of((decoder_digest, encoder_digest))
        return PrefixEmbeddings(decoder=decoder, encoder=encoder, version=version)

    def _load_peft(self, prefix_id: str, item_dir: Path) -> PrefixEmbeddings:
        if self.rules.is_encoder_decoder:
            raise invalid("encoder-decoder architectures not supported for peft models")
        for name in PEFT_FILES:
            path = self.store.file(item_dir, name, prefix_id)
            if path is not None:
                state, file_digest = _read_file(prefix_id, path)
                if not isinstance(state, dict) or PEFT_KEY not in state:
                    raise invalid(f"{name} of prefix {prefix_id} has no {PEFT_KEY} tensor")
                decoder = self._checked(state[PEFT_KEY])
                return PrefixEmbeddings(decoder=decoder, version=version_of((file_digest,)))
        raise not_found(prefix_id)

    def _read(self, prefix_id: str, item_dir: Path, name: str) -> tuple[torch.Tensor | None, str]:
        """File ``name``'s tensor, checked, and the digest of its bytes (None, "" when it is
        not there)."""
        path = self.store.file(item_dir, name, prefix_id)
        if path is None:
            return None, ""
        value, file_digest = _read_file(prefix_id, path)
        return self._checked(value), file_digest

    def _checked(self, value: Any) -> torch.Tensor:
        return self.rules.check(value).to(self.device).contiguous()


def not_found(prefix_id: str) -> StoreError:
    """The error for a valid id with nothing stored under it (TGIS's router wording)."""
    return StoreError(StoreErrorKind.NOT_FOUND, f'prefix id "{prefix_id}" not found')


def _is_peft(item_dir: Path) -> bool:
    """TGIS's test: the directory holds some ``adapter_model.*`` file."""
    if not item_dir.is_dir():
        return False
    return any(p.stem == "adapter_model" for p in item_dir.iterdir())


def _read_file(prefix_id: str, path: Path) -> tuple[Any, str]:
    """A ``.safetensors`` file as a dict, anything else through ``torch.load`` with
    ``weights_only=True``, with the digest of its bytes; unreadable files fail with
    StoreError(INVALID)."""
    try:
        return read_tensors(path)
    except Exception as e:
        logger.warning("cannot read %s: %s", path, e)
        raise invalid(
            f"cannot read {path.name} of prefix {prefix_id} ({type(e).__name__})"
        ) from None


def _rounded_size(tensor: torch.Tensor) -> int:
    raw = tensor.element_size() * tensor.nelement()
    return math.ceil(raw / SIZE_UNIT) * SIZE_UNIT
