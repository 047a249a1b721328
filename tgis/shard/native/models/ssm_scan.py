"""The Mamba-2 state-space scan and its causal convolution on one sequence's tokens or on
one token of many sequences, in plain torch (float32 state and arithmetic).

Per head ``h`` (``P`` channels, state size ``N``) and token ``t``, with ``dt`` already
through softplus and the time-step limits, ``A`` = -exp(A_log):

    state_t = exp(dt_t * A) * state_{t-1} + dt_t * x_t ⊗ B_t        [P, N]
    y_t     = state_t · C_t + D * x_t                                 [P]

``B`` and ``C`` are given per head (a group's shared by its heads). ``ssm_sequential`` is
that recurrence token by token, the oracle; ``ssm_chunked`` computes the same in the
chunked "state-space dual" form (the quadratic form inside chunks of ``chunk`` tokens, the
recurrence only between chunks), which prefills use; ``ssm_step`` is one token of many
sequences at once, which decodes use. All start from a given state and return the final
one, so a prompt split over several steps gives the result of one pass.

The convolution is depthwise and causal over ``K`` taps: a sequence's input is preceded by
its last ``K - 1`` inputs (its convolution state, zeros at the start).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def ssm_sequential(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    d: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence token by token (the reference): ``x`` [T, H, P], ``dt`` [T, H],
    ``a``/``d`` [H], ``b``/``c`` [T, H, N], ``state`` [H, P, N] → (y [T, H, P], final
    state), all float32."""
    ys = []
    for t in range(x.shape[0]):
        decay = torch.exp(dt[t] * a)[:, None, None]
        state = state * decay + (dt[t][:, None] * x[t])[:, :, None] * b[t][:, None, :]
        ys.append(torch.einsum("hpn,hn->hp", state, c[t]) + d[:, None] * x[t])
    return torch.stack(ys), state


def ssm_chunked(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    d: torch.Tensor,
    state: torch.Tensor,
    chunk: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``ssm_sequential``'s result in the chunked form: within each chunk of ``chunk``
    tokens every output is a decay-weighted sum over the chunk's earlier inputs plus the
    state entering the chunk; only the chunks' states run one after the other. Padding
    tokens (dt 0) neither decay nor add anything."""
    length, heads, channels = x.shape
    pad = -length % chunk
    n = (length + pad) // chunk

    def chunks(t: torch.Tensor) -> torch.Tensor:
        return F.pad(t, (0, 0) * (t.dim() - 1) + (0, pad)).view(n, chunk, *t.shape[1:])

    xdt = chunks(x * dt[..., None])  # [n, L, H, P]
    bc, cc = chunks(b), chunks(c)  # [n, L, H, N]
    cum = chunks(dt * a).cumsum(1)  # [n, L, H]: log-decay from the chunk's start
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=x.device).tril()
    gaps = (cum[:, :, None, :] - cum[:, None, :, :]).masked_fill(~causal[..., None], -torch.inf)
    scores = torch.einsum("clhn,cshn->clsh", cc, bc) * torch.exp(gaps)  # [n, L, S, H]
    y = torch.einsum("clsh,cshp->clhp", scores, xdt)
    # Each chunk's own contribution to the state at its end, and its total decay.
    to_end = torch.exp(cum[:, -1:, :] - cum)  # [n, L, H]
    own = torch.einsum("clh,clhp,clhn->chpn", to_end, xdt, bc)
    through = torch.exp(cum[:, -1, :])[..., None, None]  # [n, H, 1, 1]
    entering = []
    for i in range(n):
        entering.append(state)
        state = state * through[i] + own[i]
    start = torch.stack(entering)  # [n, H, P, N]
    y = y + torch.einsum("clhn,chpn->clhp", cc, start) * torch.exp(cum)[..., None]
    y = y.reshape(n * chunk, heads, channels)[:length] + d[:, None] * x
    return y, state


def ssm_step(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    d: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of ``S`` sequences: ``x`` [S, H, P], ``dt`` [S, H], ``b``/``c``
    [S, H, N], ``state`` [S, H, P, N] → (y [S, H, P], new states)."""
    count, heads, channels = x.shape
    size = b.shape[-1]
    state = state * torch.exp(dt * a)[..., None, None]  # the one new [S, H, P, N] tensor
    flat = state.view(count * heads, channels, size)
    flat.baddbmm_((dt[..., None] * x).reshape(-1, channels, 1), b.reshape(-1, 1, size))
    y = torch.bmm(flat, c.reshape(-1, size, 1)).view(count, heads, channels)
    return y + d[:, None] * x, state


def conv_sequence(
    x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's tokens through the causal depthwise convolution: ``x`` [T, C] after
    ``state`` [K - 1, C] (its last inputs), ``weight`` [C, K] → (outputs [T, C] before the
    activation, float32; the new state: the last K - 1 inputs, in ``state``'s dtype)."""
    full = torch.cat([state.to(x.dtype), x])  # [K - 1 + T, C]
    out = F.conv1d(
        full.t().float()[None], weight.float()[:, None, :], None, groups=weight.shape[0]
    )[0].t()
    if bias is not None:
        out = out + bias.float()
    return out, full[full.shape[0] - state.shape[0] :].to(state.dtype)


def conv_step(
    x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of ``S`` sequences: ``x`` [S, C], ``state`` [S, K - 1, C] →
    (outputs [S, C] before the activation, float32; the new states)."""
    full = torch.cat([state.to(x.dtype), x[:, None, :]], dim=1)  # [S, K, C]
    out = torch.einsum("skc,ck->sc", full.float(), weight.float())
    if bias is not None:
        out = out + bias.float()
    return out, full[:, 1:].to(state.dtype)
