"""The Mamba-2 scan of a whole step in one Triton kernel (CUDA; tested on the CPU in
Triton's interpreter, ``TRITON_INTERPRET=1``, against ``ssm_scan.ssm_sequential``).

``scan_kernel``: a program owns one sequence, one head and ``BLOCK_P`` of its channels,
keeps their [BLOCK_P, N] state in registers (loaded from the sequence's slot, or zeros
when it starts at position 0) and walks the sequence's tokens of the step in order:

    state = exp(dt * A) * state + dt * x ⊗ B;   y = state · C + D * x

writing each token's ``y`` and, at the end, the state into the step's staging tensor (the
runner writes it to the slot once the step succeeds). Prompt chunks and one-token decodes
of any mix of sequences share the launch; all arithmetic is float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def scan_kernel(  # noqa: PLR0913 - a kernel's pointers and shapes
    x_ptr,  # [T, H, P] float32
    dt_ptr,  # [T, H] float32 (after softplus and clamping)
    a_ptr,  # [H] float32
    b_ptr,  # [T, G, N] float32
    c_ptr,  # [T, G, N] float32
    d_ptr,  # [H] float32
    pool_ptr,  # [slots, H, P, N] float32: the states before the step
    slots_ptr,  # [S] int64
    fresh_ptr,  # [S] int32: 1 when the sequence starts at position 0
    starts_ptr,  # [S] int64: its first row
    lens_ptr,  # [S] int64: its rows this step
    y_ptr,  # [T, H, P] float32
    out_ptr,  # [S, H, P, N] float32: the states after the step
    H: tl.constexpr,
    P: tl.constexpr,
    N: tl.constexpr,
    HEADS_PER_GROUP: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    p_ok = p < P
    n_ok = n < N
    mask = p_ok[:, None] & n_ok[None, :]
    group = head // HEADS_PER_GROUP
    G: tl.constexpr = H // HEADS_PER_GROUP
    slot = tl.load(slots_ptr + seq)
    fresh = tl.load(fresh_ptr + seq)
    start = tl.load(starts_ptr + seq)
    length = tl.load(lens_ptr + seq)
    cell = (head * P + p[:, None]) * N + n[None, :]
    state = tl.load(pool_ptr + slot * H * P * N + cell, mask=mask, other=0.0)
    state = tl.where(fresh != 0, tl.zeros_like(state), state)
    a = tl.load(a_ptr + head)
    d = tl.load(d_ptr + head)
    for i in range(0, length):
        row = start + i
        dt = tl.load(dt_ptr + row * H + head)
        x = tl.load(x_ptr + (row * H + head) * P + p, mask=p_ok, other=0.0)
        b = tl.load(b_ptr + (row * G + group) * N + n, mask=n_ok, other=0.0)
        c = tl.load(c_ptr + (row * G + group) * N + n, mask=n_ok, other=0.0)
        state = state * tl.exp(dt * a) + (dt * x)[:, None] * b[None, :]
        y = tl.sum(state * c[None, :], axis=1) + d * x
        tl.store(y_ptr + (row * H + head) * P + p, y, mask=p_ok)
    tl.store(out_ptr + seq * H * P * N + cell, state, mask=mask)


def scan_step(  # noqa: PLR0913 - the scan's inputs and the step's sequences
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    d: torch.Tensor,
    pool: torch.Tensor,
    slots: torch.Tensor,
    fresh: torch.Tensor,
    starts: torch.Tensor,
    lengths: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's scan: ``x`` [T, H, P], ``dt`` [T, H], ``b``/``c`` [T, G, N] (per group),
    ``pool`` [slots, H, P, N]; sequence ``i`` has rows ``starts[i]`` + ``lengths[i]`` and
    slot ``slots[i]`` (from zeros where ``fresh[i]``) → (y [T, H, P], the sequences' new
    states [S, H, P, N])."""
    heads, channels = x.shape[1], x.shape[2]
    groups, size = b.shape[1], b.shape[2]
    count = slots.shape[0]
    y = torch.empty_like(x)
    out = torch.empty(count, heads, channels, size, dtype=torch.float32, device=x.device)
    if count == 0:
        return y, out
    block_p = min(16, triton.next_power_of_2(channels))
    grid = (count, heads, triton.cdiv(channels, block_p))
    scan_kernel[grid](
        x.contiguous(),
        dt.contiguous(),
        a.contiguous(),
        b.contiguous(),
        c.contiguous(),
        d.contiguous(),
        pool,
        slots,
        fresh.to(torch.int32),
        starts,
        lengths,
        y,
        out,
        H=heads,
        P=channels,
        N=size,
        HEADS_PER_GROUP=heads // groups,
        BLOCK_P=block_p,
        BLOCK_N=triton.next_power_of_2(size),
    )
    return y, out
