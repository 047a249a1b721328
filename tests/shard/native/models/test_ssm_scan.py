"""The Mamba-2 scan and convolution (``ssm_scan.py``): the chunked form and the batched
one-token update against the token-by-token recurrence, from a given state, and a sequence
split anywhere equal to one pass."""

from __future__ import annotations

import torch

from tgis.shard.native.models.ssm_scan import (
    conv_sequence,
    conv_step,
    ssm_chunked,
    ssm_sequential,
    ssm_step,
)

H, P, N, C, K = 4, 3, 5, 7, 4


def _inputs(length: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return dict(
        x=torch.randn(length, H, P, generator=g),
        dt=torch.nn.functional.softplus(torch.randn(length, H, generator=g)),
        b=torch.randn(length, H, N, generator=g),
        c=torch.randn(length, H, N, generator=g),
    )


A = -torch.tensor([0.5, 1.0, 2.0, 3.0])
D = torch.tensor([1.0, 0.5, -0.5, 2.0])


def test_chunked_scan_equals_the_recurrence_from_a_state() -> None:
    state = torch.randn(H, P, N, generator=torch.Generator().manual_seed(1))
    inputs = _inputs(19, 2)  # 19 tokens: chunks of 4 with a padded last one
    y_ref, s_ref = ssm_sequential(**inputs, a=A, d=D, state=state)
    for chunk in (1, 4, 8, 19, 32):
        y, s = ssm_chunked(**inputs, a=A, d=D, state=state, chunk=chunk)
        torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(s, s_ref, rtol=1e-5, atol=1e-5)


def test_a_sequence_split_in_two_equals_one_pass() -> None:
    inputs = _inputs(13, 3)
    zero = torch.zeros(H, P, N)
    y_all, s_all = ssm_chunked(**inputs, a=A, d=D, state=zero, chunk=4)
    head = {k: v[:6] for k, v in inputs.items()}
    tail = {k: v[6:] for k, v in inputs.items()}
    y1, s1 = ssm_chunked(**head, a=A, d=D, state=zero, chunk=4)
    y2, s2 = ssm_chunked(**tail, a=A, d=D, state=s1, chunk=4)
    torch.testing.assert_close(torch.cat([y1, y2]), y_all, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s2, s_all, rtol=1e-5, atol=1e-5)


def test_one_token_update_of_many_sequences_equals_each_recurrence() -> None:
    states = torch.randn(3, H, P, N, generator=torch.Generator().manual_seed(4))
    inputs = _inputs(3, 5)  # token i of sequence i
    y, new = ssm_step(**inputs, a=A, d=D, state=states)
    for i in range(3):
        one = {k: v[i : i + 1] for k, v in inputs.items()}
        y_ref, s_ref = ssm_sequential(**one, a=A, d=D, state=states[i])
        torch.testing.assert_close(y[i], y_ref[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(new[i], s_ref, rtol=1e-5, atol=1e-5)


def test_convolution_continues_from_its_state() -> None:
    g = torch.Generator().manual_seed(6)
    x, weight, bias = torch.randn(9, C, generator=g), torch.randn(C, K, generator=g), None
    zero = torch.zeros(K - 1, C)
    out, state = conv_sequence(x, zero, weight, bias)
    # The definition: output t = sum_k weight[:, k] * input[t + k - (K - 1)], zeros before 0.
    padded = torch.cat([zero, x])
    expected = torch.stack([(padded[t : t + K].t() * weight).sum(-1) for t in range(9)])
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(state, x[-(K - 1) :])
    first, mid = conv_sequence(x[:5], zero, weight, bias)
    rest, end = conv_sequence(x[5:], mid, weight, bias)
    torch.testing.assert_close(torch.cat([first, rest]), out)
    torch.testing.assert_close(end, state)
    # One token of two sequences, each after its own state.
    states = torch.stack([mid, zero])
    step_out, step_states = conv_step(x[5:7], states, weight, bias)
    torch.testing.assert_close(step_out[0], rest[0])
    torch.testing.assert_close(step_states[0], torch.cat([mid[1:], x[5:6]]))
    torch.testing.assert_close(step_out[1], conv_sequence(x[6:7], zero, weight, bias)[0][0])


def test_triton_scan_of_a_step_equals_each_sequence_s_recurrence() -> None:
    """``ssm_triton.scan_step`` (Triton's interpreter on the CPU): sequences of 7, 1, 3 and
    1 tokens in one launch, two of them from zeros (their slots hold other states), B and
    C per group (2 heads each), channels not a power of two."""
    from tgis.shard.native.models.ssm_triton import scan_step

    g = torch.Generator().manual_seed(7)
    heads, channels, size, groups, lengths = 4, 6, 5, 2, [7, 1, 3, 1]
    tokens = sum(lengths)
    x = torch.randn(tokens, heads, channels, generator=g)
    dt = torch.nn.functional.softplus(torch.randn(tokens, heads, generator=g))
    b, c = (torch.randn(tokens, groups, size, generator=g) for _ in range(2))
    pool = torch.randn(6, heads, channels, size, generator=g)
    slots, fresh = torch.tensor([4, 0, 2, 5]), torch.tensor([True, False, False, True])
    starts = torch.tensor([0, 7, 8, 11])
    y, states = scan_step(x, dt, A, b, c, D, pool, slots, fresh, starts, torch.tensor(lengths))
    for i, length in enumerate(lengths):
        rows = slice(int(starts[i]), int(starts[i]) + length)
        start = torch.zeros(heads, channels, size) if fresh[i] else pool[slots[i]]
        per_head = [t[rows].repeat_interleave(heads // groups, dim=1) for t in (b, c)]
        y_ref, s_ref = ssm_sequential(x[rows], dt[rows], A, *per_head, D, start)
        torch.testing.assert_close(y[rows], y_ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(states[i], s_ref, rtol=1e-5, atol=1e-5)
