"""Where the newer families put their RMSNorms, as pieces any layer can use.

- ``SubLayerNorms``: the norms around one sub-layer (attention or MLP) and its residual:
  before it (Llama's), after it (OLMo 2's post-sub-layer norms), or both (Gemma 2/3's);
  ``UpcastRMSNorm`` for the families whose norm weight multiplies before the cast back
  (OLMo 2's: the same in float32, a rounding apart in bfloat16); ``OffsetRMSNorm`` for
  the Gemma families' norms, whose weight is stored less one (a scale of ``1 + weight``).
- q/k norms, applied to the projected queries and keys before rotary (``Attention``'s
  ``qk_norm``): ``HeadQKNorm`` normalises each head over its ``head_dim`` (Qwen3, Gemma 3),
  ``ProjectionQKNorm`` the whole q and the whole k projection (OLMo 2); with tensor
  parallelism the latter's mean square is summed over the ranks' heads.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tgis.shard.checkpoints.weights import Weights
from tgis.shard.native.models.layers import Heads, RMSNorm, Shapes
from tgis.shard.parallel.group import TensorParallel


class UpcastRMSNorm(RMSNorm):
    """RMSNorm whose weight multiplies the float32 normalised input, cast back after."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm_upcast(x.float(), self.weight, self.eps).to(x.dtype)


class OffsetRMSNorm(UpcastRMSNorm):
    """Gemma's RMSNorm: the float32 normalised input times ``1 + weight`` (in float32), cast
    back after."""

    def __init__(self, weights: Weights, name: str, eps: float) -> None:
        super().__init__(weights, name, eps)
        self.weight = self.weight.float() + 1.0


class SubLayerNorms:
    """``x + post(sublayer(pre(x))) * multiplier``: either norm may be absent."""

    def __init__(
        self,
        weights: Weights,
        prefix: str,
        names: tuple[str | None, str | None],
        eps: float,
        multiplier: float = 1.0,
        norm: type[RMSNorm] = RMSNorm,
    ) -> None:
        pre, post = names
        self.pre = None if pre is None else norm(weights, f"{prefix}.{pre}.weight", eps)
        self.post = None if post is None else norm(weights, f"{prefix}.{post}.weight", eps)
        self.multiplier = multiplier

    def __call__(
        self, x: torch.Tensor, sublayer: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        y = sublayer(x if self.pre is None else self.pre(x))
        if self.post is not None:
            y = self.post(y)
        return x + (y if self.multiplier == 1.0 else y * self.multiplier)


def sublayer_norm_shapes(prefix: str, names: tuple[str | None, str | None], size: int) -> Shapes:
    """The checkpoint tensors of ``SubLayerNorms`` with ``names``."""
    return {f"{prefix}.{name}.weight": (size,) for name in names if name is not None}


class HeadQKNorm:
    """RMSNorm of every query and key head over ``head_dim`` (weights [head_dim]): the
    family's ``norm`` (Qwen3's plain one, Gemma 3's ``OffsetRMSNorm``)."""

    def __init__(
        self, weights: Weights, prefix: str, eps: float, norm: type[RMSNorm] = RMSNorm
    ) -> None:
        self.q = norm(weights, f"{prefix}.q_norm.weight", eps)
        self.k = norm(weights, f"{prefix}.k_norm.weight", eps)

    def __call__(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.q(q), self.k(k)


def qk_norm_shapes(prefix: str, q_size: int, k_size: int) -> Shapes:
    """The checkpoint tensors of either q/k norm: [head_dim] each for ``HeadQKNorm``, the
    projections' sizes for ``ProjectionQKNorm``."""
    return {f"{prefix}.q_norm.weight": (q_size,), f"{prefix}.k_norm.weight": (k_size,)}


class ProjectionQKNorm:
    """RMSNorm over the whole q projection (all heads) and the whole k projection, weights
    [heads * head_dim] read for this rank's heads; computed in float32, the weight applied
    before the cast back (as OLMo 2's norm)."""

    def __init__(self, weights: Weights, prefix: str, heads: Heads, eps: float) -> None:
        dim = heads.head_dim
        q_rows, kv_rows = (heads.q_first, heads.q_last), (heads.kv_first, heads.kv_last)
        self.q_weight = weights.get_rows(f"{prefix}.q_norm.weight", *(r * dim for r in q_rows))
        self.k_weight = weights.get_rows(f"{prefix}.k_norm.weight", *(r * dim for r in kv_rows))
        self.eps = eps
        self.tp = weights.tp

    def __call__(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (
            _projection_norm(q, self.q_weight, self.eps, self.tp),
            _projection_norm(k, self.k_weight, self.eps, self.tp),
        )


def _projection_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, tp: TensorParallel
) -> torch.Tensor:
    """RMSNorm of ``x`` [tokens, heads, dim] over its heads on every rank together: each rank
    holds an equal share of the heads, or the same replicated head, so the sum of squares
    over all ranks divided by every rank's element count is the whole projection's mean."""
    shape = x.shape
    x32 = x.flatten(1).float()
    if not tp.is_parallel:
        return rms_norm_upcast(x32, weight, eps).to(x.dtype).view(shape)
    square_sum = tp.all_reduce(x32.pow(2).sum(-1, keepdim=True))
    mean = square_sum / (x32.shape[-1] * tp.world_size)
    return (weight * (x32 * torch.rsqrt(mean + eps))).to(x.dtype).view(shape)


def rms_norm_upcast(x32: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of float32 ``x32``, the weight applied in float32 (the result stays float32)."""
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps))
