"""Adapters (vllm-tgis-adapter's ``adapter_id``): what the router knows of the shard's
adapter cache.

The shard owns the adapter cache (``--adapter-cache``): ``AdapterLookup`` checks an id,
reads the adapter's ``adapter_config.json``, loads it into host memory and answers its
kind, LoRA or prompt tuning (with its number of virtual tokens). :class:`AdapterKinds`
caches those answers in the router like prefix lengths (``lookup_cache.py``: 256 ids for
an hour, failures not cached, concurrent misses share one lookup). Refusals and their
messages are built in ``validation.py``; admission applies them
(``admission.py: Admission.resolve_adapters``).

How a request uses an adapter:

* a LoRA adapter adds no positions: the shard applies its weights to the sequence
  (``NewSequence.adapter_id``); it may be combined with a ``prefix_id``. One step holds at
  most ``ShardInfo.max_loras`` different LoRA adapters, which the scheduler keeps to;
* a prompt-tuning adapter is a prefix by another name: its virtual tokens go in
  ``NewSequence.prefix_length`` (``prefix_id`` empty) and count in every length rule and
  in the KV accounting exactly as a prefix's; it cannot be combined with a ``prefix_id``.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

from tgis.router.intake.lookup_cache import CACHE_CAPACITY, CACHE_TTL_S, LookupCache
from tgis.shard_api.messages import AdapterInfo, ShardInfo

__all__ = ["AdapterKinds", "AdapterLookup", "adapter_kinds"]

AdapterLookup = Callable[[str], Awaitable[AdapterInfo]]
"""Asks the shard about an adapter (``ShardClient.adapter_info``); raises
``AdapterLookupError`` or ``ShardError`` when it cannot."""


class AdapterKinds(LookupCache[AdapterInfo]):
    """Adapters of the shard's adapter cache by id: their kind (and a prompt-tuning
    adapter's length), cached, looked up on a miss.

    ``lora_supported`` is False when the shard allows no LoRA adapter in a step
    (``max_loras`` 0): a LoRA adapter is then refused as an unsupported type.
    """

    def __init__(
        self,
        lookup: AdapterLookup,
        *,
        lora_supported: bool = True,
        capacity: int = CACHE_CAPACITY,
        ttl: float = CACHE_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(lookup, capacity=capacity, ttl=ttl, clock=clock)
        self.lora_supported = lora_supported


def adapter_kinds(info: ShardInfo, lookup: AdapterLookup) -> AdapterKinds | None:
    """The router's cache of the shard's adapters, asking ``lookup`` (``ShardClient.
    adapter_info``); None when the shard has no adapter cache (``adapters_enabled``)."""
    if not info.adapters_enabled:
        return None
    return AdapterKinds(lookup, lora_supported=info.max_loras > 0)
