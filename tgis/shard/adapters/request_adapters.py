"""``adapter_id`` as the step algorithm sees it: the router's ``AdapterLookup`` answered,
and each new sequence given what its adapter contributes.

A LoRA adapter gives the sequence its weights (``Sequence.lora``, applied row by row by
the native engine, ``native/linear/lora_rows.py``); a prompt-tuning adapter gives it virtual
tokens exactly as a prompt prefix does (``Sequence.prefix``). Both come from this rank's
``AdapterCache`` (``ADAPTER_CACHE``); without one (``NO_ADAPTERS``) every adapter id is
refused.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tgis.shard.adapters.adapter_cache import AdapterCache
from tgis.shard.adapters.lora_layout import LoraWeights
from tgis.shard.adapters.prefixes import PrefixUnavailable, changed_message
from tgis.shard.adapters.store_paths import StoreError, invalid
from tgis.shard_api.messages import AdapterInfo, NewSequence

NO_STORE_MESSAGE = "adapter_id supplied but no adapter store was configured"


@dataclass(frozen=True)
class Adapters:
    """This rank's adapter cache (None: adapters disabled) and how many different LoRA
    adapters one step may hold (what the router is told, ``ShardInfo.max_loras``)."""

    cache: AdapterCache | None = None
    max_loras: int = 0

    @property
    def enabled(self) -> bool:
        return self.cache is not None

    def lookup(self, adapter_id: str) -> AdapterInfo:
        """Load ``adapter_id`` (or find it cached) and say what it is; StoreError with the
        client's message otherwise."""
        if self.cache is None:
            raise invalid(NO_STORE_MESSAGE)
        return self.cache.lookup(adapter_id)

    def for_sequence(self, ns: NewSequence) -> tuple[torch.Tensor | None, LoraWeights | None]:
        """``ns``'s adapter as (prompt-tuning embeddings, None) or (None, LoRA weights);
        PrefixUnavailable (the sequence fails alone) when it cannot be used, or is no longer
        what the router looked up (virtual tokens, ``ns.adapter_version``)."""
        if self.cache is None:
            raise PrefixUnavailable(NO_STORE_MESSAGE)
        try:
            loaded = self.cache.load(ns.adapter_id)
        except StoreError as e:
            raise PrefixUnavailable(e.message) from None
        if ns.adapter_version and loaded.info.version != ns.adapter_version:
            raise PrefixUnavailable(changed_message(f"adapter '{ns.adapter_id}'"))
        if loaded.lora is not None:
            return None, loaded.lora
        if ns.prefix_id:
            raise PrefixUnavailable("prefix_id and a prompt-tuning adapter_id cannot be combined")
        embeddings = loaded.prompt
        assert embeddings is not None
        if embeddings.shape[0] != ns.prefix_length:
            raise PrefixUnavailable(
                f"prompt-tuning adapter '{ns.adapter_id}' has {embeddings.shape[0]} virtual "
                f"tokens but the router counted {ns.prefix_length} (it changed in the store "
                "after the router looked it up)"
            )
        return embeddings, None


NO_ADAPTERS = Adapters()
"""An engine without an adapter cache: every adapter id is refused."""
