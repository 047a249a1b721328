"""Flash-decoding's splits for ``triton_paged``: when a long context is shared out between
several programs (``decode_kernel``'s ``SPLITS``), each stores its unnormalised partial
result, max and sum (``SplitPartials``), and ``combine_kernel`` (launched by ``combine``)
merges them into each one-token sequence's output, with each head's attention sink, when
given, in the max and the denominator."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@triton.jit
def combine_kernel(  # noqa: PLR0913 - a Triton function takes every pointer, stride and tile size
    out_ptr,
    part_acc_ptr,
    part_max_ptr,
    part_sum_ptr,
    decode_seqs_ptr,
    query_starts_ptr,
    sinks_ptr,
    stride_ot,
    stride_oh,
    num_heads,
    head_dim,
    HAS_SINKS: tl.constexpr,
    SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    D_PAD: tl.constexpr,
):
    """Program (decode, head): rescale each split's partial result to the global max and
    normalise by the total sum (an empty split has max -1e30 and sum 0: weight 0); a head's
    sink logit, with ``HAS_SINKS``, joins the max and the sum."""
    decode = tl.program_id(0)
    head = tl.program_id(1)
    row = tl.load(query_starts_ptr + tl.load(decode_seqs_ptr + decode))
    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, D_PAD)
    ok = splits < SPLITS
    part = (decode * num_heads + head) * SPLITS + splits
    m_s = tl.load(part_max_ptr + part, mask=ok, other=float("-inf"))
    l_s = tl.load(part_sum_ptr + part, mask=ok, other=0.0)
    mask = ok[:, None] & (dims[None, :] < head_dim)
    acc_s = tl.load(part_acc_ptr + part[:, None] * D_PAD + dims[None, :], mask=mask, other=0.0)
    m_all = tl.max(m_s, 0)
    if HAS_SINKS:
        sink2 = tl.load(sinks_ptr + head) * 1.4426950408889634
        m_all = tl.maximum(m_all, sink2)
    weights = tl.exp2(m_s - m_all)
    total = tl.sum(weights * l_s, 0)
    if HAS_SINKS:
        total += tl.exp2(sink2 - m_all)
    out = tl.sum(acc_s * weights[:, None], 0) / total
    o_offs = row * stride_ot + head * stride_oh + dims
    tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=dims < head_dim)


@dataclass(frozen=True)
class SplitPartials:
    """Where the decode kernel's splits store their unnormalised partial results, laid out
    [decode, head, split(, D_PAD)] (float32), for ``combine_kernel``. With one split the
    kernel stores the final output itself and never touches them (they alias ``out``)."""

    splits: int
    acc: torch.Tensor
    max: torch.Tensor
    sum: torch.Tensor

    @classmethod
    def allocate(cls, splits: int, decodes: int, d_pad: int, out: torch.Tensor) -> SplitPartials:
        if splits == 1:  # unused by the kernel
            return cls(splits, out, out, out)
        heads, device = out.shape[1], out.device
        return cls(
            splits,
            acc=torch.empty(decodes, heads, splits, d_pad, device=device),
            max=torch.empty(decodes, heads, splits, device=device),
            sum=torch.empty(decodes, heads, splits, device=device),
        )


def combine(
    out: torch.Tensor,
    parts: SplitPartials,
    decode_seqs: torch.Tensor,
    query_starts: torch.Tensor,
    head_dim: int,
    d_pad: int,
    sinks: torch.Tensor | None = None,
) -> None:
    """Merge the decode splits into each one-token sequence's output rows (with each head's
    sink logit in the denominator, when given)."""
    decodes, heads = decode_seqs.numel(), out.shape[1]
    combine_kernel[(decodes, heads)](
        out,
        parts.acc,
        parts.max,
        parts.sum,
        decode_seqs,
        query_starts,
        out if sinks is None else sinks,  # never read without sinks
        out.stride(0),
        out.stride(1),
        heads,
        head_dim,
        HAS_SINKS=sinks is not None,
        SPLITS=parts.splits,
        SPLITS_PAD=triton.next_power_of_2(parts.splits),
        D_PAD=d_pad,
    )
