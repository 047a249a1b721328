"""``lora_triton``: a step's LoRA deltas for every adapter in two Triton launches per site.

The torch path (``lora_rows.LoraRows.add``) runs a gather, two matmuls and a scatter per
adapter present and site: with many adapters in a step that is many small launches per
linear layer. Here (the "SGMV" scheme of punica and S-LoRA) the step's adapter rows are
laid out once per step, grouped by adapter, and cut into row tiles of one adapter each
(``prepare``); every site then runs

- ``_shrink_kernel``: ``t = x[rows] @ A_g`` for every tile, float32, in a scratch buffer
  indexed by position in the grouped row list. Long inputs (``in`` up to tens of
  thousands, with a handful of rows) are split along ``in`` over several programs that each
  store their partial product (no atomics: the expand sums them, in a fixed order);
- ``_expand_kernel``: ``y[rows] += t @ B_g``, a program per tile and block of output
  columns; a row belongs to at most one adapter, so no two programs write the same element.

The adapters' matrices stay where they are: a per-step table holds, per site and group,
the data pointers of ``A`` and ``B``, their strides and the rank ``R`` (0 where the adapter
lacks the site, whose tiles then do nothing); the kernels turn the addresses back into
pointers of the input's element type. ``R`` differs between adapters and sites and need not
be a power of two: the rank dimension is padded to a power of two (at least 16, for
``tl.dot``) and masked, as are rows past a tile's group and columns past ``in``/``out``.

Products accumulate in float32. On CUDA, fp16/bf16 operands go to ``tl.dot`` as they are and
``t`` is rounded to that dtype for the expand (as the torch path rounds ``x @ A``); fp32
operands use full precision (``ieee``). CPU tensors (only under ``TRITON_INTERPRET=1``, the
tests' mode) compute every product in float32, because the interpreter's ``tl.dot`` on bf16
is wrong (see ``attention/triton_paged.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tgis.shard.adapters.lora_layout import LoraWeights

# One entry of the per-site table: A's address, B's address, R, A's strides, B's strides.
_ENTRY = 7


@triton.jit
def _shrink_kernel(  # noqa: PLR0913 - a Triton function takes every pointer, stride and tile size
    x_ptr,
    t_ptr,
    rows_ptr,
    tiles_ptr,
    table_ptr,
    in_features,
    k_per_split,
    stride_xm,
    stride_ts,
    stride_tm,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Program (tile, rank block, split): columns ``BLOCK_R`` of ``x[rows] @ A_g`` for the
    tile's rows, over the split's range of input features, stored as a float32 partial
    product at ``t[split, position, r]``."""
    tile = tl.program_id(0)
    r_start = tl.program_id(1) * BLOCK_R
    split = tl.program_id(2)
    group = tl.load(tiles_ptr + tile * 3)
    first = tl.load(tiles_ptr + tile * 3 + 1)
    end = tl.load(tiles_ptr + tile * 3 + 2)
    entry = table_ptr + group * 7
    rank = tl.load(entry + 2)
    if r_start < rank:
        a_ptr = tl.load(entry).to(tl.pointer_type(x_ptr.dtype.element_ty))
        stride_ak = tl.load(entry + 3)
        stride_ar = tl.load(entry + 4)
        positions = first + tl.arange(0, BLOCK_M)
        row_ok = positions < end
        rows = tl.load(rows_ptr + positions, mask=row_ok, other=0)
        ranks = r_start + tl.arange(0, BLOCK_R)
        rank_ok = ranks < rank
        k_begin = split * k_per_split
        k_end = tl.minimum(k_begin + k_per_split, in_features)
        cols = tl.arange(0, BLOCK_K)
        acc = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
        for k0 in range(k_begin, k_end, BLOCK_K):
            ks = k0 + cols
            k_ok = ks < k_end
            x = tl.load(
                x_ptr + rows[:, None] * stride_xm + ks[None, :],
                mask=row_ok[:, None] & k_ok[None, :],
                other=0.0,
            )
            a = tl.load(
                a_ptr + ks[:, None] * stride_ak + ranks[None, :] * stride_ar,
                mask=k_ok[:, None] & rank_ok[None, :],
                other=0.0,
            )
            if DOT_FP32:
                x = x.to(tl.float32)
                a = a.to(tl.float32)
            acc += tl.dot(x, a, input_precision=PRECISION)
        t_offs = split * stride_ts + positions[:, None] * stride_tm + ranks[None, :]
        tl.store(t_ptr + t_offs, acc, mask=row_ok[:, None] & rank_ok[None, :])


@triton.jit
def _expand_kernel(  # noqa: PLR0913 - a Triton function takes every pointer, stride and tile size
    t_ptr,
    y_ptr,
    rows_ptr,
    tiles_ptr,
    table_ptr,
    out_features,
    splits,
    stride_ts,
    stride_tm,
    stride_ym,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Program (tile, column block): ``y[rows, cols] += t @ B_g[:, cols]`` for the tile's
    rows, ``t`` being the sum of the shrink's partial products (float32; rounded to the
    weights' dtype first unless ``DOT_FP32``)."""
    tile = tl.program_id(0)
    n_start = tl.program_id(1) * BLOCK_N
    group = tl.load(tiles_ptr + tile * 3)
    first = tl.load(tiles_ptr + tile * 3 + 1)
    end = tl.load(tiles_ptr + tile * 3 + 2)
    entry = table_ptr + group * 7
    rank = tl.load(entry + 2)
    if rank > 0:
        b_ptr = tl.load(entry + 1).to(tl.pointer_type(y_ptr.dtype.element_ty))
        stride_br = tl.load(entry + 5)
        stride_bn = tl.load(entry + 6)
        positions = first + tl.arange(0, BLOCK_M)
        row_ok = positions < end
        rows = tl.load(rows_ptr + positions, mask=row_ok, other=0)
        ns = n_start + tl.arange(0, BLOCK_N)
        n_ok = ns < out_features
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for r0 in range(0, rank, BLOCK_R):
            ranks = r0 + tl.arange(0, BLOCK_R)
            rank_ok = ranks < rank
            t_mask = row_ok[:, None] & rank_ok[None, :]
            t_offs = positions[:, None] * stride_tm + ranks[None, :]
            t = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
            for s in range(0, splits):
                t += tl.load(t_ptr + s * stride_ts + t_offs, mask=t_mask, other=0.0)
            b = tl.load(
                b_ptr + ranks[:, None] * stride_br + ns[None, :] * stride_bn,
                mask=rank_ok[:, None] & n_ok[None, :],
                other=0.0,
            )
            if DOT_FP32:
                b = b.to(tl.float32)
            else:
                t = t.to(b.dtype)
            acc += tl.dot(t, b, input_precision=PRECISION)
        y_mask = row_ok[:, None] & n_ok[None, :]
        y_offs = rows[:, None] * stride_ym + ns[None, :]
        y = tl.load(y_ptr + y_offs, mask=y_mask, other=0.0)
        tl.store(y_ptr + y_offs, (y.to(tl.float32) + acc).to(y_ptr.dtype.element_ty), mask=y_mask)


@dataclass(frozen=True)
class LoraKernelMetadata:
    """One step's layout for the kernels (device tensors built by ``prepare``)."""

    rows: torch.Tensor  # [lora rows] int64: the rows of every group, group after group
    tiles: torch.Tensor  # [tiles, 3] int64: (group, first position, end position) in ``rows``
    tables: torch.Tensor  # [sites, groups, 7] int64: see ``_ENTRY``; R = 0 where absent
    block_m: int  # rows per tile
    # Per site some group targets: (largest R, dtype of every group's A and B), or None
    # where the groups' dtypes differ (that site then takes the torch path).
    sites: dict[int, tuple[int, torch.dtype] | None]


def _pow2(n: int, least: int = 16) -> int:
    return max(least, triton.next_power_of_2(n))


def prepare(
    groups: Sequence[tuple[LoraWeights, Sequence[int]]], device: torch.device
) -> LoraKernelMetadata:
    """The kernels' metadata for a step whose groups are ``(adapter, its rows)``: two
    host-to-device copies, once per step, whatever the number of layers."""
    rows = [r for _, group_rows in groups for r in group_rows]
    longest = max((len(r) for _, r in groups), default=1)
    block_m = min(64, _pow2(longest))
    tiles: list[tuple[int, int, int]] = []
    position = 0
    for index, (_, group_rows) in enumerate(groups):
        end = position + len(group_rows)
        tiles.extend((index, s, min(s + block_m, end)) for s in range(position, end, block_m))
        position = end
    site_ids = sorted({site for weights, _ in groups for site in weights.pairs})
    num_sites = site_ids[-1] + 1 if site_ids else 0
    absent = [0] * _ENTRY
    entries = [[absent] * len(groups) for _ in range(num_sites)]  # one tensor built below
    sites: dict[int, tuple[int, torch.dtype] | None] = {}
    for site in site_ids:
        ranks: list[int] = []
        dtypes: set[torch.dtype] = set()
        for index, (weights, _) in enumerate(groups):
            pair = weights.pairs.get(site)
            if pair is None:
                continue
            a, b = pair.a, pair.b
            entries[site][index] = [
                a.data_ptr(),
                b.data_ptr(),
                a.shape[1],
                *a.stride(),
                *b.stride(),
            ]
            ranks.append(a.shape[1])
            dtypes.update((a.dtype, b.dtype))
        sites[site] = (max(ranks), dtypes.pop()) if len(dtypes) == 1 else None
    table = torch.tensor(entries, dtype=torch.int64).reshape(num_sites, len(groups), _ENTRY)
    return LoraKernelMetadata(
        rows=torch.tensor(rows, dtype=torch.int64).to(device, non_blocking=True),
        tiles=torch.tensor(tiles, dtype=torch.int64).reshape(-1, 3).to(device, non_blocking=True),
        tables=table.to(device, non_blocking=True),
        block_m=block_m,
        sites=sites,
    )


def _splits(in_features: int, programs: int, split_k: int | None) -> int:
    """How many ranges of input features the shrink splits ``in`` into: enough programs to
    occupy the GPU when there are few tiles, each range at least 512 features."""
    if split_k is not None:
        return max(1, min(split_k, in_features))
    return max(1, min(in_features // 512, 256 // max(programs, 1)))


def lora_add(
    metadata: LoraKernelMetadata,
    site: int,
    x: torch.Tensor,
    y: torch.Tensor,
    split_k: int | None = None,
) -> bool:
    """Add every group's delta of site ``site`` to ``y`` in place; False (nothing done)
    where the kernels cannot take the site (groups of mixed dtypes, or other dtypes than
    ``x`` and ``y``), for the caller's torch path. ``split_k`` forces the shrink's split."""
    if site not in metadata.sites:
        return True  # no group targets this site
    info = metadata.sites[site]
    if info is None or info[1] != x.dtype or y.dtype != x.dtype:
        return False
    if x.dim() != 2 or y.dim() != 2 or y.stride(-1) != 1:
        return False  # the kernels address rows by one stride and write y in place
    if metadata.tiles.numel() == 0:
        return True
    if x.stride(-1) != 1:
        x = x.contiguous()
    tiling = _Tiling.of(metadata, info[0], x, split_k)
    t = _shrink(metadata, site, x, tiling)
    _expand(metadata, site, t, y, tiling)
    return True


@dataclass(frozen=True)
class _Tiling:
    """One site's launch shape: the rank padded to a power of two and its blocks, the
    shrink's tiles of ``in`` and their split over programs, and the products' precision."""

    r_pad: int
    block_r: int
    r_blocks: int
    block_k: int
    splits: int
    k_per_split: int
    dot_fp32: bool
    precision: str

    @classmethod
    def of(
        cls, metadata: LoraKernelMetadata, max_rank: int, x: torch.Tensor, split_k: int | None
    ) -> _Tiling:
        in_features = x.shape[1]
        dot_fp32 = x.dtype == torch.float32 or x.device.type == "cpu"
        r_pad = _pow2(max_rank)
        block_r = min(r_pad, 64)
        block_k = 32 if r_pad > 64 else 64
        r_blocks = triton.cdiv(max_rank, block_r)
        splits = _splits(in_features, metadata.tiles.shape[0] * r_blocks, split_k)
        k_per_split = triton.cdiv(triton.cdiv(in_features, splits), block_k) * block_k
        return cls(
            r_pad=r_pad,
            block_r=block_r,
            r_blocks=r_blocks,
            block_k=block_k,
            splits=triton.cdiv(in_features, k_per_split),
            k_per_split=k_per_split,
            dot_fp32=dot_fp32,
            precision="ieee" if dot_fp32 else "tf32",
        )


def _shrink(
    metadata: LoraKernelMetadata, site: int, x: torch.Tensor, tiling: _Tiling
) -> torch.Tensor:
    """``t = x[rows] @ A_g`` for every tile: [splits, lora rows, padded rank] float32
    partial products, summed by the expand."""
    rows = metadata.rows.numel()
    t = torch.empty((tiling.splits, rows, tiling.r_pad), dtype=torch.float32, device=x.device)
    _shrink_kernel[(metadata.tiles.shape[0], tiling.r_blocks, tiling.splits)](
        x,
        t,
        metadata.rows,
        metadata.tiles,
        metadata.tables[site],
        x.shape[1],
        tiling.k_per_split,
        x.stride(0),
        t.stride(0),
        t.stride(1),
        BLOCK_M=metadata.block_m,
        BLOCK_K=tiling.block_k,
        BLOCK_R=tiling.block_r,
        DOT_FP32=tiling.dot_fp32,
        PRECISION=tiling.precision,
    )
    return t


def _expand(
    metadata: LoraKernelMetadata, site: int, t: torch.Tensor, y: torch.Tensor, tiling: _Tiling
) -> None:
    """``y[rows] += t @ B_g`` for every tile, in place."""
    block_n = 64
    out_features = y.shape[1]
    _expand_kernel[(metadata.tiles.shape[0], triton.cdiv(out_features, block_n))](
        t,
        y,
        metadata.rows,
        metadata.tiles,
        metadata.tables[site],
        out_features,
        tiling.splits,
        t.stride(0),
        t.stride(1),
        y.stride(0),
        BLOCK_M=metadata.block_m,
        BLOCK_N=block_n,
        BLOCK_R=min(tiling.r_pad, 32),
        DOT_FP32=tiling.dot_fp32,
        PRECISION=tiling.precision,
    )
