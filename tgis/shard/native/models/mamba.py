"""The Mamba-2 mixer of a hybrid model's recurrent layers (Granite 4.0's ``mamba``), over
the flattened tokens of a step and the recurrent state of ``recurrent_state.py``.

``in_proj`` gives per token the gate ``z`` [inner], ``xBC`` [inner + 2 x groups x N] and
``dt`` [heads]; ``xBC`` goes through the causal depthwise convolution (``d_conv`` taps) and
SiLU, then splits into ``x`` (heads x head_dim), ``B`` and ``C`` (per group, shared by the
group's heads); ``dt`` = softplus(dt + dt_bias), clamped to ``time_step_limit``; the scan
(``ssm_scan.py``) with A = -exp(A_log) and the skip ``D`` gives ``y``; the gated RMSNorm
normalises y * silu(z) over each group's channels (in float32) before ``out_proj``.
Sequences computing several tokens are convolved and scanned one by one in the chunked
form; the one-token sequences of a step (decodes) in one batched update.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F

from tgis.shard.adapters.lora_layout import LoraSite
from tgis.shard.checkpoints.weights import Weights
from tgis.shard.errors import StartupError
from tgis.shard.native.linear.lora_rows import LoraRows
from tgis.shard.native.linear.sharded import ColumnLinear, lora_part, row_linear
from tgis.shard.native.models.layers import Shapes, linear_shapes
from tgis.shard.native.models.recurrent_state import StateSpec, StateStep
from tgis.shard.native.models.ssm_scan import conv_sequence, conv_step, ssm_chunked, ssm_step


@dataclass(frozen=True)
class MambaArgs:
    """The ``mamba_*`` fields of a config."""

    heads: int
    head_dim: int
    groups: int
    state_size: int
    conv_kernel: int
    conv_bias: bool
    proj_bias: bool
    chunk_size: int
    dt_min: float
    dt_max: float
    eps: float

    @classmethod
    def from_config(cls, raw: dict[str, Any], architecture: str) -> MambaArgs:
        hidden = int(raw["hidden_size"])
        inner = int(raw.get("mamba_expand", 2)) * hidden
        heads = int(raw.get("mamba_n_heads", 128))
        head_dim = raw.get("mamba_d_head", "auto")
        head_dim = inner // heads if head_dim in (None, "auto") else int(head_dim)
        groups = int(raw.get("mamba_n_groups", 1))
        if heads * head_dim != inner:
            raise StartupError(
                f"{architecture}: mamba_n_heads {heads} x mamba_d_head {head_dim} is not "
                f"mamba_expand x hidden_size ({inner})"
            )
        if heads % groups:
            raise StartupError(
                f"{architecture}: mamba_n_groups {groups} does not divide mamba_n_heads {heads}"
            )
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise StartupError(f"{architecture}: unsupported hidden_act '{act}'")
        dt_min, dt_max = _time_step_limit(raw.get("time_step_limit"))
        return cls(
            heads=heads,
            head_dim=head_dim,
            groups=groups,
            state_size=int(raw.get("mamba_d_state", 256)),
            conv_kernel=int(raw.get("mamba_d_conv", 4)),
            conv_bias=bool(raw.get("mamba_conv_bias", True)),
            proj_bias=bool(raw.get("mamba_proj_bias", False)),
            chunk_size=int(raw.get("mamba_chunk_size", 256)),
            dt_min=dt_min,
            dt_max=dt_max,
            eps=float(raw.get("rms_norm_eps", 1e-6)),
        )

    @property
    def inner(self) -> int:
        return self.heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the convolution: x, B and C."""
        return self.inner + 2 * self.groups * self.state_size

    def state_spec(self, num_layers: int, dtype: torch.dtype) -> StateSpec:
        return StateSpec(
            num_layers,
            (self.conv_kernel - 1, self.conv_dim),
            (self.heads, self.head_dim, self.state_size),
            dtype,
        )

    def shapes(self, prefix: str, hidden: int) -> Shapes:
        """The checkpoint tensors of one mixer."""
        heads = self.heads
        shapes = linear_shapes(
            f"{prefix}.in_proj", self.inner + self.conv_dim + heads, hidden, self.proj_bias
        )
        shapes[f"{prefix}.conv1d.weight"] = (self.conv_dim, 1, self.conv_kernel)
        if self.conv_bias:
            shapes[f"{prefix}.conv1d.bias"] = (self.conv_dim,)
        for name in ("dt_bias", "A_log", "D"):
            shapes[f"{prefix}.{name}"] = (heads,)
        shapes[f"{prefix}.norm.weight"] = (self.inner,)
        return shapes | linear_shapes(f"{prefix}.out_proj", hidden, self.inner, self.proj_bias)


def _time_step_limit(value: Any) -> tuple[float, float]:
    """``time_step_limit`` as transformers writes it (infinity as {"__float__": "Infinity"})."""
    if value is None:
        return 0.0, math.inf
    low, high = (float(v["__float__"]) if isinstance(v, dict) else float(v) for v in value)
    return low, high


class MambaMixer:
    """One Mamba-2 layer on this rank: with tensor parallelism its heads are split evenly
    (``in_proj``'s z, x and dt rows, the convolution's x channels, dt_bias, A_log, D and
    the norm's channels; ``out_proj`` row-parallel, one all-reduce), its groups' B and C
    split too when the ranks divide them, else (one group) on every rank, the gated norm's
    sum of squares then summed over the ranks."""

    def __init__(self, weights: Weights, prefix: str, args: MambaArgs, index: int) -> None:
        tp = weights.tp
        heads = tp.split(args.heads, "mamba_n_heads") if tp.is_parallel else (0, args.heads)
        groups = (0, args.groups)
        if tp.is_parallel and args.groups > 1:
            groups = tp.split(args.groups, "mamba_n_groups")
        self.args = replace(args, heads=heads[1] - heads[0], groups=groups[1] - groups[0])
        self.index = index  # its place among the model's Mamba layers (its state's)
        self.tp = tp
        # One group spread over the ranks: the gated norm's statistics are summed over them.
        self.norm_channels = args.inner if tp.is_parallel and args.groups == 1 else 0
        p, n, inner, per_group = args.head_dim, args.state_size, args.inner, args.state_size
        x_rows = (heads[0] * p, heads[1] * p)
        b_rows = (inner + groups[0] * per_group, inner + groups[1] * per_group)
        c_rows = (b_rows[0] + args.groups * n, b_rows[1] + args.groups * n)
        conv_rows = [x_rows, b_rows, c_rows]
        dt_rows = (inner + args.conv_dim + heads[0], inner + args.conv_dim + heads[1])
        in_rows = [x_rows, *((inner + a, inner + b) for a, b in conv_rows), dt_rows]
        in_proj = f"{prefix}.in_proj"
        bias = weights.get_row_ranges(f"{in_proj}.bias", in_rows) if args.proj_bias else None
        site = LoraSite((lora_part(weights, in_proj, in_rows),), row_parallel=False)
        self.in_proj = ColumnLinear(weights.linear(in_proj, rows=in_rows), bias, site)
        self.out_proj = row_linear(weights, f"{prefix}.out_proj", args.proj_bias)
        conv = weights.get_row_ranges(f"{prefix}.conv1d.weight", conv_rows)
        self.conv_weight = conv[:, 0, :]  # [C, K]
        self.conv_bias = None
        if args.conv_bias:
            self.conv_bias = weights.get_row_ranges(f"{prefix}.conv1d.bias", conv_rows)
        self.dt_bias = weights.get_rows(f"{prefix}.dt_bias", *heads).float()
        self.a = -torch.exp(weights.get_rows(f"{prefix}.A_log", *heads).float())
        self.d = weights.get_rows(f"{prefix}.D", *heads).float()
        self.norm_weight = weights.get_rows(f"{prefix}.norm.weight", *x_rows).float()
        # The step's scan in one Triton kernel (``ssm_triton.py``) on CUDA; the torch forms
        # elsewhere (tests set it on the CPU, where Triton's interpreter runs it).
        self.triton_scan = weights.device.type == "cuda"

    def __call__(
        self, x: torch.Tensor, state: StateStep, lora: LoraRows | None = None
    ) -> torch.Tensor:
        """``x``: normed hidden states [tokens, hidden] → the mixer's output [tokens, hidden]
        (with the step's LoRA adapters on in_proj and out_proj); the sequences' new states
        are staged in ``state``."""
        args, tokens = self.args, x.shape[0]
        z, xbc, dt = self.in_proj(x, lora).split([args.inner, args.conv_dim, args.heads], dim=-1)
        dt = torch.clamp(F.softplus(dt.float() + self.dt_bias), args.dt_min, args.dt_max)
        if self.triton_scan:
            y = self._scan_in_one_launch(xbc, dt, state)
            normed = self._gated_norm(y.view(tokens, args.inner), z)
            return self.out_proj(normed.to(x.dtype), lora)
        y = torch.empty(tokens, args.heads, args.head_dim, dtype=torch.float32, device=x.device)
        for segment in state.segments:
            span = slice(segment.start, segment.start + segment.length)
            conv, ssm = state.segment_state(self.index, segment)
            y[span], conv, ssm = self._sequence(xbc[span], dt[span], conv, ssm)
            state.stage_segment(self.index, segment, conv, ssm)
        if state.single_rows.numel():
            rows = state.single_rows
            conv, before = state.single_states(self.index)
            assert before is not None
            y[rows], conv, ssm = self._single(xbc[rows], dt[rows], conv, before)
            state.stage(self.index, state.single_slots, conv, ssm)
        normed = self._gated_norm(y.view(tokens, args.inner), z)
        return self.out_proj(normed.to(x.dtype), lora)

    def _scan_in_one_launch(
        self, xbc: torch.Tensor, dt: torch.Tensor, state: StateStep
    ) -> torch.Tensor:
        """The convolution per sequence (the one-token ones batched), then every
        sequence's scan in one kernel launch; the new states staged. Returns y [T, H, P]."""
        from tgis.shard.native.models.ssm_triton import scan_step

        args, tokens = self.args, xbc.shape[0]
        out = torch.empty(tokens, args.conv_dim, dtype=torch.float32, device=xbc.device)
        for segment in state.segments:
            span = slice(segment.start, segment.start + segment.length)
            conv, _ = state.segment_state(self.index, segment)
            out[span], conv = conv_sequence(xbc[span], conv, self.conv_weight, self.conv_bias)
            state.stage_conv(self.index, segment, conv)
        if state.single_rows.numel():
            rows = state.single_rows
            conv, _ = state.single_states(self.index, ssm=False)
            out[rows], conv = conv_step(xbc[rows], conv, self.conv_weight, self.conv_bias)
            state.stage_conv_rows(self.index, state.single_slots, conv)
        group = args.groups * args.state_size
        x, b, c = F.silu(out).split([args.inner, group, group], dim=-1)
        y, ssm = scan_step(
            x.reshape(tokens, args.heads, args.head_dim),
            dt,
            self.a,
            b.reshape(tokens, args.groups, args.state_size),
            c.reshape(tokens, args.groups, args.state_size),
            self.d,
            state.states.ssm[self.index],
            state.slots,
            state.fresh,
            state.starts,
            state.lengths,
        )
        state.stage_ssm(self.index, state.slots, ssm)
        return y

    def _split(self, xbc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The convolved, activated ``xbc`` [T, C] (float32) as x [T, H, P] and B, C
        [T, H, N] (each group's repeated for its heads)."""
        args, length = self.args, xbc.shape[0]
        group = args.groups * args.state_size
        x, b, c = F.silu(xbc).split([args.inner, group, group], dim=-1)
        per_group = args.heads // args.groups

        def heads(t: torch.Tensor) -> torch.Tensor:
            t = t.view(length, args.groups, args.state_size)
            return t.repeat_interleave(per_group, dim=1) if per_group > 1 else t

        return x.view(length, args.heads, args.head_dim), heads(b), heads(c)

    def _sequence(
        self, xbc: torch.Tensor, dt: torch.Tensor, conv: torch.Tensor, ssm: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One sequence's tokens: (y [T, H, P], new conv state, new SSM state)."""
        out, conv = conv_sequence(xbc, conv, self.conv_weight, self.conv_bias)
        x, b, c = self._split(out)
        chunk = min(self.args.chunk_size, 64, x.shape[0])
        y, ssm = ssm_chunked(x, dt, self.a, b, c, self.d, ssm, chunk)
        return y, conv, ssm

    def _single(
        self, xbc: torch.Tensor, dt: torch.Tensor, conv: torch.Tensor, ssm: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One token of each of several sequences: (y [S, H, P], new states)."""
        out, conv = conv_step(xbc, conv, self.conv_weight, self.conv_bias)
        x, b, c = self._split(out)
        y, ssm = ssm_step(x, dt, self.a, b, c, self.d, ssm)
        return y, conv, ssm

    def _gated_norm(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """RMSNorm of y * silu(z) over each group's channels, times the weight (float32)."""
        args = self.args
        gated = y * F.silu(z.float())
        grouped = gated.view(y.shape[0], args.groups, args.inner // args.groups)
        if self.norm_channels:  # the group's channels on every rank
            mean = self.tp.all_reduce(grouped.pow(2).sum(-1, keepdim=True)) / self.norm_channels
        else:
            mean = grouped.pow(2).mean(-1, keepdim=True)
        normed = grouped * torch.rsqrt(mean + args.eps)
        return normed.view(y.shape[0], args.inner) * self.norm_weight
