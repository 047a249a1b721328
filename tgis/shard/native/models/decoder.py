"""``DecoderLM``: the model-level loop and KV-cache spec every family shares.

Embed (with the virtual tokens of prompt-tuning prefixes in place, ``EmbeddingRows``), run
the family's layers (``layers.py``) over one ``StepContext``, final norm, LM head; the
eager forward attends through the step's backend over the paged cache (``paged_attend``),
the compiled one through ``compiled.py``'s custom op.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch

from tgis.shard.adapters.lora_layout import LoraSite
from tgis.shard.checkpoints.model_config import ModelConfig
from tgis.shard.native.attention.interface import AttentionBackend
from tgis.shard.native.attention.kv_cache import KVCache, KVCacheSpec
from tgis.shard.native.linear.cpu_gemm import pack
from tgis.shard.native.linear.lora_rows import LoraRows
from tgis.shard.native.linear.sharded import ColumnLinear, LMHead, RowLinear, VocabEmbedding
from tgis.shard.native.models.layers import AttendFn, Heads, StepContext
from tgis.shard.native.models.rotary import RotaryEmbedding


def paged_attend(backend: AttentionBackend, kv_cache: KVCache, metadata: Any) -> AttendFn:
    """The eager ``attend`` of one step: the backend over the paged cache."""

    def attend(
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float | None,
        window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        k_cache, v_cache = kv_cache.layer(layer)
        # A backend that never soft-caps, or has no sinks, need not take those arguments.
        extra: dict[str, Any] = {}
        if softcap is not None:
            extra["softcap"] = softcap
        if sinks is not None:
            extra["sinks"] = sinks
        return backend.forward(
            q, k, v, k_cache, v_cache, metadata, scale=scale, window=window, **extra
        )

    return attend


class DecoderLayer(Protocol):
    """One transformer layer of a family."""

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """``x``: [tokens, hidden] → [tokens, hidden]."""
        ...


class ConfigParser(Protocol):
    """A family's ``<Family>Args.from_config``: parses and checks, StartupError if it cannot
    run the config."""

    def __call__(self, config: ModelConfig, max_sequence_length: int) -> object: ...


@dataclass(frozen=True)
class EmbeddingRows:
    """Input embeddings that replace the vocabulary's at some rows of a step: the virtual
    tokens of prompt-tuning prefixes (TGIS's ``inputs_embeds``). Family-specific scaling and
    position embeddings still apply to them, as Hugging Face applies them to
    ``inputs_embeds``."""

    index: torch.Tensor  # [rows] long: rows of the flattened batch
    values: torch.Tensor  # [rows, hidden]


class DecoderLM:
    """What every family's model class shares (the ``CausalLM`` protocol): embed, run the
    layers over one ``StepContext``, final norm, LM head, and the KV-cache spec.

    Subclasses name their config parser (``parse_args``) and set, in their constructor,
    every other attribute annotated here; they override ``embed_tokens`` to add position
    embeddings or multipliers.
    """

    parse_args: ClassVar[ConfigParser]
    attention: AttentionBackend
    dtype: torch.dtype
    heads: Heads
    embed: VocabEmbedding
    layers: Sequence[DecoderLayer]
    final_norm: Callable[[torch.Tensor], torch.Tensor]
    lm_head: LMHead
    rotary: RotaryEmbedding | None = None
    local_rotary: RotaryEmbedding | None = None  # the local_rope layers' (Gemma 3's sliding)

    @classmethod
    def check_config(cls, config: ModelConfig, max_sequence_length: int) -> None:
        """StartupError for a config this class cannot run (reads no weights)."""
        cls.parse_args(config, max_sequence_length)

    @property
    def kv_cache_spec(self) -> KVCacheSpec:
        """The shape of one KV-cache block for this model (this rank's KV heads)."""
        return KVCacheSpec(
            num_layers=len(self.layers),
            num_kv_heads=self.heads.num_kv_heads,
            head_dim=self.heads.head_dim,
            dtype=self.dtype,
        )

    def word_embeddings(
        self, input_ids: torch.Tensor, rows: EmbeddingRows | None = None
    ) -> torch.Tensor:
        """The vocabulary embeddings of ``input_ids`` [tokens, hidden], with ``rows`` (the
        virtual tokens of prompt-tuning prefixes) put in place of theirs."""
        x = self.embed(input_ids)
        if rows is not None:
            x = x.index_copy(0, rows.index, rows.values.to(x.dtype))
        return x

    def embed_tokens(
        self, input_ids: torch.Tensor, positions: torch.Tensor, rows: EmbeddingRows | None = None
    ) -> torch.Tensor:
        """The first layer's input [tokens, hidden]."""
        del positions
        return self.word_embeddings(input_ids, rows)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: KVCache,
        attn_metadata: Any,
        rows: EmbeddingRows | None = None,
        lora: LoraRows | None = None,
    ) -> torch.Tensor:
        """Final (normed) hidden states [tokens, hidden] for flattened ``input_ids``, eagerly
        (``compiled.CompiledForward`` runs ``hidden_states`` compiled instead, with LoRA
        adapters too; steps with prefix ``rows`` always run here)."""
        attend = paged_attend(self.attention, kv_cache, attn_metadata)
        return self.hidden_states(input_ids, positions, attend, rows, lora)

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attend: AttendFn,
        rows: EmbeddingRows | None = None,
        lora: LoraRows | None = None,
    ) -> torch.Tensor:
        """Embed, every layer (attending through ``attend``), final norm."""
        x = self.embed_tokens(input_ids, positions, rows)
        rope = None if self.rotary is None else self.rotary.cos_sin(positions, x.dtype)
        local = self.local_rotary
        local_rope = None if local is None else local.cos_sin(positions, x.dtype)
        ctx = StepContext(attend, rope, lora, local_rope)
        for layer in self.layers:
            x = layer.forward(x, ctx)
        return self.final_norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [rows, vocab] for selected rows of ``forward``'s output."""
        return self.lm_head(hidden)

    def lora_sites(self) -> list[LoraSite]:
        """The linear layers LoRA adapters may target, in a fixed order; each layer learns
        its index in it (``lora_index``), which keys an adapter's pairs."""
        linears: list[ColumnLinear | RowLinear] = []
        for layer in self.layers:
            _collect_linears(layer, linears)
        for index, linear in enumerate(linears):
            linear.lora_index = index
        return [linear.lora_site for linear in linears if linear.lora_site is not None]

    def pack_linear_weights(self) -> int:
        """Put every dense linear layer's weight, the LM head's included, in oneDNN's layout
        (``cpu_gemm.py``: CPU, eager forward; a tied embedding keeps its own; quantized
        weights keep theirs); returns how many were packed."""
        linears: list[ColumnLinear | RowLinear] = []
        for layer in self.layers:
            _collect_linears(layer, linears, every=True)
        dense = 0
        for linear in linears:
            if isinstance(linear.weight, torch.Tensor):
                linear.weight = pack(linear.weight)
                dense += 1
        self.lm_head.weight = pack(self.lm_head.weight)
        return dense + 1

    def linear_layers(self) -> list[ColumnLinear | RowLinear]:
        """Every linear layer of the decoder layers (not the LM head), in a fixed order."""
        linears: list[ColumnLinear | RowLinear] = []
        for layer in self.layers:
            _collect_linears(layer, linears, every=True)
        return linears

    def linear_kernels(self) -> Counter[str]:
        """How many linear layers run each kernel (``native/linear/quantized_linear.py``)."""
        return Counter(linear.kernel for linear in self.linear_layers())


def _collect_linears(
    obj: object, found: list[ColumnLinear | RowLinear], every: bool = False
) -> None:
    """Every linear layer with a LoRA site (``every``: every linear layer) reachable from
    ``obj``'s attributes, in attribute order."""
    for attribute in vars(obj).values():
        # a list: a mixture of experts' experts, one linear layer each
        for value in attribute if isinstance(attribute, list) else [attribute]:
            _collect_linear(value, found, every)


def _collect_linear(value: object, found: list[ColumnLinear | RowLinear], every: bool) -> None:
    """``value`` if it is a linear layer (with a LoRA site, unless ``every``), else the
    linear layers reachable from its attributes."""
    if isinstance(value, ColumnLinear | RowLinear):
        if every or value.lora_site is not None:
            found.append(value)
    elif hasattr(value, "__dict__") and not isinstance(value, torch.Tensor | type):
        _collect_linears(value, found, every)
