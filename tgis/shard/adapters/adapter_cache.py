"""The adapters a request can name by ``adapter_id`` (``ADAPTER_CACHE``, as in
vllm-tgis-adapter): what each one is, loaded once and kept ready for the step.

``<ADAPTER_CACHE>/<id>/`` is a PEFT adapter directory; its ``adapter_config.json`` says what
it is. A LoRA adapter is read onto this rank's LoRA sites (``lora_store.read_lora``) and
kept in a small LRU (``max_cached`` adapters; one a sequence still holds stays alive with
it, and a later ``lora()`` simply reads it again). A prompt-tuning adapter is a prompt
prefix by another name: its embeddings come from a ``PrefixStore`` over the same
directory, which has its own cache.

Ids follow the store's path rule (``store_paths``). Every refusal is a StoreError whose
``message`` is what the client is shown, in vllm-tgis-adapter's words; its kind picks the
gRPC status (NOT_FOUND or INVALID_ARGUMENT). Loads happen off the step thread through the
router's ``AdapterLookup``; many callers asking for one id at once share one read, and
failures are not remembered.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from tgis.shard.adapters.lora_layout import LoraSite, LoraWeights
from tgis.shard.adapters.lora_store import WEIGHT_FILES, read_lora
from tgis.shard.adapters.prefix_store import PrefixStore
from tgis.shard.adapters.single_flight import SingleFlight
from tgis.shard.adapters.store_paths import (
    BadIdError,
    ItemStore,
    StoreError,
    StoreErrorKind,
    invalid,
)
from tgis.shard.adapters.stored_files import digest, version_of
from tgis.shard_api.messages import AdapterInfo, AdapterKind

CONFIG_FILE = "adapter_config.json"

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadedAdapter:
    """One adapter, ready: what it is (with the version of its contents) and a LoRA
    adapter's weights or a prompt-tuning adapter's embeddings."""

    info: AdapterInfo
    lora: LoraWeights | None = None
    prompt: torch.Tensor | None = None


def _lora(weights: LoraWeights) -> LoadedAdapter:
    return LoadedAdapter(AdapterInfo(AdapterKind.LORA, version=weights.version), lora=weights)


class AdapterCache:
    """PEFT adapters by id from ``root``; thread-safe."""

    def __init__(
        self,
        root: Path,
        sites: Sequence[LoraSite],
        dtype: torch.dtype,
        device: torch.device,
        max_rank: int,
        max_cached: int,
        prefix_store: PrefixStore | None = None,
    ) -> None:
        self.store = ItemStore(Path(root), "adapter")
        self.sites = tuple(sites)  # empty: the model runs no LoRA
        self.dtype = dtype
        self.device = device
        self.max_rank = max_rank
        self.max_cached = max_cached
        self.prefix_store = prefix_store  # None: the model runs no prompt tuning
        self._lock = threading.Lock()
        self._lora: OrderedDict[str, LoraWeights] = OrderedDict()  # oldest first
        self._prompt_ids: set[str] = set()  # prompt tuning seen (embeddings: prefix_store)
        self._loading: SingleFlight[LoadedAdapter] = SingleFlight(self._lock)

    def cached_ids(self) -> list[str]:
        """The LoRA adapters held in the cache, least recently used first."""
        with self._lock:
            return list(self._lora)

    def lookup(self, adapter_id: str) -> AdapterInfo:
        """What ``adapter_id`` is, loading it now unless it is cached; StoreError with the
        client's message when it cannot be used."""
        return self.load(adapter_id).info

    def lora(self, adapter_id: str) -> LoraWeights:
        """The weights of LoRA adapter ``adapter_id`` (read again if it was evicted)."""
        loaded = self.load(adapter_id)
        if loaded.lora is None:
            raise invalid(f"adapter '{adapter_id}' is a prompt-tuning adapter, not LoRA")
        return loaded.lora

    def load(self, adapter_id: str) -> LoadedAdapter:
        """Adapter ``adapter_id``, from the cache or read now (a LoRA adapter evicted since
        is read again); StoreError with the client's message when it cannot be used."""
        with self._lock:
            weights = self._lora.get(adapter_id)
            if weights is not None:
                self._lora.move_to_end(adapter_id)
                return _lora(weights)
            known_prompt = adapter_id in self._prompt_ids
            # A prompt-tuning adapter's embeddings are the prefix store's to load (once).
            flight = None if known_prompt else self._loading.join(adapter_id)
        if flight is not None:
            return self._loading.land(flight, lambda: self._load(adapter_id))
        try:
            return self._prompt(adapter_id)
        except StoreError:
            with self._lock:  # gone or changed: the next lookup starts over
                self._prompt_ids.discard(adapter_id)
            raise

    def _load(self, adapter_id: str) -> LoadedAdapter:
        try:
            item_dir = self.store.resolve(adapter_id)
        except BadIdError:
            raise bad_id(adapter_id) from None
        if not item_dir.is_dir():
            raise not_found(adapter_id, "directory does not exist")
        config_path = self._file(adapter_id, item_dir, CONFIG_FILE)
        if config_path is None:
            raise not_found(adapter_id, f"invalid adapter: no {CONFIG_FILE} found")
        config, config_digest = _read_config(adapter_id, config_path)
        peft_type = config.get("peft_type")
        if peft_type == "LORA":
            return self._load_lora(adapter_id, item_dir, config, config_digest)
        if peft_type == "PROMPT_TUNING":
            return self._load_prompt(adapter_id, item_dir)
        raise invalid(f"adapter type {peft_type} is not currently supported")

    def _load_lora(
        self, adapter_id: str, item_dir: Path, config: dict[str, Any], config_digest: str
    ) -> LoadedAdapter:
        if not self.sites:
            raise invalid("adapter type LORA is not currently supported for this model")
        try:
            weights = read_lora(
                adapter_id,
                item_dir,
                config,
                self.store,
                self.sites,
                self.dtype,
                self.device,
                self.max_rank,
            )
        except BadIdError:
            raise bad_id(adapter_id) from None
        except StoreError as e:
            raise invalid_adapter(adapter_id, e.message) from None
        # The config's scaling is folded into the weights: the version covers both files.
        weights = replace(weights, version=version_of((config_digest, weights.version)))
        logger.info(
            "Loaded LoRA adapter %s: rank %d, %d sites, %.1f MiB",
            adapter_id,
            weights.rank,
            len(weights.pairs),
            weights.nbytes / 2**20,
        )
        with self._lock:
            self._lora[adapter_id] = weights
            while len(self._lora) > max(self.max_cached, 0):
                self._lora.popitem(last=False)
        return _lora(weights)

    def _load_prompt(self, adapter_id: str, item_dir: Path) -> LoadedAdapter:
        if self.prefix_store is None:
            raise invalid("adapter type PROMPT_TUNING is not currently supported for this model")
        if all(self._file(adapter_id, item_dir, name) is None for name in WEIGHT_FILES):
            raise invalid_adapter(adapter_id, "no adapter_model.safetensors or adapter_model.bin")
        loaded = self._prompt(adapter_id)
        with self._lock:
            self._prompt_ids.add(adapter_id)
        return loaded

    def _prompt(self, adapter_id: str) -> LoadedAdapter:
        """A prompt-tuning adapter's embeddings, from the prefix store's cache or disk."""
        assert self.prefix_store is not None
        try:
            prefix = self.prefix_store.get(adapter_id)
        except BadIdError:
            raise bad_id(adapter_id) from None
        except StoreError as e:
            raise invalid_adapter(adapter_id, e.message) from None
        if prefix.decoder is None:  # a PEFT directory always gives a decoder tensor
            raise invalid_adapter(adapter_id, "no prompt embeddings")
        info = AdapterInfo(
            AdapterKind.PROMPT_TUNING, prefix_length=prefix.length, version=prefix.version
        )
        return LoadedAdapter(info, prompt=prefix.decoder)

    def _file(self, adapter_id: str, item_dir: Path, name: str) -> Path | None:
        try:
            return self.store.file(item_dir, name, adapter_id)
        except BadIdError:
            raise bad_id(adapter_id) from None


def bad_id(adapter_id: str) -> StoreError:
    """An id the path rule refuses (vllm-tgis-adapter's wording, for every such case)."""
    return invalid(
        f"Invalid adapter id '{adapter_id}', must contain only alphanumeric, _ and - and /"
    )


def not_found(adapter_id: str, reason: str) -> StoreError:
    """Nothing usable stored under a valid id."""
    return StoreError(
        StoreErrorKind.NOT_FOUND, f"can't retrieve adapter with id '{adapter_id}': {reason}"
    )


def invalid_adapter(adapter_id: str, reason: str) -> StoreError:
    """An adapter that is there but cannot be used, for ``reason``."""
    return invalid(f"can't retrieve adapter with id '{adapter_id}': invalid adapter: {reason}")


def _read_config(adapter_id: str, path: Path) -> tuple[dict[str, Any], str]:
    """The parsed ``adapter_config.json`` and the digest of its bytes."""
    try:
        data = path.read_bytes()
        config = json.loads(data.decode("utf-8"))
    except json.JSONDecodeError as e:
        raise invalid_adapter(adapter_id, f"{CONFIG_FILE} is not valid JSON ({e})") from None
    except UnicodeDecodeError:
        raise invalid_adapter(adapter_id, f"{CONFIG_FILE} is not valid UTF-8") from None
    except OSError as e:
        logger.warning("cannot read %s: %s", path, e)
        raise invalid_adapter(adapter_id, f"cannot read {CONFIG_FILE}") from None
    if not isinstance(config, dict):
        raise invalid_adapter(adapter_id, f"{CONFIG_FILE} is not a JSON object")
    return config, digest(data)
