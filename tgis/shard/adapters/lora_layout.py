"""What a LoRA adapter is applied to, and the form its weights take on this rank.

The model describes each of its linear layers a LoRA adapter may target as a ``LoraSite``:
the checkpoint modules fused into it (``LoraPart``: q/k/v fused in one column-parallel
projection, gate/up in another) and which slice of each this rank holds, exactly as the
base weight was sliced. An adapter is then, per site, one pair of matrices

    delta(x) = (x @ A) @ B        A: [in_local, R]   B: [R, out_local]

where ``R`` is the sum of the ranks of the parts the adapter targets (a block-diagonal
``B`` keeps each part's rows apart) and the scaling (``lora_alpha / r``, or
``lora_alpha / sqrt(r)`` for rsLoRA) is folded into ``B``:

* a column-parallel site (output features split across ranks): ``A`` is every targeted
  part's ``lora_A`` whole, transposed and concatenated; ``B`` holds each part's ``lora_B``
  rows of this rank at the part's output offset;
* a row-parallel site (input features split): ``A`` is ``lora_A``'s columns of this rank,
  ``B`` the whole ``lora_B``; the ranks' partial deltas are summed by the site's own
  all-reduce, with the base output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LoraPart:
    """One checkpoint module inside a site, e.g. ``model.layers.0.self_attn.k_proj``."""

    module: str  # the Hugging Face module name (PEFT's key, without ``base_model.model.``)
    in_features: int  # the checkpoint weight's input features (columns)
    out_features: int  # its output features (rows)
    # This rank's slice, in the order the base weight concatenated it: output rows for a
    # column-parallel site, input columns for a row-parallel one.
    ranges: tuple[tuple[int, int], ...]

    @property
    def local_size(self) -> int:
        """Rows (column-parallel) or columns (row-parallel) this rank holds."""
        return sum(stop - start for start, stop in self.ranges)


@dataclass(frozen=True)
class LoraSite:
    """A linear layer of this rank that LoRA adapters may target."""

    parts: tuple[LoraPart, ...]
    row_parallel: bool  # input features split across ranks (o_proj, down_proj)

    @property
    def in_local(self) -> int:
        """Input features of this rank's linear."""
        part = self.parts[0]
        return part.local_size if self.row_parallel else part.in_features

    @property
    def out_local(self) -> int:
        """Output features of this rank's linear."""
        if self.row_parallel:
            return self.parts[0].out_features
        return sum(p.local_size for p in self.parts)


@dataclass(frozen=True)
class LoraPair:
    """One site's share of an adapter: ``delta(x) = (x @ a) @ b``."""

    a: torch.Tensor  # [in_local, R]
    b: torch.Tensor  # [R, out_local], scaling folded in

    def to(self, device: torch.device) -> LoraPair:
        return LoraPair(self.a.to(device), self.b.to(device))


@dataclass(frozen=True)
class LoraWeights:
    """A LoRA adapter ready to run on this rank: a pair per site it targets, keyed by the
    site's index in the model's ``lora_sites`` list."""

    adapter_id: str
    pairs: dict[int, LoraPair]
    rank: int  # the largest ``r`` of its modules
    version: str = ""  # of the files read (``stored_files.version_of``)

    @property
    def nbytes(self) -> int:
        return sum(p.a.nbytes + p.b.nbytes for p in self.pairs.values())

    def to(self, device: torch.device) -> LoraWeights:
        pairs = {i: p.to(device) for i, p in self.pairs.items()}
        return LoraWeights(self.adapter_id, pairs, self.rank, self.version)
