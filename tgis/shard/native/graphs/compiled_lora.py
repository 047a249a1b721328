"""LoRA deltas inside the compiled step: the opaque op ``tgis::lora_add``.

A step with LoRA rows runs the compiled forward's second graph, traced with ``OPAQUE_LORA``
as the step's ``LoraRows``: every linear layer an adapter may target then calls the custom
op ``tgis::lora_add(x, y, site)``, which adds the deltas of the step's real ``LoraRows``
(held in ``_ACTIVE`` while the step runs) to ``y`` in place, by the kernel they were laid
out for (``lora_rows.LoraRows.add``: torch, or Triton's SGMV kernels). The adapters, their
ranks and the rows that use them stay outside the graph, so one compilation serves every
mix of adapters and rows, and an adapter loaded while serving compiles nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from tgis.shard.native.linear.lora_rows import LoraRows

# The LoRA rows of the step being run (one step at a time; None: outside a LoRA step).
_ACTIVE: list[LoraRows | None] = [None]


@torch.library.custom_op("tgis::lora_add", mutates_args=("y",))
def lora_add(x: torch.Tensor, y: torch.Tensor, site: int) -> None:
    """Add to ``y`` (site ``site``'s output for input ``x``) the step's LoRA deltas, in
    place, on the rows of each adapter that targets the site."""
    rows = _ACTIVE[0]
    if rows is None:
        raise RuntimeError("tgis::lora_add called outside a step with LoRA rows")
    rows.add(site, x, y)


@lora_add.register_fake
def _(x: torch.Tensor, y: torch.Tensor, site: int) -> None:
    return None


class OpaqueLoraRows(LoraRows):
    """The ``LoraRows`` the LoRA graph is traced with: each site's deltas are one opaque
    ``tgis::lora_add``, whatever the step's adapters."""

    def add(self, site: int, x: torch.Tensor, y: torch.Tensor) -> None:
        lora_add(x, y, site)


OPAQUE_LORA = OpaqueLoraRows(groups=())


@contextlib.contextmanager
def active_lora(rows: LoraRows | None) -> Iterator[None]:
    """Make ``rows`` the LoRA rows ``tgis::lora_add`` applies while the step runs."""
    _ACTIVE[0] = rows
    try:
        yield
    finally:
        _ACTIVE[0] = None
