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
def grouped_moe(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    gate_up: list[torch.Tensor],
    down: list[torch.Tensor],
    activation: str,
) -> torch.Tensor:
    """``grouped`` over dense expert matrices, for the compiled step (which cannot trace
    its host reads): one operator call per layer."""
    return grouped(
        x,
        weights,
        ids,
        [functools.partial(linear, weight=w) for w in gate_up],
        [functools.partial(linear, weight=w) for w in down],
        EXPERT_ACTIVATIONS[activation],
    )


@grouped_moe.register_fake
def _grouped_moe_shape(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    gate_up: list[torch.Tensor],
    down: list[torch.Tensor],
    activation: str,
) -> torch.Tensor:
    return torch.empty_like(x)
