"""Tensor-parallel linear layers, embedding and LM head, loaded slice by slice.

Megatron-style: a column-parallel layer splits its output features across ranks (no
communication), a row-parallel layer splits its input features and sums the partial
results with an all-reduce. Attention splits heads (column-parallel q/k/v, row-parallel
output projection); the MLP splits its intermediate size the same way. Each rank reads
only its slice of each checkpoint tensor (`Weights.get_sharded`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from tgis.shard.adapters.lora_layout import LoraPart, LoraSite
from tgis.shard.checkpoints.weights import Weights
from tgis.shard.errors import StartupError
from tgis.shard.native.cpu_gemm import linear
from tgis.shard.native.lora_rows import LoraRows
from tgis.shard.parallel.group import TensorParallel


class ColumnLinear:
    """y = x Wᵀ + b with this rank's rows of W (output features); several checkpoint
    matrices can be fused (e.g. q, k, v) by concatenating each one's slice.

    ``lora_site`` describes those matrices and slices for LoRA adapters; with ``lora`` (the
    step's adapters and their rows) each row also gets its adapter's delta."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, lora_site: LoraSite | None = None
    ) -> None:
        self.weight = weight
        self.bias = bias
        self.lora_site = lora_site
        self.lora_index = -1  # its place in the model's LoRA sites (DecoderLM.lora_sites)

    def __call__(self, x: torch.Tensor, lora: LoraRows | None = None) -> torch.Tensor:
        y = linear(x, self.weight, self.bias)
        if lora is not None:
            lora.add(self.lora_index, x, y)
        return y


class RowLinear:
    """y = all_reduce(x_rank W_rankᵀ) + b: this rank's columns of W (input features).

    A LoRA delta is computed from this rank's input columns and summed by the same
    all-reduce as the base output."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        tp: TensorParallel,
        lora_site: LoraSite | None = None,
    ):
        self.weight = weight
        self.bias = bias
        self.tp = tp
        self.lora_site = lora_site
        self.lora_index = -1

    def __call__(self, x: torch.Tensor, lora: LoraRows | None = None) -> torch.Tensor:
        y = linear(x, self.weight)
        if lora is not None:
            lora.add(self.lora_index, x, y)
        y = self.tp.all_reduce(y)
        return y if self.bias is None else y + self.bias


def _bias(weights: Weights, name: str, present: bool, dim: int | None) -> torch.Tensor | None:
    if not present:
        return None
    return weights.get(name) if dim is None else weights.get_sharded(name, dim)


def column_linear(weights: Weights, prefixes: Sequence[str], bias: bool) -> ColumnLinear:
    """Fuse `<prefix>.weight` of every prefix, each split by output rows across ranks."""
    w = torch.cat([weights.get_sharded(f"{p}.weight", 0) for p in prefixes])
    biases = [_bias(weights, f"{p}.bias", bias, 0) for p in prefixes]
    b = torch.cat([t for t in biases if t is not None]) if bias else None
    parts = [lora_part(weights, p, (_even_range(weights, f"{p}.weight", 0),)) for p in prefixes]
    return ColumnLinear(w, b, LoraSite(tuple(parts), row_parallel=False))


def row_linear(weights: Weights, prefix: str, bias: bool) -> RowLinear:
    """`<prefix>.weight` split by input columns; the bias is added once, after the sum."""
    name = f"{prefix}.weight"
    part = lora_part(weights, prefix, (_even_range(weights, name, 1),))
    return RowLinear(
        weights.get_sharded(name, 1),
        _bias(weights, f"{prefix}.bias", bias, None),
        weights.tp,
        LoraSite((part,), row_parallel=True),
    )


def lora_part(weights: Weights, module: str, ranges: Sequence[tuple[int, int]]) -> LoraPart:
    """Checkpoint module ``module`` as part of a LoRA site, this rank holding ``ranges``
    (output rows of a column-parallel site, input columns of a row-parallel one)."""
    out_features, in_features = weights.shape(f"{module}.weight")[:2]
    return LoraPart(module, in_features, out_features, tuple(ranges))


def _even_range(weights: Weights, name: str, dim: int) -> tuple[int, int]:
    """This rank's [start, stop) of ``name`` along ``dim``, as ``Weights.get_sharded`` reads."""
    size = weights.shape(name)[dim]
    if not weights.tp.is_parallel:
        return 0, size
    return weights.tp.split(size, f"dimension {dim} of {name}")


def head_range(num_heads: int, tp: TensorParallel, what: str) -> tuple[int, int]:
    """This rank's [first, last) head. KV heads fewer than ranks are replicated: the ranks
    are divided into `num_heads` equal groups, each holding one head."""
    if num_heads >= tp.world_size:
        return tp.split(num_heads, what)
    if tp.world_size % num_heads:
        raise StartupError(
            f"{what} ({num_heads}) must divide the number of shards ({tp.world_size})"
        )
    head = tp.rank // (tp.world_size // num_heads)
    return head, head + 1


def heads_rows(
    weights: Weights, name: str, num_heads: int, head_dim: int, what: str
) -> torch.Tensor:
    """Rows of a [num_heads * head_dim, ...] tensor belonging to this rank's heads."""
    first, last = head_range(num_heads, weights.tp, what)
    return weights.get_rows(name, first * head_dim, last * head_dim)


class VocabEmbedding:
    """Token embedding with the vocabulary split across ranks; ids outside this rank's
    range contribute zeros and the all-reduce assembles full embeddings."""

    def __init__(self, weights: Weights, name: str) -> None:
        self.tp = weights.tp
        full = weights.shape(name)[0]
        self.start, stop, self.part = self.tp.padded_split(full)
        self.weight = weights.get_rows(name, self.start, stop)

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        if not self.tp.is_parallel:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return self.tp.all_reduce(out)


class LMHead:
    """Logits with the vocabulary split across ranks and gathered on every rank."""

    def __init__(self, weight: torch.Tensor, vocab_size: int, tp: TensorParallel) -> None:
        self.tp = tp
        self.vocab_size = vocab_size
        _, _, part = tp.padded_split(vocab_size)
        if weight.shape[0] < part:  # the last rank's short slice, padded for the gather
            pad = weight.new_zeros(part - weight.shape[0], weight.shape[1])
            weight = torch.cat([weight, pad])
        self.weight = weight

    @classmethod
    def load(cls, weights: Weights, name: str) -> LMHead:
        vocab = weights.shape(name)[0]
        start, stop, _ = weights.tp.padded_split(vocab)
        return cls(weights.get_rows(name, start, stop), vocab, weights.tp)

    @classmethod
    def tied(cls, embedding: VocabEmbedding, vocab_size: int) -> LMHead:
        return cls(embedding.weight, vocab_size, embedding.tp)

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [rows, vocab]."""
        logits = self.tp.all_gather(linear(hidden, self.weight).float())
        return logits[:, : self.vocab_size]
