"""Building blocks the model families share, on top of the tensor-parallel layers.

Norms and activations, this rank's share of the attention heads (``Heads``), fused q/k/v
projections read head by head from a checkpoint's fused tensor, the self-attention block
over the paged KV cache, the plain (non-gated) MLP and the LM head; the model-level loop
they run in is ``decoder.DecoderLM``. Every weight is read as this rank's slice; with one
rank that is all of it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from tgis.shard.adapters.lora_layout import LoraSite
from tgis.shard.checkpoints.weights import Weights
from tgis.shard.errors import StartupError
from tgis.shard.native.linear.lora_rows import LoraRows
from tgis.shard.native.linear.sharded import (
    ColumnLinear,
    LMHead,
    RowLinear,
    VocabEmbedding,
    column_linear,
    head_range,
    lora_part,
    row_linear,
)
from tgis.shard.native.models.rotary import apply_rotary
from tgis.shard.parallel.group import TensorParallel

Activation = Callable[[torch.Tensor], torch.Tensor]

Shapes = dict[str, tuple[int, ...]]
"""A checkpoint's layout: every tensor's Hugging Face name → its full (unsharded) shape."""

_GELU_TANH: Activation = functools.partial(F.gelu, approximate="tanh")

# Hugging Face activation names → functions (the tanh approximations are one function).
ACTIVATIONS: dict[str, Activation] = {
    "gelu": F.gelu,
    "gelu_pytorch_tanh": _GELU_TANH,
    "gelu_new": _GELU_TANH,
    "gelu_fast": _GELU_TANH,
    "relu": F.relu,
    "silu": F.silu,
}


def activation(name: str, architecture: str) -> Activation:
    """The activation function called ``name`` in a config; StartupError if unknown."""
    fn = ACTIVATIONS.get(name)
    if fn is None:
        raise StartupError(
            f"{architecture}: unsupported activation '{name}' "
            f"(supported: {', '.join(sorted(ACTIVATIONS))})"
        )
    return fn


_REQUIRED: Any = object()


def first_key(raw: dict[str, Any], *keys: str, default: Any = _REQUIRED) -> Any:
    """The value of the first of ``keys`` present (and not null) in ``raw`` (aliases of one
    setting); ``default`` when none is, StartupError when there is no default."""
    for key in keys:
        if raw.get(key) is not None:
            return raw[key]
    if default is _REQUIRED:
        raise StartupError(f"config.json has none of {', '.join(keys)}")
    return default


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32, as Hugging Face's LlamaRMSNorm."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def soft_cap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """``cap * tanh(x / cap)``: Gemma 2's soft-capping of the logits (and, in the attention
    backends, of the scores)."""
    return torch.tanh(x / cap) * cap


def scale_in_dtype(x: torch.Tensor, factor: float) -> torch.Tensor:
    """``x`` times ``factor`` rounded to ``x``'s dtype first (Gemma's embedding scale, as
    transformers multiplies it)."""
    return x * torch.tensor(factor, dtype=x.dtype, device=x.device)


def check_softcap(attention: object, architecture: str) -> None:
    """StartupError unless the attention backend soft-caps the scores exactly
    (``supports_softcap``: torch_paged, cpu_paged)."""
    if not getattr(attention, "supports_softcap", False):
        name = getattr(attention, "name", type(attention).__name__)
        raise StartupError(
            f"{architecture} soft-caps its attention scores (attn_logit_softcapping), which "
            f"the {name} attention backend cannot do (TGIS_ATTENTION_BACKEND=torch_paged or "
            "cpu_paged can)"
        )


def check_sinks(attention: object, architecture: str) -> None:
    """StartupError unless the attention backend adds attention sinks to the softmax
    (``supports_sinks``: torch_paged, cpu_paged, triton_paged)."""
    if not getattr(attention, "supports_sinks", False):
        name = getattr(attention, "name", type(attention).__name__)
        raise StartupError(
            f"{architecture} has attention sinks (a learned logit per head in the softmax), "
            f"which the {name} attention backend cannot do (TGIS_ATTENTION_BACKEND="
            "triton_paged, cpu_paged or torch_paged can)"
        )


class RMSNorm:
    """RMSNorm (``name`` is its weight), whole on every rank."""

    def __init__(self, weights: Weights, name: str, eps: float) -> None:
        self.weight = weights.get(name)
        self.eps = eps

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def linear_shapes(prefix: str, out_features: int, in_features: int, bias: bool) -> Shapes:
    """The checkpoint tensors of the linear layer ``prefix``: weight [out, in], bias [out]."""
    shapes: Shapes = {f"{prefix}.weight": (out_features, in_features)}
    if bias:
        shapes[f"{prefix}.bias"] = (out_features,)
    return shapes


def layer_norm_shapes(prefix: str, size: int) -> Shapes:
    """The checkpoint tensors of the LayerNorm ``prefix``: weight and bias [size]."""
    return {f"{prefix}.weight": (size,), f"{prefix}.bias": (size,)}


class LayerNorm:
    """LayerNorm with weight and bias (``<prefix>.weight``/``.bias``), whole on every rank."""

    def __init__(self, weights: Weights, prefix: str, eps: float) -> None:
        self.weight = weights.get(f"{prefix}.weight")
        self.bias = weights.get(f"{prefix}.bias")
        self.eps = eps

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)


@dataclass(frozen=True)
class Heads:
    """The model's attention heads and this rank's share: query heads [q_first, q_last),
    KV heads [kv_first, kv_last) (global indices). KV heads fewer than ranks are
    replicated; query head ``h`` attends with KV head ``h // (total / total_kv)``."""

    total: int
    total_kv: int
    head_dim: int
    q_first: int
    q_last: int
    kv_first: int
    kv_last: int

    @classmethod
    def split(cls, num_heads: int, num_kv_heads: int, head_dim: int, tp: TensorParallel) -> Heads:
        """This rank's heads; StartupError for head counts that cannot be split."""
        if num_kv_heads < 1 or num_heads % num_kv_heads:
            raise StartupError(
                f"num_attention_heads {num_heads} not divisible by {num_kv_heads} KV heads"
            )
        q_first, q_last = head_range(num_heads, tp, "num_attention_heads")
        kv_first, kv_last = head_range(num_kv_heads, tp, "num_key_value_heads")
        return cls(num_heads, num_kv_heads, head_dim, q_first, q_last, kv_first, kv_last)

    @property
    def num_heads(self) -> int:
        """Query heads on this rank."""
        return self.q_last - self.q_first

    @property
    def num_kv_heads(self) -> int:
        """KV heads on this rank."""
        return self.kv_last - self.kv_first

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def grouped_qkv_ranges(heads: Heads) -> list[tuple[int, int]]:
    """Row ranges of this rank's q, then k, then v heads in a fused q/k/v tensor laid out
    per KV head as [q × (heads / kv_heads), k, v] (each ``head_dim`` rows).

    One layout covers the families' fused tensors: GPT-NeoX and non-multi-query
    GPT-BigCode/Falcon ([q, k, v] per head: kv_heads = heads), multi-query GPT-BigCode and
    Falcon ([all q, k, v]: one KV head) and Falcon's new decoder architecture (grouped).
    """
    group = heads.total // heads.total_kv
    dim = heads.head_dim
    stride = (group + 2) * dim

    def head_rows(kv: int, slot: int) -> tuple[int, int]:
        start = kv * stride + slot * dim
        return start, start + dim

    q = [head_rows(h // group, h % group) for h in range(heads.q_first, heads.q_last)]
    kv_heads = range(heads.kv_first, heads.kv_last)
    k = [head_rows(kv, group) for kv in kv_heads]
    v = [head_rows(kv, group + 1) for kv in kv_heads]
    return q + k + v


def split_qkv_ranges(heads: Heads) -> list[tuple[int, int]]:
    """Row ranges of this rank's q, k and v heads in a fused tensor laid out as [all q heads,
    all k heads, all v heads] (Phi-3's ``qkv_proj``)."""
    dim, k_start = heads.head_dim, heads.total * heads.head_dim
    v_start = k_start + heads.total_kv * dim
    return [
        (heads.q_first * dim, heads.q_last * dim),
        (k_start + heads.kv_first * dim, k_start + heads.kv_last * dim),
        (v_start + heads.kv_first * dim, v_start + heads.kv_last * dim),
    ]


def fused_qkv_linear(
    weights: Weights,
    prefix: str,
    heads: Heads,
    bias: bool,
    layout: Callable[[Heads], list[tuple[int, int]]] = grouped_qkv_ranges,
) -> ColumnLinear:
    """This rank's heads of the fused ``<prefix>.weight`` (``layout``: ``grouped_qkv_ranges``
    or ``split_qkv_ranges``), as one column-parallel projection whose output is [q | k | v]."""
    rows = (heads.total + 2 * heads.total_kv) * heads.head_dim
    found = weights.linear_shape(prefix)[0]
    if found != rows:
        raise StartupError(
            f"{prefix}.weight has {found} rows; the config's {heads.total} heads and "
            f"{heads.total_kv} KV heads of size {heads.head_dim} need {rows}"
        )
    ranges = layout(heads)
    b = weights.get_row_ranges(f"{prefix}.bias", ranges) if bias else None
    site = LoraSite((lora_part(weights, prefix, ranges),), row_parallel=False)
    return ColumnLinear(weights.linear(prefix, rows=ranges), b, site)


def fused_gate_up_linear(weights: Weights, prefix: str, bias: bool) -> ColumnLinear:
    """This rank's columns of a fused [gate; up] ``<prefix>.weight`` (Phi-3's
    ``gate_up_proj``), each half split evenly across ranks: the output is [gate | up]."""
    rows = weights.linear_shape(prefix)[0]
    if rows % 2:
        raise StartupError(f"{prefix}.weight has an odd number of rows ({rows})")
    start, stop = weights.tp.split(rows // 2, f"half of {prefix}.weight's rows")
    ranges = [(start, stop), (rows // 2 + start, rows // 2 + stop)]
    b = weights.get_row_ranges(f"{prefix}.bias", ranges) if bias else None
    site = LoraSite((lora_part(weights, prefix, ranges),), row_parallel=False)
    return ColumnLinear(weights.linear(prefix, rows=ranges), b, site)


QKNormFn = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
"""``qk_norm(q, k)``: queries [tokens, heads, dim] and keys [tokens, kv_heads, dim] normed
before rotary (``norms.py``)."""

AttendFn = Callable[
    [
        int,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        float | None,
        int | None,
        float | None,
        torch.Tensor | None,
    ],
    torch.Tensor,
]
"""``attend(layer, q, k, v, scale, window, softcap, sinks)``: store ``k``/``v`` in layer
``layer``'s cache and attend (q [tokens, heads, dim], k/v [tokens, kv_heads, dim] → like q),
over the last ``window`` keys of each query when the layer has a sliding window (else None),
the scores soft-capped to ``softcap * tanh(score / softcap)`` when the layer caps them (else
None), with each query head's sink logit in the softmax when the layer has attention sinks
(``sinks``: float32 [heads] of this rank; else None)."""


@dataclass(frozen=True)
class StepContext:
    """What every layer needs, besides its input, for one forward pass."""

    attend: AttendFn
    rope: tuple[torch.Tensor, torch.Tensor] | None  # cos, sin; None: no rotary embedding
    lora: LoraRows | None = None  # the step's LoRA adapters and their rows
    local_rope: tuple[torch.Tensor, torch.Tensor] | None = None  # the local layers' cos, sin


class Attention:
    """One layer's self-attention over the paged KV cache: the column-parallel ``qkv``
    gives this rank's heads as [q | k | v], ``qk_norm`` (if any) norms q and k, rotary turns
    them (when the step has cos/sin; a ``local_rope`` layer with the step's ``local_rope``,
    Gemma 3's sliding layers' own rope base), the backend writes k/v to the cache and
    attends, ``out`` is row-parallel."""

    def __init__(
        self,
        index: int,
        heads: Heads,
        qkv: ColumnLinear,
        out: RowLinear,
        scale: float | None = None,
        qk_norm: QKNormFn | None = None,
    ) -> None:
        self.index = index
        self.heads = heads
        self.qkv = qkv
        self.out = out
        self.scale = scale
        self.window: int | None = None  # the layer's sliding window, if it has one
        self.softcap: float | None = None  # the layer's attention logit soft-cap, if any
        self.sinks: torch.Tensor | None = None  # this rank's heads' sink logits, if any
        self.local_rope = False  # turned by the step's local_rope instead of its rope
        self.qk_norm = qk_norm

    def __call__(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """``x``: normed hidden states [tokens, hidden] → the attention output, all-reduced."""
        tokens, h = x.shape[0], self.heads
        q, k, v = self.qkv(x, ctx.lora).split([h.q_size, h.kv_size, h.kv_size], dim=-1)
        q = q.view(tokens, h.num_heads, h.head_dim)
        k = k.view(tokens, h.num_kv_heads, h.head_dim)
        v = v.view(tokens, h.num_kv_heads, h.head_dim)
        if self.qk_norm is not None:
            q, k = self.qk_norm(q, k)
        rope = ctx.local_rope if self.local_rope else ctx.rope
        if rope is not None:
            q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        attn = ctx.attend(self.index, q, k, v, self.scale, self.window, self.softcap, self.sinks)
        return self.out(attn.reshape(tokens, h.q_size), ctx.lora)


class MLP:
    """``proj(act(fc(x)))``: ``fc`` column-parallel, ``proj`` row-parallel."""

    def __init__(self, weights: Weights, fc: str, proj: str, bias: bool, act: Activation) -> None:
        self.fc = column_linear(weights, [fc], bias)
        self.proj = row_linear(weights, proj, bias)
        self.act = act

    def __call__(self, x: torch.Tensor, lora: LoraRows | None = None) -> torch.Tensor:
        return self.proj(self.act(self.fc(x, lora)), lora)


def load_lm_head(
    weights: Weights,
    embedding: VocabEmbedding,
    vocab_size: int,
    tied: bool,
    names: Sequence[str] = ("lm_head.weight",),
) -> LMHead:
    """The LM head: tied to ``embedding`` when the config says so, else the first of
    ``names`` in the checkpoint (StartupError when none is)."""
    name = next((n for n in names if n in weights), None)
    if tied:
        return LMHead.tied(embedding, vocab_size)
    if name is None:
        raise StartupError(f"{names[0]} missing and tie_word_embeddings is false")
    return LMHead.load(weights, name)
