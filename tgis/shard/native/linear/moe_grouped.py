"""A mixture of experts' kernels, chosen per device, and the grouped path.

``expert_kernel`` picks the fused Triton kernels (``moe_triton.py``) on CUDA where Triton
imports, the grouped path elsewhere. The grouped path (``grouped``) sorts the (token,
expert) pairs by expert, runs one GEMM per expert that has pairs (a loop over experts,
never over tokens), scales each row by its routing weight and adds it back to its token
with ``index_add``. It reads the experts' counts on the host: the eager step calls it
directly; the compiled step, which cannot trace that, calls it as one opaque operator,
``tgis::grouped_moe`` (``grouped_moe``, over the experts' dense matrices), as it calls
attention.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tgis.shard.native.linear.cpu_gemm import linear

log = logging.getLogger(__name__)

Activation = Callable[[torch.Tensor], torch.Tensor]

# The gated experts' activations by name (the fused kernel's constants: moe_triton.ACTIVATIONS).
EXPERT_ACTIVATIONS: dict[str, Activation] = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": functools.partial(F.gelu, approximate="tanh"),
}
KERNELS = ("triton", "grouped")
CLAMPED_SWIGLU = "clamped_swiglu"  # gpt-oss's (ClampedSwiGLU), beside EXPERT_ACTIVATIONS


def expert_kernel(device: torch.device) -> str:
    """``triton`` (the fused kernels, ``moe_triton.py``) on CUDA where Triton imports, else
    ``grouped``; logs the choice, and why a CUDA device runs the grouped path."""
    if device.type != "cuda":
        return "grouped"
    if _triton_imports():
        log.info("Mixture-of-experts layers: the fused Triton kernels")
        return "triton"
    log.warning(
        "Mixture-of-experts layers: Triton does not import, so the grouped path runs on CUDA; "
        "it reads its counts on the host, and CUDA graphs will not capture the step"
    )
    return "grouped"


def _triton_imports() -> bool:
    """Whether Triton is there and imports (a broken install means the grouped path)."""
    if importlib.util.find_spec("triton") is None:
        return False
    try:
        import tgis.shard.native.linear.moe_triton  # noqa: F401 - registers tgis::fused_moe
    except Exception:
        return False
    return True


@dataclass(frozen=True)
class ClampedSwiGLU:
    """gpt-oss's experts' activation: gate clamped to at most ``limit``, up to [-limit,
    limit], out = (up + 1) * gate * sigmoid(alpha * gate). Run as the grouped path's
    ``act(gate) * up``: ``clamp`` turns a [gate | up] projection into [clamped gate |
    clamped up + 1], ``act`` is the gate's half."""

    alpha: float
    limit: float

    def clamp(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        limit = self.limit
        return torch.cat([gate.clamp(max=limit), up.clamp(-limit, limit) + 1], dim=-1)

    def act(self, gate: torch.Tensor) -> torch.Tensor:
        return gate * torch.sigmoid(gate * self.alpha)


def grouped(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    gate_up: Sequence[Callable[[torch.Tensor], torch.Tensor]],
    down: Sequence[Callable[[torch.Tensor], torch.Tensor]],
    act: Activation,
) -> torch.Tensor:
    """The grouped path: the (token, expert) pairs sorted by expert, one GEMM per expert
    with pairs (``gate_up[e]``, then ``down[e]`` on ``act(gate) * up``), each row scaled by
    its routing weight and added back to its token."""
    k = ids.shape[1]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    rows = torch.div(order, k, rounding_mode="floor")
    counts = torch.bincount(flat, minlength=len(gate_up)).tolist()
    grouped_x = x.index_select(0, rows)
    out = torch.empty_like(grouped_x)
    start = 0
    for expert, count in enumerate(counts):
        if count:
            stop = start + count
            gate, up = gate_up[expert](grouped_x[start:stop]).chunk(2, dim=-1)
            out[start:stop] = down[expert](act(gate) * up)
            start = stop
    out = out * weights.reshape(-1)[order].unsqueeze(-1).to(out.dtype)
    return torch.zeros_like(x).index_add_(0, rows, out)


@torch.library.custom_op("tgis::grouped_moe", mutates_args=())
def grouped_moe(  # noqa: PLR0913 - an operator takes its tensors and constants flat
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    gate_up: list[torch.Tensor],
    down: list[torch.Tensor],
    activation: str,
    gate_up_bias: list[torch.Tensor | None],
    down_bias: list[torch.Tensor | None],
    alpha: float = 1.702,
    limit: float = 7.0,
) -> torch.Tensor:
    """``grouped`` over dense expert matrices and their biases (None: none), for the compiled
    step (which cannot trace its host reads): one operator call per layer. ``activation``:
    a name of ``EXPERT_ACTIVATIONS`` or ``CLAMPED_SWIGLU`` (with ``alpha`` and ``limit``)."""
    glu = ClampedSwiGLU(alpha, limit) if activation == CLAMPED_SWIGLU else None
    return grouped(
        x,
        weights,
        ids,
        [_projection(w, b, glu) for w, b in zip(gate_up, gate_up_bias, strict=True)],
        [functools.partial(linear, weight=w, bias=b) for w, b in zip(down, down_bias, strict=True)],
        EXPERT_ACTIVATIONS[activation] if glu is None else glu.act,
    )


def _projection(
    weight: torch.Tensor, bias: torch.Tensor | None, glu: ClampedSwiGLU | None
) -> Callable[[torch.Tensor], torch.Tensor]:
    """An expert's gate/up product, clamped where the activation is ``ClampedSwiGLU``."""

    def project(x: torch.Tensor) -> torch.Tensor:
        y = linear(x, weight, bias)
        return y if glu is None else glu.clamp(y)

    return project


@grouped_moe.register_fake
def _grouped_moe_shape(  # noqa: PLR0913 - the operator's arguments
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    gate_up: list[torch.Tensor],
    down: list[torch.Tensor],
    activation: str,
    gate_up_bias: list[torch.Tensor | None],
    down_bias: list[torch.Tensor | None],
    alpha: float = 1.702,
    limit: float = 7.0,
) -> torch.Tensor:
    return torch.empty_like(x)
