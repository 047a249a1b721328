"""The compiled step: the model's layers under ``torch.compile``, attention as an opaque op.

``torch.compile`` (inductor: generated C++ on CPU, Triton on CUDA) turns each layer's chain
of small ops (RMSNorm, rotary, residual adds, SiLU-and-multiply, ...) into a few fused
kernels around the matrix multiplications. Attention stays outside the graph: it is the
custom op ``tgis::paged_attention``, which calls the step's attention backend over the paged
cache with the step's metadata (held in ``_ACTIVE`` while the step runs), so one graph
serves every batch composition and the per-step metadata never becomes a guard. The token
dimension is unbacked-dynamic: one compilation covers every step size, decode of one
sequence included. Steps with LoRA rows run a second graph, compiled at start-up when
adapters are enabled, whose LoRA deltas are the opaque op ``tgis::lora_add``
(``compiled_lora.py``): one compilation for every mix of adapters, loaded when they may be.
Steps with prompt-tuning prefix rows run eagerly.

Compilation happens at start-up (``ModelRunner.warm_up`` runs a prompt and a decode step),
never while serving a request; inductor caches its output on disk, so later start-ups are
quicker. The eager path (``DecoderLM.forward``) stays the reference and the fallback.

``TGIS_COMPILE``: ``auto`` (default) compiles on CUDA and runs eagerly on CPU, where
BENCHMARKS.md measures no gain on decode steps for tens of seconds of start-up; ``1``
compiles on any device; ``0`` never compiles. Under ``auto`` a compilation that fails at
start-up falls back to the eager path with a warning.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch

from tgis.shard.native.attention.interface import AttentionBackend
from tgis.shard.native.attention.kv_cache import KVCache
from tgis.shard.native.graphs.compiled_lora import OPAQUE_LORA, active_lora
from tgis.shard.native.linear.lora_rows import LoraRows
from tgis.shard.native.models.decoder import DecoderLM

log = logging.getLogger(__name__)

# The attention backend, KV cache and metadata of the step being run (one step at a time).
_ACTIVE: list[tuple[AttentionBackend, KVCache, Any] | None] = [None]


@torch.library.custom_op("tgis::paged_attention", mutates_args=())
def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer: int,
    scale: float,
    window: int,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Store ``k``/``v`` in layer ``layer``'s paged cache and attend (``scale`` <= 0: the
    backend's default, 1/sqrt(dim); ``window`` <= 0: no sliding window; ``softcap`` <= 0: no
    soft-capping of the scores; ``sinks``: the heads' attention sinks, None: none). The
    cache is the step's, outside the graph."""
    active = _ACTIVE[0]
    if active is None:
        raise RuntimeError("tgis::paged_attention called outside a step")
    backend, kv_cache, metadata = active
    k_cache, v_cache = kv_cache.layer(layer)
    scale_or_none = scale if scale > 0 else None
    window_or_none = window if window > 0 else None
    # A backend that never soft-caps, or has no sinks, need not take those arguments.
    extra: dict[str, Any] = {}
    if softcap > 0:
        extra["softcap"] = softcap
    if sinks is not None:
        extra["sinks"] = sinks
    return backend.forward(
        q, k, v, k_cache, v_cache, metadata, scale=scale_or_none, window=window_or_none, **extra
    )


@paged_attention.register_fake
def _(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer: int,
    scale: float,
    window: int,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    return torch.empty_like(q)


def _opaque_attend(
    layer: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float | None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    return paged_attention(
        q, k, v, layer, -1.0 if scale is None else scale, window or 0, softcap or 0.0, sinks
    )


@contextlib.contextmanager
def _active_step(backend: AttentionBackend, kv_cache: KVCache, metadata: Any) -> Iterator[None]:
    _ACTIVE[0] = (backend, kv_cache, metadata)
    try:
        yield
    finally:
        _ACTIVE[0] = None


def should_compile(device: torch.device, mode: str) -> bool:
    """Whether the step is compiled on ``device`` with ``TGIS_COMPILE``'s ``mode``
    (``EngineSettings.compile_switch``: auto, on, off; see the module docstring)."""
    return mode == "on" or (mode == "auto" and device.type == "cuda")


class CompiledForward:
    """``DecoderLM.forward`` with the layers compiled (same arguments, same result)."""

    def __init__(self, model: DecoderLM) -> None:
        self.model = model

        def hidden_states(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            return model.hidden_states(input_ids, positions, _opaque_attend)

        def lora_hidden_states(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            return model.hidden_states(input_ids, positions, _opaque_attend, lora=OPAQUE_LORA)

        self._compiled = _compile(hidden_states)
        # Steps with LoRA rows: a graph of their own (compiled_lora.py), so that steps
        # without pay nothing for adapters.
        self._compiled_lora = _compile(lora_hidden_states)

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: KVCache,
        attn_metadata: Any,
        lora: LoraRows | None = None,
    ) -> torch.Tensor:
        """The step's final hidden states; ``lora``: the step's LoRA rows (None: none)."""
        # Views into the step's staging buffers start at any offset: 0/1 specialisation
        # would compile a second graph for the offsets 0 and 1; an own copy always starts at 0.
        if input_ids.storage_offset():
            input_ids = input_ids.clone()
        if positions.storage_offset():
            positions = positions.clone()
        torch._dynamo.decorators.mark_unbacked(input_ids, 0)
        torch._dynamo.decorators.mark_unbacked(positions, 0)
        compiled = self._compiled if lora is None else self._compiled_lora
        with _active_step(self.model.attention, kv_cache, attn_metadata), active_lora(lora):
            out: torch.Tensor = compiled(input_ids, positions)
        return out


def _compile(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> Any:
    """``fn`` under ``torch.compile``, with a code object of its own: Dynamo keeps its
    compiled code per code object, and models loaded in one process (tests) must never
    count as recompilations of one another."""
    fn.__code__ = fn.__code__.replace()
    return torch.compile(fn, dynamic=True, fullgraph=True)
