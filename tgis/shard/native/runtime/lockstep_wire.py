"""The bytes the tensor-parallel ranks exchange each command: a Step's plan and each rank's
outcome, in a flat layout of uint64s, float64s and UTF-8 strings (nothing pickled).

A payload is a header of three int64s (how many ints, floats and string bytes follow), the
ints (uint64, as the step channel's ids and seeds are), the floats, then the string bytes; a
reader takes them back in the order they were written. Floats travel as float64, so every
rank decodes exactly the plan rank 0 holds (the step channel's protobuf carries float32).
"""

from __future__ import annotations

import struct
from array import array
from dataclasses import dataclass

from tgis.shard_api.messages import (
    AdapterInfo,
    AdapterKind,
    DetailOptions,
    LengthPenalty,
    NewSequence,
    PrefixInfo,
    SamplingParams,
    ScheduledSequence,
    StepPlan,
)

_HEADER = struct.Struct("<qqq")


@dataclass(frozen=True)
class Outcome:
    """What a rank reports after a command; equal on every rank unless they diverged."""

    error: str | None = None  # "ExceptionType: message"
    tokens: tuple[tuple[int, int], ...] = ()  # (request id, sampled token id)
    failed: tuple[int, ...] = ()  # request ids with a per-sequence error
    prefix: PrefixInfo | None = None  # PREFIX: the prefix's virtual tokens and version
    adapter: AdapterInfo | None = None  # ADAPTER: what the adapter is


class Writer:
    """Collects ints, floats and strings; `payload()` gives the bytes."""

    def __init__(self) -> None:
        self.ints: list[int] = []
        self.floats: list[float] = []
        self.text: list[bytes] = []

    def ints_of(self, values: tuple[int, ...]) -> None:
        self.ints.append(len(values))
        self.ints.extend(values)

    def string(self, value: str) -> None:
        data = value.encode()
        self.ints.append(len(data))
        self.text.append(data)

    def payload(self) -> bytes:
        text = b"".join(self.text)
        head = _HEADER.pack(len(self.ints), len(self.floats), len(text))
        return b"".join(
            (head, array("Q", self.ints).tobytes(), array("d", self.floats).tobytes(), text)
        )


class Reader:
    """Reads back what a Writer wrote, in the same order."""

    def __init__(self, payload: bytes) -> None:
        n_ints, n_floats, n_text = _HEADER.unpack_from(payload)
        start = _HEADER.size
        ints, floats = array("Q"), array("d")
        ints.frombytes(payload[start : start + 8 * n_ints])
        start += 8 * n_ints
        floats.frombytes(payload[start : start + 8 * n_floats])
        start += 8 * n_floats
        self.ints = ints.tolist()
        self.floats = floats.tolist()
        self.text = payload[start : start + n_text]
        self.i = self.f = self.t = 0

    def take(self) -> int:
        self.i += 1
        return self.ints[self.i - 1]

    def real(self) -> float:
        self.f += 1
        return self.floats[self.f - 1]

    def ints_of(self) -> tuple[int, ...]:
        n = self.take()
        self.i += n
        return tuple(self.ints[self.i - n : self.i])

    def string(self) -> str:
        n = self.take()
        self.t += n
        return self.text[self.t - n : self.t].decode()


# ---- StepPlan --------------------------------------------------------------------------------


def encode_plan(plan: StepPlan) -> bytes:
    """`plan` as bytes (`decode_plan` gives an equal plan back)."""
    w = Writer()
    w.ints += (plan.step_id, plan.base_step_id, len(plan.scheduled), len(plan.new_sequences))
    w.ints_of(plan.finished_request_ids)
    w.ints_of(plan.preempted_request_ids)
    for s in plan.scheduled:
        slot = 0 if s.state_slot is None else s.state_slot + 1
        w.ints += (s.request_id, s.num_tokens, s.cached_tokens, s.spec_tokens, slot)
        w.ints_of(s.new_block_ids)
        w.ints_of(s.draft_token_ids)
    for ns in plan.new_sequences:
        _write_new_sequence(w, ns)
    return w.payload()


def decode_plan(payload: bytes) -> StepPlan:
    r = Reader(payload)
    step_id, base_step_id, n_scheduled, n_new = r.take(), r.take(), r.take(), r.take()
    finished, preempted = r.ints_of(), r.ints_of()
    scheduled = []
    for _ in range(n_scheduled):
        request_id, num_tokens, cached, spec, slot = r.ints[r.i : r.i + 5]
        r.i += 5
        blocks, drafts = r.ints_of(), r.ints_of()
        state_slot = None if slot == 0 else slot - 1
        scheduled.append(
            ScheduledSequence(request_id, num_tokens, blocks, cached, drafts, spec, state_slot)
        )
    new = tuple(_read_new_sequence(r) for _ in range(n_new))
    return StepPlan(step_id, new, tuple(scheduled), finished, preempted, base_step_id)


def _write_new_sequence(w: Writer, ns: NewSequence) -> None:
    p, d = ns.sampling, ns.details
    w.ints += (ns.request_id, ns.prefix_length, p.top_k, p.min_new_tokens, d.top_n)
    flags = (d.logprobs, d.ranks, d.input_tokens, d.generated_tokens)
    w.ints += (*(int(f) for f in flags), int(p.seed is not None), int(p.length_penalty is not None))
    w.ints_of(ns.prompt_token_ids)
    for text in (ns.prefix_id, ns.adapter_id, ns.prefix_version, ns.adapter_version, p.grammar):
        w.string(text)
    w.floats += (p.temperature, p.top_p, p.typical_p, p.repetition_penalty)
    w.floats += (p.presence_penalty, p.frequency_penalty, p.min_p)
    if p.seed is not None:
        w.ints.append(p.seed)
    if p.length_penalty is not None:
        w.ints.append(p.length_penalty.start_index)
        w.floats.append(p.length_penalty.decay_factor)
    w.ints_of(tuple(token for token, _ in p.logit_bias))
    w.floats += (bias for _, bias in p.logit_bias)


def _read_new_sequence(r: Reader) -> NewSequence:
    request_id, prefix_length, top_k, min_new, top_n = (r.take() for _ in range(5))
    logprobs, ranks, input_tokens, generated, has_seed, has_penalty = (
        bool(r.take()) for _ in range(6)
    )
    prompt = r.ints_of()
    prefix_id, adapter_id, prefix_version, adapter_version, grammar = (r.string() for _ in range(5))
    temperature, top_p, typical_p, repetition, presence, frequency, min_p = (
        r.real() for _ in range(7)
    )
    seed = None
    if has_seed:
        seed = r.take()
    penalty = LengthPenalty(r.take(), r.real()) if has_penalty else None
    bias = tuple((token, r.real()) for token in r.ints_of())
    sampling = SamplingParams(
        temperature, top_k, top_p, typical_p, seed, repetition, min_new, penalty, grammar,
        presence, frequency, bias, min_p,
    )  # fmt: skip
    details = DetailOptions(logprobs, ranks, top_n, input_tokens, generated)
    return NewSequence(
        request_id, prompt, sampling, details, prefix_id, prefix_length, adapter_id,
        prefix_version, adapter_version,
    )  # fmt: skip


# ---- Outcome ---------------------------------------------------------------------------------

_PLAIN, _ERROR, _PREFIX, _ADAPTER = range(4)


def encode_outcome(outcome: Outcome) -> bytes:
    """`outcome` as bytes; equal outcomes give equal bytes."""
    w = Writer()
    if outcome.error is not None:
        w.ints.append(_ERROR)
        w.string(outcome.error)
    elif outcome.prefix is not None:
        w.ints += (_PREFIX, outcome.prefix.length)
        w.string(outcome.prefix.version)
    elif outcome.adapter is not None:
        a = outcome.adapter
        w.ints += (_ADAPTER, a.kind.value, a.prefix_length)
        w.string(a.version)
    else:
        w.ints.append(_PLAIN)
    w.ints_of(tuple(value for pair in outcome.tokens for value in pair))
    w.ints_of(outcome.failed)
    return w.payload()


def decode_outcome(payload: bytes) -> Outcome:
    r = Reader(payload)
    kind = r.take()
    error, prefix, adapter = None, None, None
    if kind == _ERROR:
        error = r.string()
    elif kind == _PREFIX:
        prefix = PrefixInfo(r.take(), r.string())
    elif kind == _ADAPTER:
        adapter = AdapterInfo(AdapterKind(r.take()), r.take(), r.string())
    flat = r.ints_of()
    tokens = tuple(zip(flat[::2], flat[1::2], strict=True))
    return Outcome(error, tokens, r.ints_of(), prefix, adapter)
