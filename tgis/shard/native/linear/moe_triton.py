"""``moe_triton``: a mixture of experts' routed experts on CUDA in two Triton launches, with
no host synchronisation, so that the compiled step and CUDA graphs hold it.

The grouped path (``moe_grouped.grouped``) reads each expert's token count on the host to cut one
GEMM per expert. Here every size is an upper bound known from the shapes alone:

- ``align``: the step's (token, expert) pairs, ``P = tokens x top_k``, sorted by expert
  and laid out in blocks of ``BLOCK_M`` rows, each block one expert's, each expert's rows
  padded to a whole number of blocks (torch ops on the device: counts by ``scatter_add_``,
  a stable ``argsort``, cumulative sums, a ``searchsorted`` for each block's expert). The
  layout has room for ``P + min(E, P) x (BLOCK_M - 1)`` rows, the most any routing needs;
  padding rows hold the pair index ``P`` (none), blocks past the last expert's the expert
  ``E`` (none), and their programs return at once.
- ``_gate_up_kernel``: program (block, column block of the intermediate dimension) gathers
  its pairs' token rows of ``x``, multiplies them by the block's expert's gate and up rows
  (two float32 accumulators) and stores ``act(gate) * up`` at the pair's row of a
  [P, intermediate] buffer. The activation is a constant of the kernel (``ACTIVATIONS``:
  SiLU, GELU, GELU's tanh form, and gpt-oss's clamped SwiGLU, ``(clamp(up, -limit, limit)
  + 1) * g * sigmoid(alpha * g)`` with ``g = min(gate, limit)``); optional biases are added
  to gate and up first.
- ``_down_kernel``: the same blocks over that buffer and the expert's down matrix, each row
  plus the expert's optional down bias, scaled by its pair's routing weight, stored at the
  pair's row of [P, hidden] (a rank other than 0 passes no down bias: the all-reduce adds
  it once); a sum over the ``top_k`` rows of each token (float32) gives its output.

No two programs write the same element, so the result does not depend on scheduling (no
atomics). Tensor parallelism needs nothing here: a rank's weights are its slice of every
expert's intermediate dimension and its output is a partial sum, all-reduced by the layer.

The weights are stacked per expert: ``w13`` [E, 2 x inter, hidden] (gate rows, then up
rows) and ``w2`` [E, hidden, inter]. Products accumulate in float32: on CUDA fp16/bf16
operands go to ``tl.dot`` as they are and the activation's output is rounded to that dtype
for the down product (as the grouped path rounds it); fp32 operands use full precision
(``ieee``). CPU tensors (only under ``TRITON_INTERPRET=1``, the tests' mode) compute every
product in float32, as the interpreter's ``tl.dot`` is wrong on 16-bit operands (see
``attention/triton_paged.py``). The whole layer is the operator ``tgis::fused_moe``: a
compiled step holds it as one call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# The activations of the gated experts: name → the kernel's constant.
ACTIVATIONS = {"silu": 0, "gelu": 1, "gelu_tanh": 2, "clamped_swiglu": 3}
SMALL_BLOCK_M, LARGE_BLOCK_M = 16, 64
LARGE_FROM_PAIRS = 1024  # pairs from which blocks of LARGE_BLOCK_M rows are used
BLOCK_N = 64
BLOCK_K = 64


@dataclass(frozen=True)
class Tiles:
    """The kernels' tile sizes (rows of pairs, output columns, reduction step)."""

    block_m: int
    block_n: int = BLOCK_N
    block_k: int = BLOCK_K


def tiles_for(pairs: int) -> Tiles:
    """Small row blocks for decode steps (little padding per expert), larger for prefill."""
    return Tiles(LARGE_BLOCK_M if pairs >= LARGE_FROM_PAIRS else SMALL_BLOCK_M)


@dataclass(frozen=True)
class Alignment:
    """The pairs grouped in blocks of one expert each (see ``align``)."""

    pairs: torch.Tensor  # int32 [capacity]: a pair index t * top_k + j, or P for padding
    block_experts: torch.Tensor  # int32 [capacity / block_m]: the expert, or E for none


def capacity(pairs: int, experts: int, block_m: int) -> int:
    """Rows of the block layout that any routing of ``pairs`` pairs over ``experts``
    experts fits in: every expert with pairs pads at most ``block_m - 1`` rows."""
    rows = pairs + min(experts, pairs) * (block_m - 1)
    return triton.cdiv(rows, block_m) * block_m


def align(ids: torch.Tensor, experts: int, block_m: int) -> Alignment:
    """``ids`` [tokens, top_k] (the experts of each token) as blocks of ``block_m`` pairs of
    one expert each, in expert order, with torch ops of fixed sizes (no host reads)."""
    flat = ids.reshape(-1).to(torch.int64)
    total = flat.numel()
    counts = torch.zeros(experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = torch.div(counts + block_m - 1, block_m, rounding_mode="floor") * block_m
    padded_ends = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    expert_of = flat.index_select(0, order)
    rank = torch.arange(total, device=flat.device) - (torch.cumsum(counts, 0) - counts)[expert_of]
    destination = (padded_ends - padded)[expert_of] + rank
    rows = capacity(total, experts, block_m)
    pairs = torch.full((rows,), total, dtype=torch.int32, device=flat.device)
    pairs.scatter_(0, destination, order.to(torch.int32))
    starts = torch.arange(0, rows, block_m, device=flat.device)
    block_experts = torch.searchsorted(padded_ends, starts, right=True).to(torch.int32)
    return Alignment(pairs, block_experts)


@triton.jit
def _gated(g, u, alpha, limit, ACTIVATION: tl.constexpr):
    """``ACTIVATIONS``' gated product of float32 ``g`` (gate) and ``u`` (up)."""
    if ACTIVATION == 0:
        out = g * tl.sigmoid(g) * u
    elif ACTIVATION == 1:
        out = 0.5 * g * (1.0 + tl.math.erf(g * 0.7071067811865476)) * u
    elif ACTIVATION == 2:  # 0.5 * (1 + tanh(v)) = sigmoid(2v)
        out = g * tl.sigmoid(1.5957691216057308 * (g + 0.044715 * g * g * g)) * u
    else:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
        out = g * tl.sigmoid(alpha * g) * (u + 1.0)
    return out


@triton.jit
def _block_rows(pairs_ptr, block, total, top_k, BLOCK_M: tl.constexpr):
    """The block's pair indices, which of them are pairs (not padding), and their tokens."""
    pair = tl.load(pairs_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pair < total
    return pair, valid, pair // top_k


@triton.jit
def _row_tile(ptr, rows, valid, k, k_ok, width, DOT_FP32: tl.constexpr):
    """Columns ``k`` of rows ``rows`` of a [*, width] matrix: [len(rows), len(k)]."""
    tile = tl.load(
        ptr + rows.to(tl.int64)[:, None] * width + k[None, :],
        mask=valid[:, None] & k_ok[None, :],
        other=0.0,
    )
    return tile.to(tl.float32) if DOT_FP32 else tile


@triton.jit
def _weight_tile(ptr, n, n_ok, k, k_ok, width, DOT_FP32: tl.constexpr):
    """Rows ``n`` of a [*, width] weight transposed, columns ``k``: [len(k), len(n)]."""
    tile = tl.load(
        ptr + n[None, :] * width + k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0
    )
    return tile.to(tl.float32) if DOT_FP32 else tile


@triton.jit
def _gate_up_kernel(  # noqa: PLR0913 - a Triton function takes every pointer, size and tile
    x_ptr,
    w13_ptr,
    b13_ptr,
    h_ptr,
    pairs_ptr,
    block_experts_ptr,
    total,
    top_k,
    experts,
    hidden,
    inter,
    alpha,
    limit,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ACTIVATION: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """``h[pair, n] = act(x[token] . gate_e[n]) * (x[token] . up_e[n])`` for the block's
    pairs and ``BLOCK_N`` columns ``n`` of the intermediate dimension."""
    block = tl.program_id(0)
    expert = tl.load(block_experts_ptr + block)
    if expert < experts:
        pair, valid, token = _block_rows(pairs_ptr, block, total, top_k, BLOCK_M)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < inter
        gate_ptr = w13_ptr + expert.to(tl.int64) * 2 * inter * hidden
        up_ptr = gate_ptr + inter * hidden
        acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < hidden
            a = _row_tile(x_ptr, token, valid, k, k_ok, hidden, DOT_FP32)
            b_gate = _weight_tile(gate_ptr, n, n_ok, k, k_ok, hidden, DOT_FP32)
            b_up = _weight_tile(up_ptr, n, n_ok, k, k_ok, hidden, DOT_FP32)
            acc_gate += tl.dot(a, b_gate, input_precision=PRECISION)
            acc_up += tl.dot(a, b_up, input_precision=PRECISION)
        if HAS_BIAS:
            bias = b13_ptr + expert.to(tl.int64) * 2 * inter + n
            acc_gate += tl.load(bias, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            acc_up += tl.load(bias + inter, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        h = _gated(acc_gate, acc_up, alpha, limit, ACTIVATION)
        tl.store(
            h_ptr + pair.to(tl.int64)[:, None] * inter + n[None, :],
            h.to(h_ptr.dtype.element_ty),
            mask=valid[:, None] & n_ok[None, :],
        )


@triton.jit
def _down_kernel(  # noqa: PLR0913 - a Triton function takes every pointer, size and tile
    h_ptr,
    w2_ptr,
    b2_ptr,
    weights_ptr,
    y_ptr,
    pairs_ptr,
    block_experts_ptr,
    total,
    top_k,
    experts,
    hidden,
    inter,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """``y[pair, n] = weight[pair] * (h[pair] . down_e[n] + b_e[n])`` for the block's pairs and
    ``BLOCK_N`` columns ``n`` of the hidden dimension."""
    block = tl.program_id(0)
    expert = tl.load(block_experts_ptr + block)
    if expert < experts:
        pair, valid, _ = _block_rows(pairs_ptr, block, total, top_k, BLOCK_M)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < hidden
        down_ptr = w2_ptr + expert.to(tl.int64) * hidden * inter
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, inter, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < inter
            a = _row_tile(h_ptr, pair, valid, k, k_ok, inter, DOT_FP32)
            b = _weight_tile(down_ptr, n, n_ok, k, k_ok, inter, DOT_FP32)
            acc += tl.dot(a, b, input_precision=PRECISION)
        if HAS_BIAS:
            bias = b2_ptr + expert.to(tl.int64) * hidden + n
            acc += tl.load(bias, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        weight = tl.load(weights_ptr + pair, mask=valid, other=0.0)
        tl.store(
            y_ptr + pair.to(tl.int64)[:, None] * hidden + n[None, :],
            (acc * weight[:, None]).to(y_ptr.dtype.element_ty),
            mask=valid[:, None] & n_ok[None, :],
        )


def fused_moe(  # noqa: PLR0913 - an operator takes its tensors and constants flat
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    activation: str,
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    alpha: float = 1.702,
    limit: float = 7.0,
) -> torch.Tensor:
    """This rank's partial sum [tokens, hidden] of each token's experts' outputs: ``x``
    [tokens, hidden], ``weights`` [tokens, top_k] (float32) and ``ids`` [tokens, top_k] the
    routing, ``w13`` [E, 2 x inter, hidden] and ``w2`` [E, hidden, inter] the experts,
    ``b13`` [E, 2 x inter] and ``b2`` [E, hidden] their biases (None: none), ``alpha`` and
    ``limit`` the clamped SwiGLU's (unused by the other activations)."""
    gating = Gating(activation, b13, b2, alpha, limit)
    return fused_moe_with(x, weights, ids, w13, w2, gating, tiles_for(ids.numel()))


@dataclass(frozen=True)
class Gating:
    """The experts' activation (``ACTIVATIONS``), optional biases and clamped-SwiGLU
    constants."""

    activation: str
    b13: torch.Tensor | None = None
    b2: torch.Tensor | None = None
    alpha: float = 1.702
    limit: float = 7.0


def fused_moe_with(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    gating: Gating,
    tiles: Tiles,
) -> torch.Tensor:
    """``fused_moe`` with the given tile sizes (the tests' small tiles)."""
    tokens, hidden = x.shape
    top_k = ids.shape[1]
    experts, inter = w13.shape[0], w2.shape[2]
    total = tokens * top_k
    if total == 0:
        return torch.zeros_like(x)
    x = x.contiguous()
    layout = align(ids, experts, tiles.block_m)
    dot_fp32 = x.device.type == "cpu" or x.dtype == torch.float32
    precision = "ieee" if dot_fp32 else "tf32"  # tf32: unused on 16-bit operands
    h = torch.empty(total, inter, dtype=x.dtype, device=x.device)
    blocks = layout.block_experts.numel()
    sizes = (layout.pairs, layout.block_experts, total, top_k, experts, hidden, inter)
    constants = {
        "BLOCK_M": tiles.block_m,
        "BLOCK_N": tiles.block_n,
        "BLOCK_K": tiles.block_k,
        "DOT_FP32": dot_fp32,
        "PRECISION": precision,
    }
    b13, b2 = gating.b13, gating.b2
    _gate_up_kernel[(blocks, triton.cdiv(inter, tiles.block_n))](
        x,
        w13,
        w13 if b13 is None else b13,  # a pointer the kernel never reads
        h,
        *sizes,
        gating.alpha,
        gating.limit,
        ACTIVATION=ACTIVATIONS[gating.activation],
        HAS_BIAS=b13 is not None,
        **constants,
    )
    y = torch.empty(total, hidden, dtype=x.dtype, device=x.device)
    _down_kernel[(blocks, triton.cdiv(hidden, tiles.block_n))](
        h,
        w2,
        w2 if b2 is None else b2,
        weights.float().contiguous(),
        y,
        *sizes,
        HAS_BIAS=b2 is not None,
        **constants,
    )
    return y.view(tokens, top_k, hidden).sum(dim=1, dtype=torch.float32).to(x.dtype)


_OPERATOR = torch.library.custom_op("tgis::fused_moe", fused_moe, mutates_args=())


@_OPERATOR.register_fake
def _fused_moe_shape(  # noqa: PLR0913 - the operator's arguments
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    activation: str,
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    alpha: float = 1.702,
    limit: float = 7.0,
) -> torch.Tensor:
    return torch.empty_like(x)
