"""LoRA adapters in the native engine: which rows of a step use which adapter.

Requests for different LoRA adapters and for none run in the same step. ``lora_rows``
groups the step's flattened rows by adapter; every linear layer an adapter targets then
adds, for each group, ``(x[rows] @ A) @ B`` to its output rows (``LoraRows.add``): one pair
of small matmuls per adapter present and site, whatever the number of sequences. Rows of
sequences without an adapter are untouched, and a step without LoRA rows pays nothing.
The compiled step calls ``add`` as one opaque op per site (``graphs/compiled_lora.py``), so
adapters never enter its graph; CUDA graphs never replay steps with LoRA rows.

On CUDA the same deltas come from Triton kernels instead (``lora_triton.py``: two launches
per site for every adapter of the step, the per-step layout built here once); this torch
path stays the reference and the CPU path. ``TGIS_LORA_KERNEL`` chooses: ``auto`` (the
default: Triton on CUDA when it imports, torch elsewhere), ``triton`` or ``torch``.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tgis.shard.adapters.lora_layout import LoraWeights

if TYPE_CHECKING:
    from tgis.shard.native.linear.lora_triton import LoraKernelMetadata
    from tgis.shard.step.plan import WorkItem

KERNELS = ("auto", "triton", "torch")


@dataclass(frozen=True)
class LoraGroup:
    """One adapter and the rows of the step that use it (None: every row)."""

    weights: LoraWeights
    rows: torch.Tensor | None


@dataclass(frozen=True)
class LoraRows:
    """The adapters of one step, each with its rows."""

    groups: tuple[LoraGroup, ...]
    # The Triton kernels' layout of the same groups, when they compute the deltas.
    kernel: LoraKernelMetadata | None = None

    def add(self, site: int, x: torch.Tensor, y: torch.Tensor) -> None:
        """Add to ``y`` (the output of site ``site`` for input ``x``) each group's delta, in
        place, on that group's rows."""
        if self.kernel is not None:
            from tgis.shard.native.linear.lora_triton import lora_add

            if lora_add(self.kernel, site, x, y):
                return
        for group in self.groups:
            pair = group.weights.pairs.get(site)
            if pair is None:
                continue
            if group.rows is None:
                y.add_((x @ pair.a) @ pair.b)
            else:
                delta = (x.index_select(0, group.rows) @ pair.a) @ pair.b
                add_rows(y, group.rows, delta)


def add_rows(y: torch.Tensor, rows: torch.Tensor, delta: torch.Tensor) -> None:
    """``y[rows] += delta`` in place, ``rows`` distinct. On the CPU ``index_put_`` with
    ``accumulate``: ``index_add_`` is a parallel scatter there, 10-30x slower for a step's
    few rows on two threads (and far worse when the cores are shared); the sums are the
    same, one addition per element."""
    if y.device.type == "cpu":
        y.index_put_((rows,), delta, accumulate=True)
    else:
        y.index_add_(0, rows, delta)


def lora_kernel(device: torch.device, choice: str) -> str:
    """``triton`` or ``torch``: which computes the deltas on ``device``, by ``choice``
    (``TGIS_LORA_KERNEL``; ``auto``: Triton on CUDA when it is installed)."""
    choice = choice.strip().lower() or "auto"
    if choice not in KERNELS:
        raise ValueError(f"TGIS_LORA_KERNEL={choice!r} is not one of {', '.join(KERNELS)}")
    if choice == "auto":
        return "triton" if device.type == "cuda" and _triton_imports() else "torch"
    return choice


def _triton_imports() -> bool:
    """Whether Triton is there and imports (a broken install means the torch path)."""
    if importlib.util.find_spec("triton") is None:
        return False
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


def lora_rows(
    work: SequenceOf[WorkItem],
    query_starts: list[int],
    device: torch.device,
    kernel: str = "auto",
) -> LoraRows | None:
    """The step's LoRA groups, or None when no scheduled sequence has a LoRA adapter.

    ``query_starts[i]`` is the first row of ``work[i]`` in the flattened batch; ``kernel``
    is ``TGIS_LORA_KERNEL``'s choice (see ``lora_kernel``).
    """
    by_adapter: dict[str, tuple[LoraWeights, list[range]]] = {}
    for item, row in zip(work, query_starts, strict=True):
        weights = item.seq.lora
        if weights is None:
            continue
        entry = by_adapter.setdefault(weights.adapter_id, (weights, []))
        entry[1].append(range(row, row + item.num_tokens))
    if not by_adapter:
        return None
    total = sum(item.num_tokens for item in work)
    groups = []
    for weights, spans in by_adapter.values():
        count = sum(len(s) for s in spans)
        rows = None
        if count != total:
            rows = torch.tensor([r for s in spans for r in s], dtype=torch.long, device=device)
        groups.append(LoraGroup(weights, rows))
    metadata = None
    if lora_kernel(device, kernel) == "triton":
        from tgis.shard.native.linear.lora_triton import prepare

        spans_of = [(w, [r for s in spans for r in s]) for w, spans in by_adapter.values()]
        metadata = prepare(spans_of, device)
    return LoraRows(tuple(groups), metadata)
