"""Linear layers' weights packed once for oneDNN on the CPU.

``F.linear`` on a CPU runs MKL's sgemm for float32 and oneDNN's matmul for bfloat16 with the
weight reordered into oneDNN's blocked layout on every call. Reordered once at start-up
(``torch.ops.mkldnn._reorder_linear_weight``, what inductor's frozen CPU graphs use) and
multiplied with ``torch.ops.mkldnn._linear_pointwise``, the same GEMMs run 2-3x faster on
a 2-core AVX-512 host at 32 and 512 rows in float32 and 2-4x at 1-32 rows in bfloat16
(BENCHMARKS.md), with float32 results within float32 rounding of the dense ones. Only the
eager forward uses packed weights (a compiled step keeps dense ones); float16 is left dense.
A packed weight is an mkldnn tensor, so ``linear`` tells the two apart by the tensor alone.

oneDNN builds one primitive per weight shape and row count and keeps it in two caches (its
own and PyTorch's ideep one), 1,024 entries each by default; a primitive holds ~0.5 MB of
generated code plus, for some shapes, a rows x outputs float32 buffer. A server meets every
row count from 1 to the prefill budget, so with the defaults the shard's memory grew by
hundreds of MB over minutes. ``bound_primitive_caches`` caps both before the first GEMM.

A primitive is also built per thread count, and building one costs far more than running
it: 0.5-2 ms per weight shape for the small shapes, several ms for larger ones (a 512-row
step of the 8 x 1024 model paid ~95 ms for its four shapes the first time). A server whose
steps carry the prefill budget plus however many decodes are running met a new row count
at nearly every step of a burst. So ``linear`` pads its rows with zeros to a bucket
(``padded_rows``: exact up to 4 rows, then steps of 4, 8, 16 and 32 rows, ≤ 6 % extra rows
at a 512-token prefill) and drops the padding's results: a row's result does not depend on
the other rows, and the row counts a server meets are a few dozen per weight shape instead
of every count up to the budget. ``build_primitives`` builds some ahead of the first
request (``loading/cpu_warmup.py``).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, MutableMapping

import torch
import torch.nn.functional as F

PACKED_DTYPES = (torch.float32, torch.bfloat16)
# Primitives kept per cache: the decode shapes of ~a dozen recent batch sizes (4-5 weight
# shapes each) stay hot; a miss costs ~0.3-0.5 ms per weight shape (BENCHMARKS.md).
PRIMITIVE_CACHE_ENTRIES = 64
# oneDNN's own primitive cache, and PyTorch's ideep cache in front of it; both read once, at
# the first primitive, so setting them in the process before any GEMM is enough.
PRIMITIVE_CACHE_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")
# Row buckets (``padded_rows``): up to each limit, row counts round up to a multiple of its
# step; above the last, to a multiple of LARGE_ROWS_STEP.
ROW_STEPS = ((4, 1), (32, 4), (64, 8), (128, 16), (1024, 32))
LARGE_ROWS_STEP = 128


def bound_primitive_caches(environ: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """Cap oneDNN's primitive caches at ``PRIMITIVE_CACHE_ENTRIES`` unless the environment
    already sets them; the capacities in effect."""
    for name in PRIMITIVE_CACHE_VARIABLES:
        if not environ.get(name, "").strip():
            environ[name] = str(PRIMITIVE_CACHE_ENTRIES)
    return {name: environ[name] for name in PRIMITIVE_CACHE_VARIABLES}


def packing_available(dtype: torch.dtype) -> bool:
    """Whether this PyTorch build, on this processor, can pack weights of ``dtype`` for
    oneDNN. oneDNN's bfloat16 GEMMs need AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT; without them
    (an AVX2-only processor) packing a bfloat16 weight raises, and ``F.linear`` is used."""
    return (
        dtype in PACKED_DTYPES
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and (dtype != torch.bfloat16 or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()))
    )


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [out, in] in oneDNN's layout (a new tensor; the dense one can be freed)."""
    packed: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous())
    return packed


def padded_rows(rows: int) -> int:
    """The row count a packed GEMM of ``rows`` rows runs at (``ROW_STEPS``)."""
    for limit, step in ROW_STEPS:
        if rows <= limit:
            return -(-rows // step) * step
    return -(-rows // LARGE_ROWS_STEP) * LARGE_ROWS_STEP


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, through oneDNN when ``weight`` is as ``pack`` returned
    (with ``x``'s rows padded to ``padded_rows``; the result has ``x``'s rows)."""
    if not weight.is_mkldnn:
        return F.linear(x, weight, bias)
    rows = x.shape[0]
    padding = padded_rows(rows) - rows if x.dim() == 2 else 0
    if padding:
        x = F.pad(x, (0, 0, 0, padding))
    out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
        x.contiguous(), weight, bias, "none", [], ""
    )
    return out[:rows] if padding else out


def build_primitives(
    linears: Iterable[tuple[torch.Tensor, torch.Tensor | None]], row_counts: Iterable[int]
) -> int:
    """Build, at the current thread count, the primitives of every distinct packed weight
    (shape, dtype, with a bias or not) among ``linears`` (weight, bias) for the buckets of
    ``row_counts``; returns how many GEMMs ran."""
    distinct: dict[tuple[object, ...], tuple[torch.Tensor, torch.Tensor | None]] = {}
    for weight, bias in linears:
        if weight.is_mkldnn:
            key = (tuple(weight.shape), weight.dtype, None if bias is None else bias.dtype)
            distinct.setdefault(key, (weight, bias))
    buckets = sorted({padded_rows(rows) for rows in row_counts})
    for weight, bias in distinct.values():
        for rows in buckets:
            linear(torch.zeros(rows, weight.shape[1], dtype=weight.dtype), weight, bias)
    return len(distinct) * len(buckets)
