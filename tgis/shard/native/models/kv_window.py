"""The KV window a model announces (``ShardInfo.kv_window``): how far back any of its
queries reads the paged cache, so the router can give back the blocks behind it.

Every layer that reads the paged cache does so through ``layers.Attention`` (the only
caller of ``StepContext.attend``), so the model's ``Attention`` objects tell it all: the
largest of their sliding windows, or 0 when one attends to every position (Gemma 2's
global layers, Qwen2's first layers) or none is found.
"""

from __future__ import annotations

import torch

from tgis.shard.native.models.layers import Attention

__all__ = ["kv_window"]


def kv_window(model: object) -> int:
    """The largest sliding window of ``model``'s attention layers, in tokens; 0 when some
    layer has none (or no attention layer is found)."""
    found: list[Attention] = []
    _collect(model, found, set())
    if not found or any(attention.window is None for attention in found):
        return 0
    return max(attention.window for attention in found if attention.window is not None)


def _collect(value: object, found: list[Attention], seen: set[int]) -> None:
    """Every ``Attention`` reachable from ``value`` through attributes, lists and tuples."""
    if id(value) in seen:
        return
    seen.add(id(value))
    if isinstance(value, Attention):
        found.append(value)
    elif isinstance(value, list | tuple):
        for item in value:
            _collect(item, found, seen)
    elif hasattr(value, "__dict__") and not isinstance(value, torch.Tensor | type):
        for attribute in vars(value).values():
            _collect(attribute, found, seen)
