"""Mixture-of-experts layers: a router picks each token's top-k experts, only those experts
run on it, and their outputs are summed with the router's weights.

Routing (``Routing``): router logits, softmax over every expert in float32, the top k;
renormalised to sum to one (Mixtral; Qwen2/Qwen3-MoE with ``norm_topk_prob``; Granite-MoE's
softmax over the top-k logits is the same number) or kept as they are (Qwen-MoE without it).

Experts (``Experts``): each a gated MLP whose gate/up matrices are column-parallel and down
matrix row-parallel, as a dense MLP's (``sharded.py``): every rank holds its slice of every
expert's intermediate dimension. The grouped path sorts the (token, expert) pairs by expert,
runs one GEMM per expert that has tokens (a loop over experts, never over tokens), scales
each row by its routing weight and adds it back to its token with ``index_add``. The
partial sums of the experts (and of a shared expert, Qwen2-MoE's, gated by a sigmoid) are
all-reduced once per layer.

The grouped path (``moe_grouped.py``) reads each expert's count on the host, which neither a
compiled step nor a CUDA graph can hold. On CUDA (``moe_grouped.expert_kernel``: where
Triton imports) the experts are stacked per expert instead and run by the fused Triton
kernels (``moe_triton.py``: no host reads, so the compiled step and CUDA graphs include the
layer). Elsewhere the compiled step calls the grouped path as one opaque operator
(``tgis::grouped_moe``), as it calls attention; the eager step calls it directly (with
oneDNN-packed weights on the CPU).

gpt-oss's experts (``Experts``' named options, on every path): biases on gate/up and down
(``biases``: the down bias added on rank 0 alone, before the routing weight, so the
all-reduce adds it once), a clamped SwiGLU (``moe_grouped.ClampedSwiGLU``), a router with a
bias (``SparseMoE.router_bias``), and their checkpoint layout (``interleaved_experts``:
input-major 3-D tensors, gate and up interleaved, or MXFP4 blocks dequantized at load).

Quantized expert matrices are not read (MXFP4 aside, dequantized): a model with them is
refused at start (``refuse_quantized``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tgis.shard.checkpoints.quantized import mxfp4
from tgis.shard.checkpoints.weights import Weights
from tgis.shard.errors import StartupError
from tgis.shard.native.linear.lora_rows import LoraRows
from tgis.shard.native.linear.moe_grouped import (
    EXPERT_ACTIVATIONS,
    KERNELS,
    ClampedSwiGLU,
    grouped,
)
from tgis.shard.native.linear.sharded import ColumnLinear, RowLinear, column_linear, row_linear
from tgis.shard.parallel.group import TensorParallel

Activation = Callable[[torch.Tensor], torch.Tensor]
ExpertReader = Callable[[int, tuple[int, int]], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
"""``read(expert, (first, last))``: that expert's gate rows, up rows and down columns
[first, last) of its intermediate dimension (this rank's slice)."""


@dataclass(frozen=True)
class Routing:
    """How a family turns router logits into experts and weights."""

    num_experts: int
    top_k: int
    renormalize: bool  # the top-k softmax weights divided by their sum

    def __call__(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``logits`` [tokens, experts] → (weights [tokens, k] float32, ids [tokens, k])."""
        probs = torch.softmax(logits.float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids


def refuse_quantized(weights: Weights, architecture: str) -> None:
    """StartupError for a quantized checkpoint (or ``--quantize``) of a mixture-of-experts
    model: its experts would need their own layouts, which tgis does not read yet."""
    if weights.layout is not None:
        raise StartupError(
            f"{architecture}: quantized mixture-of-experts models are not supported by the "
            "native engine yet (its experts are read as dense matrices only); serve the "
            "unquantized checkpoint"
        )


def separate_experts(weights: Weights, prefix: str, names: Sequence[str]) -> ExpertReader:
    """Experts stored one module each: ``<prefix>.<e>.<gate|up|down>.weight`` with
    ``names`` the three module names (Mixtral's w1/w3/w2, Qwen-MoE's *_proj)."""
    gate, up, down = names

    def read(expert: int, cols: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        first, last = cols
        module = f"{prefix}.{expert}"
        return (
            weights.get_part(f"{module}.{gate}.weight", slice(first, last)),
            weights.get_part(f"{module}.{up}.weight", slice(first, last)),
            weights.get_part(f"{module}.{down}.weight", slice(None), slice(first, last)),
        )

    return read


def fused_experts(weights: Weights, gate_up: str, down: str) -> ExpertReader:
    """Experts stored as two 3-D tensors (Granite-MoE): ``gate_up`` [experts, 2 x inter,
    hidden] (gate rows, then up rows) and ``down`` [experts, hidden, inter]."""
    inter = weights.shape(down)[2]

    def read(expert: int, cols: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        first, last = cols
        one = slice(expert, expert + 1)
        return (
            weights.get_part(gate_up, one, slice(first, last))[0],
            weights.get_part(gate_up, one, slice(inter + first, inter + last))[0],
            weights.get_part(down, one, slice(None), slice(first, last))[0],
        )

    return read


def interleaved_experts(weights: Weights, prefix: str) -> tuple[ExpertReader, ExpertReader]:
    """gpt-oss's experts (``<prefix>.gate_up_proj``, ``.down_proj`` and their ``_bias``):
    the matrix reader and the bias reader (``Experts``' ``biases``). The dense tensors are
    input-major, ``gate_up_proj`` [experts, hidden, 2 x inter] with gate and up columns
    interleaved (gate ``2i``, up ``2i + 1``) and ``down_proj`` [experts, inter, hidden]; an
    MXFP4 checkpoint stores them output-major as ``_blocks``/``_scales``
    (``checkpoints/quantized/mxfp4.py``), dequantized here, one expert at a time."""
    gate_up, down = f"{prefix}.gate_up_proj", f"{prefix}.down_proj"
    packed = f"{gate_up}_blocks" in weights

    def read(expert: int, cols: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        first, last = cols
        one = slice(expert, expert + 1)
        if packed:  # [2 x inter, hidden] rows and [hidden, inter] columns, output-major
            rows = slice(2 * first, 2 * last)
            fused = _mxfp4(weights, gate_up, one, rows)
            lo, hi = first // mxfp4.BLOCK, -(-last // mxfp4.BLOCK)
            down_cols = _mxfp4(weights, down, one, slice(None), slice(lo, hi))
            start = first - lo * mxfp4.BLOCK
            down_part = down_cols[:, start : start + last - first]
        else:
            fused = weights.get_part(gate_up, one, slice(None), slice(2 * first, 2 * last))[0].T
            down_part = weights.get_part(down, one, slice(first, last))[0].T
        return fused[0::2].contiguous(), fused[1::2].contiguous(), down_part.contiguous()

    def read_biases(
        expert: int, cols: tuple[int, int]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        first, last = cols
        one = slice(expert, expert + 1)
        fused = weights.get_part(f"{gate_up}_bias", one, slice(2 * first, 2 * last))[0]
        down_bias = weights.get_part(f"{down}_bias", one)[0]
        return fused[0::2].contiguous(), fused[1::2].contiguous(), down_bias

    return read, read_biases


def _mxfp4(weights: Weights, name: str, *index: slice) -> torch.Tensor:
    """Part ``index`` of the MXFP4 matrix ``name`` (its blocks and scales) of one expert,
    dequantized into the model's dtype: [rows, columns]."""
    blocks = weights.get_part(f"{name}_blocks", *index)
    scales = weights.get_part(f"{name}_scales", *index)
    return mxfp4.dequantize(blocks, scales, weights.dtype)[0]


class Experts:
    """Every expert's gate/up (fused, column-parallel) and down (row-parallel, summed by
    the caller's one all-reduce) on this rank's slice of the intermediate dimension:
    linear layers for the grouped path, or (``kernel`` ``triton``) two stacked tensors,
    ``w13`` [experts, 2 x inter, hidden] and ``w2`` [experts, hidden, inter], for the
    fused kernels. ``activation``: a name of ``EXPERT_ACTIVATIONS``.

    gpt-oss's options: ``biases`` reads each expert's gate, up and down biases as ``read``
    its matrices (the down bias kept on rank 0 alone: the caller's all-reduce adds it once);
    ``glu`` replaces ``act(gate) * up`` (``ClampedSwiGLU``; the fused kernels' own
    ``clamped_swiglu``)."""

    def __init__(
        self,
        read: ExpertReader,
        num_experts: int,
        inter: int,
        tp: TensorParallel,
        activation: str,
        kernel: str = "grouped",
        *,
        biases: ExpertReader | None = None,
        glu: ClampedSwiGLU | None = None,
    ) -> None:
        if activation not in EXPERT_ACTIVATIONS or kernel not in KERNELS:
            raise StartupError(f"experts with activation {activation!r}, kernel {kernel!r}")
        cols = tp.split(inter, "the experts' intermediate size") if tp.is_parallel else (0, inter)
        self.gate_up: list[ColumnLinear] = []
        self.down: list[RowLinear] = []
        self.w13: torch.Tensor | None = None
        self.w2: torch.Tensor | None = None
        self.b13: torch.Tensor | None = None
        self.b2: torch.Tensor | None = None
        if kernel == "triton":
            self.w13, self.w2 = _stacked(read, num_experts, cols)
            if biases is not None:
                self.b13, self.b2 = _stacked(biases, num_experts, cols)
                self.b2 = self.b2 if tp.rank == 0 else None
        else:
            for expert in range(num_experts):
                gate, up, down = read(expert, cols)
                gate_up_bias = down_bias = None
                if biases is not None:
                    gate_bias, up_bias, down_bias = biases(expert, cols)
                    gate_up_bias = torch.cat([gate_bias, up_bias])
                    down_bias = down_bias if tp.rank == 0 else None
                self.gate_up.append(ColumnLinear([gate, up], gate_up_bias))
                self.down.append(RowLinear(down, down_bias, tp, reduce=False))
        self.activation = activation
        self.act = EXPERT_ACTIVATIONS[activation] if glu is None else glu.act
        self.glu = glu
        # With a glu: each expert's projection, then the clamps (not a second list of the
        # linear layers, which DecoderLM's walk over attributes would find twice).
        self.clamped: list[Callable[[torch.Tensor], torch.Tensor]] = []
        if glu is not None:
            self.clamped = [_then(linear, glu.clamp) for linear in self.gate_up]

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """This rank's partial sum [tokens, hidden] of each token's experts' outputs, weighted
        by ``weights`` [tokens, k] (``ids`` [tokens, k] the experts)."""
        if self.w13 is not None:
            glu = self.glu
            out: torch.Tensor = torch.ops.tgis.fused_moe(
                x,
                weights,
                ids,
                self.w13,
                self.w2,
                self.activation if glu is None else "clamped_swiglu",
                self.b13,
                self.b2,
                1.702 if glu is None else glu.alpha,  # the defaults: unused
                7.0 if glu is None else glu.limit,
            )
            return out
        if torch.compiler.is_compiling():  # the grouped path as one opaque call
            return self._grouped_operator(x, weights, ids)
        return grouped(x, weights, ids, self.clamped or self.gate_up, self.down, self.act)

    def _grouped_operator(
        self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
    ) -> torch.Tensor:
        """``tgis::grouped_moe`` over the experts' dense matrices and biases."""
        glu = self.glu
        gate_up_bias = [linear.bias for linear in self.gate_up]
        down_bias = [linear.bias for linear in self.down]
        out: torch.Tensor = torch.ops.tgis.grouped_moe(
            x,
            weights,
            ids,
            [_dense(linear.weight) for linear in self.gate_up],
            [_dense(linear.weight) for linear in self.down],
            self.activation if glu is None else "clamped_swiglu",
            gate_up_bias,
            down_bias,
            1.702 if glu is None else glu.alpha,  # the defaults: unused
            7.0 if glu is None else glu.limit,
        )
        return out


def _then(
    first: Callable[[torch.Tensor], torch.Tensor], second: Callable[[torch.Tensor], torch.Tensor]
) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda x: second(first(x))


def _stacked(
    read: ExpertReader, num_experts: int, cols: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every expert's [gate; up] rows and down columns (or biases: ``read`` a bias reader),
    stacked: ``w13``, ``w2`` (filled expert by expert: one layer's experts are never held
    twice)."""
    w13 = w2 = torch.empty(0)
    for expert in range(num_experts):
        gate, up, down = read(expert, cols)
        if expert == 0:
            w13 = gate.new_empty(num_experts, 2 * gate.shape[0], *gate.shape[1:])
            w2 = down.new_empty(num_experts, *down.shape)
        w13[expert].copy_(torch.cat([gate, up]))
        w2[expert].copy_(down)
    return w13, w2


def _dense(weight: object) -> torch.Tensor:
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"the compiled grouped experts take dense weights, not {type(weight)}")
    return weight


class SharedExpert:
    """Qwen2-MoE's shared expert: a gated MLP every token runs, scaled by
    sigmoid(x · gate) (``gate``: None for an ungated one); its down projection is summed
    by the MoE layer's all-reduce."""

    def __init__(self, weights: Weights, prefix: str, gate: str | None, act: Activation) -> None:
        self.gate_up = column_linear(weights, [f"{prefix}.gate_proj", f"{prefix}.up_proj"], False)
        self.down = row_linear(weights, f"{prefix}.down_proj", False)
        self.down.reduce = False
        self.gate = None if gate is None else weights.get(f"{gate}.weight")
        self.act = act

    def __call__(self, x: torch.Tensor, lora: LoraRows | None) -> torch.Tensor:
        gate, up = self.gate_up(x, lora).chunk(2, dim=-1)
        out = self.down(self.act(gate) * up, lora)
        if self.gate is None:
            return out
        return out * torch.sigmoid(F.linear(x, self.gate))


class SparseMoE:
    """One mixture-of-experts MLP: the router (whole on every rank), the routed experts and
    an optional shared expert; ``x`` [tokens, hidden] → [tokens, hidden], all-reduced."""

    def __init__(
        self,
        router: torch.Tensor,
        routing: Routing,
        experts: Experts,
        tp: TensorParallel,
        shared: SharedExpert | None = None,
        router_bias: torch.Tensor | None = None,
    ) -> None:
        if router.shape[0] != routing.num_experts:
            raise StartupError(
                f"the router has {router.shape[0]} experts; the config says {routing.num_experts}"
            )
        self.router = router
        self.router_bias = router_bias  # gpt-oss's router has one
        self.routing = routing
        self.experts = experts
        self.shared = shared
        self.tp = tp

    def __call__(self, x: torch.Tensor, lora: LoraRows | None = None) -> torch.Tensor:
        weights, ids = self.routing(F.linear(x, self.router, self.router_bias))
        out = self.experts(x, weights, ids)
        if self.shared is not None:
            out = out + self.shared(x, lora)
        return self.tp.all_reduce(out)
