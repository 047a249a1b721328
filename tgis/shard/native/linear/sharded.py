"""Tensor-parallel linear layers, embedding and LM head, loaded slice by slice.

Megatron-style: a column-parallel layer splits its output features across ranks (no
communication), a row-parallel layer splits its input features and sums the partial
results with an all-reduce. Attention splits heads (column-parallel q/k/v, row-parallel
output projection); the MLP splits its intermediate size the same way. Each rank reads
only its slice of each checkpoint tensor (`Weights.linear`).

A linear layer's weight is dense or quantized (``native/linear/quantized_linear.py`` chooses its
kernel once, at load); the layers call ``apply`` and never look at the format.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from tgis.shard.adapters.lora_layout import LoraPart, LoraSite
from tgis.shard.checkpoints.quantized.source import LinearMatrix
from tgis.shard.checkpoints.weights import Weights
from tgis.shard.errors import StartupError
from tgis.shard.native.linear.cpu_gemm import linear
from tgis.shard.native.linear.lora_rows import LoraRows
from tgis.shard.native.linear.quantized_linear import LinearWeight, runtime_weight
from tgis.shard.parallel.group import TensorParallel


class ColumnLinear:
    """y = x Wᵀ + b with this rank's rows of W (output features); several checkpoint
    matrices can be fused (e.g. q, k, v) by concatenating each one's slice.

    ``lora_site`` describes those matrices and slices for LoRA adapters; with ``lora`` (the
    step's adapters and their rows) each row also gets its adapter's delta (on top of a
    quantized weight's output as of a dense one's)."""

    def __init__(
        self,
        weight: LinearMatrix | Sequence[LinearMatrix],
        bias: torch.Tensor | None,
        lora_site: LoraSite | None = None,
    ) -> None:
        self.weight, self.kernel = runtime_weight(weight)
        self.bias = bias
        self.lora_site = lora_site
        self.lora_index = -1  # its place in the model's LoRA sites (DecoderLM.lora_sites)

    def __call__(self, x: torch.Tensor, lora: LoraRows | None = None) -> torch.Tensor:
        y = apply(x, self.weight, self.bias)
        if lora is not None:
            lora.add(self.lora_index, x, y)
        return y


class RowLinear:
    """y = all_reduce(x_rank W_rankᵀ) + b: this rank's columns of W (input features).

    A LoRA delta is computed from this rank's input columns and summed by the same
    all-reduce as the base output. With ``reduce`` false the partial product is returned
    for the caller to sum with others in one all-reduce (a mixture of experts' layer)."""

    def __init__(
        self,
        weight: LinearMatrix,
        bias: torch.Tensor | None,
        tp: TensorParallel,
        lora_site: LoraSite | None = None,
        reduce: bool = True,
    ):
        self.weight, self.kernel = runtime_weight(weight)
        self.bias = bias
        self.tp = tp
        self.lora_site = lora_site
        self.lora_index = -1
        self.reduce = reduce

    def __call__(self, x: torch.Tensor, lora: LoraRows | None = None) -> torch.Tensor:
        y = apply(x, self.weight, None)
        if lora is not None:
            lora.add(self.lora_index, x, y)
        if self.reduce:
            y = self.tp.all_reduce(y)
        return y if self.bias is None else y + self.bias


def apply(x: torch.Tensor, weight: LinearWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """``x Wᵀ + b`` with a dense weight (oneDNN-packed or not) or a quantized one."""
    if isinstance(weight, torch.Tensor):
        return linear(x, weight, bias)
    return weight.matmul(x, bias)


def _bias(weights: Weights, name: str, present: bool, dim: int | None) -> torch.Tensor | None:
    if not present:
        return None
    return weights.get(name) if dim is None else weights.get_sharded(name, dim)


def column_linear(weights: Weights, prefixes: Sequence[str], bias: bool) -> ColumnLinear:
    """Fuse the weight of every prefix, each split by output rows across ranks."""
    ranges = {p: _even_range(weights, p, 0) for p in prefixes}
    w = [weights.linear(p, rows=[ranges[p]]) for p in prefixes]
    biases = [_bias(weights, f"{p}.bias", bias, 0) for p in prefixes]
    b = torch.cat([t for t in biases if t is not None]) if bias else None
    parts = [lora_part(weights, p, (ranges[p],)) for p in prefixes]
    return ColumnLinear(w, b, LoraSite(tuple(parts), row_parallel=False))


def row_linear(weights: Weights, prefix: str, bias: bool) -> RowLinear:
    """``prefix``'s weight split by input columns; the bias is added once, after the sum."""
    cols = _even_range(weights, prefix, 1)
    part = lora_part(weights, prefix, (cols,))
    return RowLinear(
        weights.linear(prefix, cols=cols),
        _bias(weights, f"{prefix}.bias", bias, None),
        weights.tp,
        LoraSite((part,), row_parallel=True),
    )


def lora_part(weights: Weights, module: str, ranges: Sequence[tuple[int, int]]) -> LoraPart:
    """Checkpoint module ``module`` as part of a LoRA site, this rank holding ``ranges``
    (output rows of a column-parallel site, input columns of a row-parallel one)."""
    out_features, in_features = weights.linear_shape(module)
    return LoraPart(module, in_features, out_features, tuple(ranges))


def _even_range(weights: Weights, module: str, dim: int) -> tuple[int, int]:
    """This rank's equal [start, stop) of linear layer ``module``'s weight along ``dim``
    (0: output rows, 1: input columns)."""
    size = weights.linear_shape(module)[dim]
    if not weights.tp.is_parallel:
        return 0, size
    return weights.tp.split(size, f"dimension {dim} of {module}.weight")


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
