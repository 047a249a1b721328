"""Hostile requests: property-based fuzzing of the gRPC API and the OpenAI routes of a server.

Every field of every ``fmaas`` request message is drawn by ``hypothesis`` strategies that
cover its whole range with weighted choices (cheap, plausible values most of the time, so
that generation stays fast; the extremes often enough to be hit many times per run):

* strings: ASCII, any Unicode (emoji, combining marks, control and format characters, NUL),
  texts of up to 1 MB; and, on the wire, bytes that are *not* valid UTF-8 in any one string
  field (python protobuf refuses to serialize them, so a placeholder is serialized and its
  bytes patched, see :func:`with_invalid_utf8`);
* numbers: NaN, ±inf, ±0, denormals, float32 extremes for every float; 0, small, the
  limits and 2^32-1 / 2^64-1 for every integer; varints longer than the field's type
  and other wire-level oddities appended to a valid message (:data:`WIRE_SUFFIXES`,
  :data:`MALFORMED_SUFFIXES`);
* enums: known and unknown values; repeated fields: empty, a few, 10,000 inputs, 1,000
  stop sequences; truncated and random bytes; messages over the router's 64 MiB limit;
* guided decoding (``DecodingParameters``' ``json_schema``, ``regex``, ``choice``,
  ``grammar``, ``format``): the families of :mod:`fuzz_guided` (special-token text, 2,001
  and 5,000 choices and alternatives, schemas ``true``/``false``/non-objects/10-3,000 deep/
  unsatisfiable, invalid ones), with ``min_new_tokens`` often past what the constraint can
  produce and stop sequences made of its outputs' pieces.

A result must be well-formed: as many results as inputs, a stream that ends with a stop
reason, token details that number ``generated_token_count``, and a guided output that
ended on EOS that its constraint allows (one of the choices, a literal regex's alternative,
a JSON document; :func:`fuzz_guided.expectation`).

With the HTTP port known, :data:`OPENAI_SHARE` percent of the requests are OpenAI bodies
instead (:mod:`fuzz_openai`: wrong types in every field, odd chat contents and roles, every
``response_format``, bodies nested thousands deep, invalid JSON or UTF-8, huge bodies);
their allowed statuses are :data:`fuzz_openai.ALLOWED_HTTP`, every refusal in OpenAI's
error shape.

:func:`run_fuzz` sends ``count`` such requests from a few threads to a server and returns
a :class:`FuzzReport`: status counts per RPC and per route, every reply with a status
outside :data:`ALLOWED_STATUSES` (or without a message, or with a malformed result)
together with a summary of its request, then the server's ``/health`` and the gauges that
must be back at 0. The CLI prints it::

    .venv/bin/python benchmarks/fuzz.py --requests 10000            # own tiny-model server
    .venv/bin/python benchmarks/fuzz.py --target 127.0.0.1:8033 --http 127.0.0.1:3000 --json
    .venv/bin/python benchmarks/fuzz.py --no-openai                 # the gRPC API only
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import struct
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import grpc
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import fuzz_guided  # noqa: E402
import fuzz_openai  # noqa: E402
from fuzz_guided import Expect, expectation, one_in, weighted  # noqa: E402
from fuzz_openai import HttpCase  # noqa: E402

from tgis.pb import generation_pb2 as pb  # noqa: E402

T = TypeVar("T")

ROUTER_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
"""The router's gRPC receive limit (``tgis/router/server.py``): larger requests must get
RESOURCE_EXHAUSTED from gRPC itself."""

ALLOWED_STATUSES = frozenset({"OK", "INVALID_ARGUMENT", "RESOURCE_EXHAUSTED", "NOT_FOUND"})
"""What a hostile request may get (spec §1.11, §2): a result, a validation refusal, an
overload or size refusal, an unknown prefix or adapter. Never UNKNOWN, INTERNAL, a client
deadline (a hang) or UNAVAILABLE (a crash)."""

GAUGES = ("tgi_batch_current_size", "tgi_queue_size", "tgi_kv_cache_used_blocks")
"""Gauges that must be back at 0 once every request has ended."""

CALL_TIMEOUT_S = 300.0
"""Client deadline of one call: a call still running then counts as a hang."""

OPENAI_SHARE = 30
"""Percent of a run's requests that go to the OpenAI routes (when the HTTP port is known)."""

SERVICE = "/fmaas.GenerationService/"


# ---- scalars ---------------------------------------------------------------------------------

U32_MAX = (1 << 32) - 1
U64_MAX = (1 << 64) - 1
I32_MAX = (1 << 31) - 1

SPECIAL_FLOATS = (
    math.nan,
    math.inf,
    -math.inf,
    0.0,
    -0.0,
    1.0,
    -1.0,
    0.05,
    0.0499,
    1.0000001,
    10.0,
    10.000001,
    1e-45,  # the smallest float32 denormal
    -1e-45,
    3.4028234663852886e38,  # float32 max
    -3.4028234663852886e38,
)


@functools.cache
def float32s() -> st.SearchStrategy[float]:
    """A proto ``float``: plausible values, the special ones, or any float32 bit pattern."""
    return weighted(
        (5, st.floats(0.0, 2.0, width=32)),
        (3, st.sampled_from(SPECIAL_FLOATS)),
        (2, st.floats(width=32)),
    )


@functools.cache
def uint32s(common: st.SearchStrategy[int]) -> st.SearchStrategy[int]:
    """A proto ``uint32``: mostly ``common``, else 0, the boundaries or anything."""
    return weighted(
        (16, common),
        (2, st.sampled_from((0, 1, 255, 256, I32_MAX, I32_MAX + 1, U32_MAX))),
        (2, st.integers(0, U32_MAX)),
    )


@functools.cache
def uint64s() -> st.SearchStrategy[int]:
    return weighted(
        (3, st.integers(0, 1000)),
        (1, st.sampled_from((0, U32_MAX, U32_MAX + 1, (1 << 63) - 1, 1 << 63, U64_MAX))),
        (2, st.integers(0, U64_MAX)),
    )


@functools.cache
def enum_values(known: Sequence[int]) -> st.SearchStrategy[int]:
    """An open proto3 enum: a known value, or any other int32 (the wire allows it)."""
    return weighted(
        (9, st.sampled_from(tuple(known))),
        (1, st.integers(-(1 << 31), I32_MAX)),
    )


# ---- strings ---------------------------------------------------------------------------------

EMOJI_AND_MARKS = (
    "😀",
    "👩‍👩‍👧‍👦",  # zero-width joiners
    "🇫🇷",
    "❤️",
    "\u0301",  # combining acute accent
    "\u0338",
    "e\u0301\u0302\u0303",
    "\u200b",  # zero-width space
    "\u202e",  # right-to-left override
    "\ufeff",
    "\ufffd",
    "\U0010ffff",
    "漢字",
    "\u0000",
    "\x1b[31m",
    "\r\n",
    "\t",
)
ONE_MB = 1 << 20


def _repeat_to(piece: str, size: int) -> str:
    """``piece`` repeated to about ``size`` UTF-8 bytes."""
    return piece * max(1, size // max(1, len(piece.encode())))


@functools.cache
def texts(*, huge: bool = True) -> st.SearchStrategy[str]:
    """An input text: mostly a few words; any Unicode, emoji and combining marks, control
    characters; long texts (1-64 KB); with ``huge``, now and then 1 MB."""
    choices: list[tuple[int, st.SearchStrategy[str]]] = [
        (60, st.text(alphabet="abcdefgh XYZ.,!?\n", max_size=40)),
        (12, st.text(max_size=60)),
        (8, st.lists(st.sampled_from(EMOJI_AND_MARKS), max_size=20).map("".join)),
        (
            6,
            st.text(
                alphabet=st.characters(categories=["Cc", "Cf", "Mn", "Me", "Zl", "Zp", "Co"]),
                max_size=40,
            ),
        ),
        (4, st.just("")),
        (
            3,
            st.builds(_repeat_to, st.text(min_size=1, max_size=8), st.integers(1024, 64 * 1024)),
        ),
    ]
    if huge:
        choices.append((1, st.builds(_repeat_to, st.text(min_size=1, max_size=8), st.just(ONE_MB))))
    return weighted(*choices)


@functools.cache
def ids() -> st.SearchStrategy[str]:
    """``model_id``, ``prefix_id``, ``adapter_id``: path-like, traversal attempts or any text."""
    return weighted(
        (4, st.from_regex(r"[a-z0-9_/\-]{0,20}", fullmatch=True)),
        (2, st.sampled_from(("..", "../../etc/passwd", "/abs", "a/../b", "", "x" * 300, "%s%n"))),
        (3, texts(huge=False)),
    )


# ---- messages --------------------------------------------------------------------------------


def _optional(strategy: st.SearchStrategy[T], present: int = 1, absent: int = 1) -> Any:
    return weighted((absent, st.none()), (present, strategy))  # absent first: the common one


def _set(message: Any, **values: Any) -> Any:
    """``message`` with the fields whose value is not None set."""
    for name, value in values.items():
        if value is not None:
            setattr(message, name, value)
    return message


@st.composite
def sampling_parameters(draw: st.DrawFn) -> pb.SamplingParameters:
    small = st.integers(0, 50)
    return _set(
        pb.SamplingParameters(),
        temperature=draw(float32s()),
        top_k=draw(uint32s(small)),
        top_p=draw(float32s()),
        typical_p=draw(float32s()),
        seed=draw(_optional(uint64s())),
    )


@st.composite
def stopping_criteria(draw: st.DrawFn) -> pb.StoppingCriteria:
    stop_sequences = draw(
        weighted(
            (10, st.lists(texts(huge=False), max_size=3)),
            (2, st.lists(texts(huge=False), min_size=6, max_size=10)),
            (1, st.builds(lambda s: [s] * 1000, st.text(max_size=5))),
        )
    )
    message = _set(
        pb.StoppingCriteria(),
        max_new_tokens=draw(uint32s(st.integers(1, 4))),
        min_new_tokens=draw(uint32s(weighted((4, st.just(0)), (1, st.integers(1, 4))))),
        time_limit_millis=draw(uint32s(weighted((4, st.just(0)), (1, st.integers(1, 50))))),
        include_stop_sequence=draw(_optional(st.booleans())),
    )
    message.stop_sequences.extend(stop_sequences)
    return message


@st.composite
def response_options(draw: st.DrawFn) -> pb.ResponseOptions:
    flags = {
        name: draw(st.booleans())
        for name in ("input_text", "generated_tokens", "input_tokens", "token_logprobs")
    }
    return pb.ResponseOptions(
        **flags,
        token_ranks=draw(st.booleans()),
        top_n_tokens=draw(uint32s(st.integers(0, 6))),
    )


@functools.cache
def guided_fields() -> st.SearchStrategy[tuple[str, Any]]:
    """(``DecodingParameters``' guided field, its value): the families of
    :mod:`fuzz_guided`."""
    return weighted(
        (30, st.tuples(st.just("json_schema"), fuzz_guided.schemas())),
        (25, st.tuples(st.just("regex"), fuzz_guided.regexes())),
        (25, st.tuples(st.just("choice"), fuzz_guided.choices())),
        (15, st.tuples(st.just("grammar"), fuzz_guided.grammars())),
        (5, st.tuples(st.just("format"), enum_values((0, 1)))),
    )


@st.composite
def decoding_parameters(draw: st.DrawFn) -> pb.DecodingParameters:
    penalty = draw(weighted((1, st.just(0.0)), (2, float32s())))  # 0: not set (1.0)
    message = pb.DecodingParameters(repetition_penalty=penalty)
    if draw(st.booleans()):
        message.length_penalty.CopyFrom(
            pb.DecodingParameters.LengthPenalty(
                start_index=draw(uint32s(st.integers(0, 8))),
                decay_factor=draw(weighted((2, st.floats(1.0, 10.0, width=32)), (3, float32s()))),
            )
        )
    if not draw(one_in(5)):
        name, value = draw(guided_fields())
        if name == "choice":
            message.choice.choices.extend(value)
        else:
            setattr(message, name, value)
    return message


@st.composite
def guided_lengths(draw: st.DrawFn, message: pb.Parameters) -> None:
    """For a guided request, now and then: ``min_new_tokens`` up to 12 (often more than the
    constraint can produce) with ``max_new_tokens`` above it, and stop sequences made of
    what guided outputs hold (special-token text, quotes, choice stems)."""
    if draw(one_in(3)):
        low = draw(st.integers(1, 12))
        message.stopping.min_new_tokens = low
        message.stopping.max_new_tokens = low + draw(st.integers(0, 8))
    if draw(one_in(4)):
        del message.stopping.stop_sequences[:]
        stops = st.lists(st.sampled_from(fuzz_guided.STOP_PIECES), min_size=1, max_size=3)
        message.stopping.stop_sequences.extend(draw(stops))


@st.composite
def parameters(draw: st.DrawFn) -> pb.Parameters:
    message = _set(
        pb.Parameters(),
        method=draw(enum_values((pb.GREEDY, pb.SAMPLE))),
        truncate_input_tokens=draw(uint32s(weighted((4, st.just(0)), (1, st.integers(1, 8))))),
    )
    for name, strategy in (
        ("sampling", sampling_parameters()),
        ("stopping", stopping_criteria()),
        ("response", response_options()),
        ("decoding", decoding_parameters()),
    ):
        # stopping is nearly always there: without it max_new_tokens is the default 20;
        # decoding (and guided decoding with it) more often than the others
        present = {"stopping": 9, "decoding": 7}.get(name, 5)
        if draw(st.integers(0, 9)) < present:
            getattr(message, name).CopyFrom(draw(strategy))
    if message.decoding.WhichOneof("guided") is not None:
        draw(guided_lengths(message))
    return message


@functools.cache
def _inputs(text: st.SearchStrategy[str]) -> st.SearchStrategy[list[str]]:
    """A batch's input texts: mostly one, sometimes none, many, or 10,000."""
    return weighted(
        (70, st.lists(text, min_size=1, max_size=1)),
        (15, st.lists(text, min_size=2, max_size=4)),
        (3, st.just([])),
        (4, st.lists(st.text(alphabet="ab ", max_size=8), min_size=5, max_size=40)),
        (1, st.builds(lambda t: [t] * 10_000, st.text(alphabet="ab ", max_size=8))),
    )


@st.composite
def batched_generation_requests(draw: st.DrawFn, huge: bool = True) -> pb.BatchedGenerationRequest:
    message = _set(
        pb.BatchedGenerationRequest(),
        model_id=draw(weighted((3, st.just("")), (1, ids()))),
        prefix_id=draw(_optional(ids(), 1, 12)),
        adapter_id=draw(_optional(ids(), 1, 12)),
    )
    message.requests.extend(pb.GenerationRequest(text=t) for t in draw(_inputs(texts(huge=huge))))
    if draw(st.integers(0, 9)) < 9:
        message.params.CopyFrom(draw(parameters()))
    return message


@st.composite
def single_generation_requests(draw: st.DrawFn, huge: bool = True) -> pb.SingleGenerationRequest:
    message = _set(
        pb.SingleGenerationRequest(),
        model_id=draw(weighted((3, st.just("")), (1, ids()))),
        prefix_id=draw(_optional(ids(), 1, 12)),
        adapter_id=draw(_optional(ids(), 1, 12)),
    )
    if not draw(one_in(20)):  # missing request: INVALID_ARGUMENT "missing request"
        message.request.text = draw(texts(huge=huge))
    if draw(st.integers(0, 9)) < 9:
        message.params.CopyFrom(draw(parameters()))
    return message


@st.composite
def batched_tokenize_requests(draw: st.DrawFn, huge: bool = True) -> pb.BatchedTokenizeRequest:
    message = _set(
        pb.BatchedTokenizeRequest(),
        model_id=draw(weighted((3, st.just("")), (1, ids()))),
        prefix_id=draw(_optional(ids(), 1, 12)),
        adapter_id=draw(_optional(ids(), 1, 12)),
        return_tokens=draw(st.booleans()),
        return_offsets=draw(st.booleans()),
        truncate_input_tokens=draw(uint32s(weighted((3, st.just(0)), (1, st.integers(1, 8))))),
    )
    message.requests.extend(pb.TokenizeRequest(text=t) for t in draw(_inputs(texts(huge=huge))))
    return message


@functools.cache
def model_info_requests() -> st.SearchStrategy[pb.ModelInfoRequest]:
    return st.builds(pb.ModelInfoRequest, model_id=ids())


RPCS: dict[str, tuple[Any, Any, bool]] = {
    "Generate": (pb.BatchedGenerationRequest, pb.BatchedGenerationResponse, False),
    "GenerateStream": (pb.SingleGenerationRequest, pb.GenerationResponse, True),
    "Tokenize": (pb.BatchedTokenizeRequest, pb.BatchedTokenizeResponse, False),
    "ModelInfo": (pb.ModelInfoRequest, pb.ModelInfoResponse, False),
}
"""RPC name -> (request type, response type, server-streaming)."""


@st.composite
def guided_parameters(draw: st.DrawFn) -> pb.Parameters:
    """Parameters that pass validation, with a guided constraint (:func:`guided_fields`):
    the requests that reach the grammar compiler and generation. Greedy or sampled,
    ``min_new_tokens`` up to 12, stop sequences of guided outputs' pieces, time limits,
    token details."""
    low = draw(weighted((3, st.just(0)), (2, st.integers(1, 12))))
    stopping = pb.StoppingCriteria(
        max_new_tokens=max(low, 1) + draw(st.integers(0, 8)),
        min_new_tokens=low,
        time_limit_millis=draw(weighted((9, st.just(0)), (1, st.integers(1, 50)))),
        include_stop_sequence=draw(st.booleans()),
    )
    if draw(one_in(4)):
        stops = st.lists(st.sampled_from(fuzz_guided.STOP_PIECES), min_size=1, max_size=3)
        stopping.stop_sequences.extend(draw(stops))
    details = draw(st.booleans())
    response = pb.ResponseOptions(
        input_text=draw(one_in(6)),
        input_tokens=draw(one_in(4)),
        generated_tokens=details,
        token_logprobs=details and draw(st.booleans()),
        token_ranks=details and draw(st.booleans()),
        top_n_tokens=draw(st.integers(0, 3)) if details else 0,
    )
    sampling = pb.SamplingParameters(
        temperature=draw(st.sampled_from((0.0, 0.7, 1.0, 1.5))),
        top_k=draw(st.sampled_from((0, 1, 5, 50))),
        top_p=draw(st.sampled_from((0.0, 0.5, 0.95, 1.0))),
        typical_p=draw(st.sampled_from((0.0, 0.5, 1.0))),
        seed=draw(_optional(uint64s())),
    )
    decoding = pb.DecodingParameters(repetition_penalty=draw(st.sampled_from((0.0, 1.0, 1.3))))
    name, value = draw(guided_fields())
    if name == "choice":
        decoding.choice.choices.extend(value)
    else:
        setattr(decoding, name, value)
    return pb.Parameters(
        method=draw(st.sampled_from((pb.GREEDY, pb.SAMPLE))),
        sampling=sampling,
        stopping=stopping,
        response=response,
        decoding=decoding,
    )


@functools.cache
def _guided_texts() -> st.SearchStrategy[str]:
    pieces = st.sampled_from((*fuzz_guided.SPECIAL_TEXTS, "The answer, as JSON:", "Pick one:"))
    return weighted((3, st.text(alphabet="abcdefgh XYZ.,!?\n", max_size=30)), (1, pieces))


@st.composite
def guided_requests(draw: st.DrawFn, rpc: str) -> Any:
    """A ``Generate`` (1-3 inputs) or ``GenerateStream`` request of :func:`guided_parameters`."""
    params = draw(guided_parameters())
    if rpc == "GenerateStream":
        request = pb.GenerationRequest(text=draw(_guided_texts()))
        return pb.SingleGenerationRequest(request=request, params=params)
    inputs = draw(st.lists(_guided_texts(), min_size=1, max_size=3))
    requests = [pb.GenerationRequest(text=t) for t in inputs]
    return pb.BatchedGenerationRequest(requests=requests, params=params)


@functools.cache
def request_messages(huge: bool = True) -> st.SearchStrategy[tuple[str, Any]]:
    """(RPC, request message) with the RPCs weighted by how much they have to fuzz; the
    guided requests of :func:`guided_requests` beside the hostile ones."""
    return weighted(
        (40, st.tuples(st.just("Generate"), batched_generation_requests(huge))),
        (30, st.tuples(st.just("GenerateStream"), single_generation_requests(huge))),
        (20, st.tuples(st.just("Tokenize"), batched_tokenize_requests(huge))),
        (3, st.tuples(st.just("ModelInfo"), model_info_requests())),
        (20, st.tuples(st.just("Generate"), guided_requests("Generate"))),
        (15, st.tuples(st.just("GenerateStream"), guided_requests("GenerateStream"))),
    )


# ---- the wire --------------------------------------------------------------------------------


def varint(value: int) -> bytes:
    """Protobuf base-128 varint of ``value`` (negative: its 64-bit two's complement)."""
    value &= U64_MAX
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def tag(number: int, wire_type: int) -> bytes:
    return varint(number << 3 | wire_type)


def length_delimited(number: int, payload: bytes) -> bytes:
    return tag(number, 2) + varint(len(payload)) + payload


INVALID_UTF8 = (
    b"\xff",  # never valid
    b"\xc0\x80",  # overlong NUL
    b"\xed\xa0\x80",  # a UTF-16 surrogate (CESU-8)
    b"\xe2\x82",  # truncated 3-byte sequence
    b"\xf4\x90\x80\x80",  # above U+10FFFF
    b"\x80",  # lone continuation byte
)
PLACEHOLDER = "<<FUZZ-BAD-UTF8>>"


def _string_slots(message: Any) -> list[tuple[Any, str, int | None]]:
    """Every place a string can go in ``message``: its singular string fields (set or not)
    and the elements of its repeated ones, in every sub-message present."""
    slots: list[tuple[Any, str, int | None]] = []
    for fd in message.DESCRIPTOR.fields:
        value = getattr(message, fd.name)
        repeated = fd.is_repeated if hasattr(fd, "is_repeated") else fd.label == fd.LABEL_REPEATED
        if fd.type == fd.TYPE_STRING:
            if repeated:
                slots.extend((message, fd.name, i) for i in range(min(len(value), 8)))
            else:
                slots.append((message, fd.name, None))
        elif fd.type == fd.TYPE_MESSAGE:
            children = list(value)[:8] if repeated else [value] if message.HasField(fd.name) else []
            for child in children:
                slots.extend(_string_slots(child))
    return slots


def with_invalid_utf8(message: Any, slot: int, bad: bytes, at: int) -> tuple[bytes, str]:
    """``message`` serialized with string slot ``slot`` (of :func:`_string_slots`) holding
    ``bad`` at offset ``at`` of an ASCII filler: a placeholder of the same byte length is
    serialized, then its bytes replaced, so no length prefix changes. Returns the bytes and
    the field's name."""
    copy = type(message)()
    copy.CopyFrom(message)
    slots = _string_slots(copy)
    owner, name, index = slots[slot % len(slots)]
    if index is None:
        setattr(owner, name, PLACEHOLDER)
    else:
        getattr(owner, name)[index] = PLACEHOLDER
    return patch_placeholder(copy.SerializeToString(), bad, at), f"{owner.DESCRIPTOR.name}.{name}"


def patch_placeholder(data: bytes, bad: bytes, at: int) -> bytes:
    """``data`` (a message with :data:`PLACEHOLDER` in one string field) with ``bad`` written
    over the placeholder's bytes from offset ``at`` (wrapped to fit): same length, so every
    enclosing length prefix stays right."""
    marker = PLACEHOLDER.encode()
    assert data.count(marker) == 1, "the placeholder must be in exactly one field"
    at %= len(marker) - len(bad) + 1
    return data.replace(marker, marker[:at] + bad + marker[at + len(bad) :])


WIRE_SUFFIXES: dict[str, bytes] = {
    # params.stopping.max_new_tokens (uint32) as a 10-byte varint of 2^64-1 and of -1
    "uint32 field with a 64-bit varint": length_delimited(
        10, length_delimited(3, tag(1, 0) + varint(U64_MAX))
    ),
    "negative enum (method = -5)": length_delimited(10, tag(1, 0) + varint(-5)),
    "signalling NaN temperature": length_delimited(
        10,
        tag(1, 0) + varint(1) + length_delimited(2, tag(1, 5) + struct.pack("<I", 0x7FA00001)),
    ),
    "NaN with sign bit, repetition_penalty": length_delimited(
        10, length_delimited(5, tag(1, 5) + struct.pack("<I", 0xFFFFFFFF))
    ),
    "unknown fields": tag(999, 0) + varint(7) + length_delimited(12345, b"\x00" * 100),
}
"""Raw bytes appended to a valid request that still parses: a scalar given again wins, a
message merges, unknown fields are kept."""

MALFORMED_SUFFIXES: dict[str, bytes] = {
    "wrong wire type (params as varint)": tag(10, 0) + varint(1),
    "unterminated varint": tag(10, 0) + b"\xff" * 11,
    "length past the end": tag(10, 2) + varint(1 << 20) + b"ab",
    "field number 0": tag(0, 0) + varint(1),
    "group wire type": tag(10, 3) + tag(10, 4),
}
"""Raw bytes appended to a valid request that make it undecodable."""


# ---- cases -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One request to send: its RPC, wire bytes and a short description for the report.

    ``oversize`` > 0: the bytes are built when sent (a text that big is not kept around).
    ``inputs``: how many results a successful reply must carry (None: not checked).
    ``expect``: what a guided output that ended on EOS must be (None: not checked).
    ``token_count``: the reply's generated tokens must number its ``generated_token_count``.
    """

    rpc: str
    payload: bytes
    summary: str
    oversize: int = 0
    inputs: int | None = None
    expect: Expect | None = None
    token_count: bool = False

    def body(self) -> bytes:
        if not self.oversize:
            return self.payload
        text = length_delimited(2, b"a" * self.oversize)  # GenerationRequest / TokenizeRequest
        field_number = 2 if self.rpc == "Tokenize" else 3
        return length_delimited(field_number, text)


def summarize(message: Any, limit: int = 400) -> str:
    """``message`` in text format on one line, long strings and repeated fields shortened."""
    copy = type(message)()
    copy.CopyFrom(message)
    _shorten(copy)
    text = " ".join(str(copy).split())
    return text if len(text) <= limit else text[:limit] + "…"


def _shorten(message: Any) -> None:
    for fd, value in message.ListFields():
        repeated = fd.is_repeated if hasattr(fd, "is_repeated") else fd.label == fd.LABEL_REPEATED
        if repeated and len(value) > 4:
            extra = len(value) - 3
            del value[3:]
            if fd.type == fd.TYPE_STRING:
                value.append(f"<… {extra} more>")
        if fd.type == fd.TYPE_STRING:
            if repeated:
                for i, s in enumerate(value):
                    if len(s) > 40:
                        value[i] = f"{s[:30]}<… {len(s)} chars>"
            elif len(value) > 40:
                setattr(message, fd.name, f"{value[:30]}<… {len(value)} chars>")
        elif fd.type == fd.TYPE_MESSAGE:
            for child in value if repeated else [value]:
                _shorten(child)


def _inputs_of(rpc: str, message: Any) -> int | None:
    if rpc in ("Generate", "Tokenize"):
        return len(message.requests)
    return None


def _reply_checks(rpc: str, message: Any) -> dict[str, Any]:
    """What an OK reply to a generation ``message`` must hold beyond its shape: a guided
    output that ended on EOS is what its constraint allows (not checked when the input text
    is echoed before it), and the token details number ``generated_token_count``."""
    if rpc not in ("Generate", "GenerateStream") or not message.HasField("params"):
        return {}
    params = message.params
    checks: dict[str, Any] = {"token_count": params.response.generated_tokens}
    guided = params.decoding.WhichOneof("guided")
    if guided is not None and not params.response.input_text:
        value = getattr(params.decoding, guided)
        if guided == "choice":
            value = list(value.choices)
        checks["expect"] = expectation(guided, value)
    return checks


@st.composite
def cases(draw: st.DrawFn, huge: bool = True, undecodable: bool = True) -> Case:
    """A request as sent: mostly a valid message, else one made odd on the wire (appended
    bytes), undecodable (invalid UTF-8, malformed bytes appended, truncated, random bytes;
    only with ``undecodable``), or oversized (with ``huge``)."""
    odd = 1 if undecodable else 0
    rpc, message = draw(request_messages(huge))
    kind = draw(
        weighted(
            (85, st.just("message")),
            (6 * odd, st.just("invalid utf-8")),
            (3, st.just("wire suffix")),
            (2 * odd, st.just("malformed suffix")),
            (2 * odd, st.just("truncated")),
            (2 * odd, st.just("random bytes")),
            (1 if huge else 0, st.just("oversize")),
        )
    )
    data = message.SerializeToString()
    summary = summarize(message)
    if kind == "message":
        checks = _reply_checks(rpc, message)
        return Case(rpc, data, summary, inputs=_inputs_of(rpc, message), **checks)
    if kind == "invalid utf-8":
        bad = draw(st.sampled_from(INVALID_UTF8))
        slot = draw(st.integers(0, 1000))
        data, where = with_invalid_utf8(message, slot, bad, draw(st.integers(0, 100)))
        return Case(rpc, data, f"invalid UTF-8 {bad!r} in {where} of: {summary}")
    if kind == "wire suffix":
        name = draw(st.sampled_from(sorted(WIRE_SUFFIXES)))
        return Case(rpc, data + WIRE_SUFFIXES[name], f"{name} appended to: {summary}")
    if kind == "malformed suffix":
        name = draw(st.sampled_from(sorted(MALFORMED_SUFFIXES)))
        return Case(rpc, data + MALFORMED_SUFFIXES[name], f"{name} appended to: {summary}")
    if kind == "truncated":
        cut = draw(st.integers(0, max(0, len(data) - 1)))
        return Case(rpc, data[:cut], f"first {cut} of {len(data)} bytes of: {summary}")
    if kind == "random bytes":
        junk = draw(st.binary(max_size=200))
        return Case(rpc, junk, f"random bytes {junk[:40]!r} ({len(junk)} bytes)")
    size = ROUTER_MAX_MESSAGE_BYTES + draw(st.integers(1, 1024))
    oversized = "Tokenize" if rpc == "Tokenize" else "Generate"
    return Case(oversized, b"", f"one text of {size} bytes (over the 64 MiB limit)", size)


# ---- sending ---------------------------------------------------------------------------------


@dataclass
class Finding:
    """A reply that breaks the rules, with what was sent."""

    rpc: str
    status: str
    message: str
    request: str


@dataclass
class FuzzReport:
    """What a run sent and got back."""

    target: str
    requests: int = 0
    wall_s: float = 0.0
    statuses: dict[str, dict[str, int]] = field(default_factory=dict)
    """RPC (``Generate``) or route (``POST /v1/completions``) -> status -> count (gRPC status
    names; HTTP status codes, ``200 + error event`` for a stream that ended with one)."""
    disallowed: list[Finding] = field(default_factory=list)
    health: int | None = None
    """``/health``'s HTTP status after the run (None: not checked)."""
    gauges: dict[str, float] | None = None
    """The :data:`GAUGES` after the run (None: not checked)."""

    @property
    def ok(self) -> bool:
        """No disallowed reply, and the server healthy and idle afterwards where checked."""
        return (
            not self.disallowed
            and self.health in (None, 200)
            and (self.gauges is None or all(v == 0 for v in self.gauges.values()))
        )

    def as_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "ok": self.ok}


class _Client:
    """Sends raw request bytes and checks the reply; thread-safe."""

    def __init__(self, target: str) -> None:
        self.channel = grpc.insecure_channel(
            target,
            options=[
                ("grpc.max_send_message_length", -1),
                ("grpc.max_receive_message_length", -1),
            ],
        )

    def close(self) -> None:
        self.channel.close()

    def send(self, case: Case) -> tuple[str, str]:
        """(status name, its message, or why the result is malformed) for one case."""
        _, response_type, streaming = RPCS[case.rpc]
        method = SERVICE + case.rpc
        try:
            if streaming:
                call = self.channel.unary_stream(method, None, response_type.FromString)
                replies = list(call(case.body(), timeout=CALL_TIMEOUT_S))
                return "OK", _check_stream(case, replies)
            unary = self.channel.unary_unary(method, None, response_type.FromString)
            reply = unary(case.body(), timeout=CALL_TIMEOUT_S)
            return "OK", _check_unary(case, reply)
        except grpc.RpcError as err:
            code = err.code() if isinstance(err, grpc.Call) else None
            return getattr(code, "name", str(code)), (
                err.details() if isinstance(err, grpc.Call) else str(err)
            ) or ""


def _check_unary(case: Case, reply: Any) -> str:
    """ "" when a unary result is well-formed, else what is wrong with it."""
    if case.inputs is not None and len(reply.responses) != case.inputs:
        return f"{len(reply.responses)} results for {case.inputs} inputs"
    if case.rpc != "Generate":
        return ""
    for result in reply.responses:
        problem = _check_result(case, result.text, len(result.tokens), result)
        if problem:
            return problem
    return ""


def _check_stream(case: Case, replies: list[Any]) -> str:
    if not replies:
        return "a stream without messages"
    final = replies[-1]
    if final.stop_reason == pb.NOT_FINISHED:
        return "a stream ended without a stop reason"
    text = "".join(r.text for r in replies)
    return _check_result(case, text, sum(len(r.tokens) for r in replies), final)


def _check_result(case: Case, text: str, tokens: int, final: Any) -> str:
    """One input's result: its token details and, when it ended on EOS, its guided output."""
    if case.token_count and tokens != final.generated_token_count:
        return f"{tokens} tokens for generated_token_count {final.generated_token_count}"
    if case.expect is not None and final.stop_reason == pb.EOS_TOKEN:
        return case.expect.violation(text)
    return ""


def _is_allowed(status: str, message: str) -> bool:
    if status == "OK":
        return message == ""  # "" = a well-formed result
    return status in ALLOWED_STATUSES and bool(message.strip())


def _drive(strategy: st.SearchStrategy[Any], count: int, seed: int | None, on_case: Any) -> None:
    """Draw ``count`` cases from ``strategy`` with hypothesis (generation only: nothing to
    shrink, failures are collected, not raised) and hand each to ``on_case``."""

    @settings(
        max_examples=count,
        database=None,
        deadline=None,
        derandomize=seed is None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
        report_multiple_bugs=False,
    )
    @given(strategy)
    def body(case: Any) -> None:
        on_case(case)

    if seed is not None:
        body = hypothesis_seed(seed)(body)
    body()


def run_fuzz(
    target: str,
    count: int,
    *,
    seed: int | None = None,
    threads: int = 8,
    huge: bool = True,
    undecodable: bool = True,
    http: str | None = None,
    openai: bool = True,
    settle_s: float = 60.0,
) -> FuzzReport:
    """Send ``count`` hostile requests to the server at ``target`` (gRPC) and ``http``
    (``host:port`` of its HTTP port) from ``threads`` threads and classify the replies.

    ``seed``: hypothesis' seed (None: derandomized, the same cases every run). ``huge``:
    also 1 MB texts and oversized messages (slow on a CPU: the tokenizer takes seconds per
    MB). ``undecodable``: also requests that do not parse (invalid UTF-8 strings, corrupt or
    truncated bytes). ``openai`` (with ``http``): :data:`OPENAI_SHARE` percent of the
    requests are OpenAI bodies (:mod:`fuzz_openai`). With ``http``, afterwards check
    ``/health`` and wait up to ``settle_s`` for the :data:`GAUGES` to be 0.
    """
    report = FuzzReport(target=target)
    counts: Counter[tuple[str, str]] = Counter()
    lock = threading.Lock()
    in_flight = threading.BoundedSemaphore(threads * 2)
    client = _Client(target)

    def send(case: Case | HttpCase) -> None:
        try:
            if isinstance(case, HttpCase):
                assert http is not None
                name = f"POST {case.route}"
                reply = fuzz_openai.send(http, case, CALL_TIMEOUT_S)
                status, allowed, message = reply.status, not reply.problem, reply.problem
            else:
                name = case.rpc
                status, message = client.send(case)
                allowed = _is_allowed(status, message)
        except Exception as err:  # a fault of the fuzzer's own checks: reported, not lost
            status, allowed, message = "fuzzer error", False, repr(err)
        finally:
            in_flight.release()
        with lock:
            counts[name, status] += 1
            if not allowed:
                report.disallowed.append(Finding(name, status, message, case.summary))

    strategy = cases(huge=huge, undecodable=undecodable)
    if openai and http is not None:
        strategy = weighted(
            (100 - OPENAI_SHARE, strategy), (OPENAI_SHARE, fuzz_openai.http_cases(huge=huge))
        )
    started = time.monotonic()
    with ThreadPoolExecutor(threads, thread_name_prefix="fuzz") as pool:

        def submit(case: Case | HttpCase) -> None:
            in_flight.acquire()
            report.requests += 1
            pool.submit(send, case)

        _drive(strategy, count, seed, submit)
    report.wall_s = round(time.monotonic() - started, 2)
    client.close()
    for (rpc, status), n in sorted(counts.items()):
        report.statuses.setdefault(rpc, {})[status] = n
    if http is not None:
        report.health = http_status(f"http://{http}/health")
        report.gauges = settled_gauges(f"http://{http}/metrics", settle_s)
    return report


# ---- the server's state ----------------------------------------------------------------------


def http_status(url: str, timeout: float = 30.0) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as err:
        return err.code


def gauges(metrics_url: str) -> dict[str, float]:
    """The :data:`GAUGES` from a Prometheus scrape, summed over their labels."""
    with urllib.request.urlopen(metrics_url, timeout=30.0) as resp:
        text = resp.read().decode()
    values = dict.fromkeys(GAUGES, 0.0)
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in values:
            values[name] += float(line.rsplit(" ", 1)[1])
    return values


def settled_gauges(metrics_url: str, wait_s: float) -> dict[str, float]:
    """The gauges once all are 0, or as they are after ``wait_s``."""
    deadline = time.monotonic() + wait_s
    while True:
        values = gauges(metrics_url)
        if all(v == 0 for v in values.values()) or time.monotonic() > deadline:
            return values
        time.sleep(0.5)


CHAT_TEMPLATE = ROOT / "tests" / "data" / "chat_templates" / "llama3_instruct.jinja"
"""The chat template the fuzzed server renders ``/v1/chat/completions`` with."""


def server_args(model: Path) -> list[str]:
    """The launcher's arguments for a fuzzed server of ``model``."""
    return ["--model-name", str(model), "--chat-template", str(CHAT_TEMPLATE)]


@contextmanager
def tiny_server(log_dir: Path) -> Iterator[tuple[str, str]]:
    """A launcher serving a tiny random Llama (``tests/e2e/models.py``, the embedded
    tokenizer) with a chat template from ``log_dir``; yields (gRPC target, HTTP host:port)."""
    from tests.e2e.models import save_tiny_llama
    from tgis.launcher.local_process import start_launcher

    model = log_dir / "model"
    save_tiny_llama(model)
    launcher = start_launcher(log_dir, server_args(model), log_name="launcher.log")
    try:
        launcher.wait_healthy()
        yield launcher.grpc_target, f"127.0.0.1:{launcher.http_port}"
    finally:
        launcher.stop()


# ---- CLI -------------------------------------------------------------------------------------


def format_report(report: FuzzReport) -> str:
    lines = [
        f"target: {report.target}",
        f"requests: {report.requests} in {report.wall_s:.1f} s "
        f"({report.requests / max(report.wall_s, 1e-9):.0f}/s)",
        "",
        f"{'RPC or route':<28}{'status':<20}{'count':>8}",
    ]
    for rpc, statuses in report.statuses.items():
        for status, n in sorted(statuses.items(), key=lambda kv: -kv[1]):
            lines.append(f"{rpc:<28}{status:<20}{n:>8}")
    lines.append("")
    lines.append(f"disallowed replies: {len(report.disallowed)}")
    for finding in report.disallowed[:20]:
        lines.append(f"  {finding.rpc} {finding.status} {finding.message!r}")
        lines.append(f"    request: {finding.request}")
    if report.health is not None:
        lines.append(f"/health after the run: {report.health}")
    if report.gauges is not None:
        lines.append(
            "gauges after the run: " + ", ".join(f"{k}={v:g}" for k, v in report.gauges.items())
        )
    lines.append("PASS" if report.ok else "FAIL")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--requests", type=int, default=1000, help="how many requests to send")
    parser.add_argument("--target", help="gRPC HOST:PORT (default: start a tiny-model server)")
    parser.add_argument(
        "--http", help="HTTP HOST:PORT of --target: the OpenAI routes, /health and /metrics"
    )
    parser.add_argument("--threads", type=int, default=8, help="requests in parallel")
    parser.add_argument("--seed", type=int, help="hypothesis seed (default: derandomized)")
    parser.add_argument("--no-huge", action="store_true", help="no 1 MB texts, no oversize")
    parser.add_argument(
        "--no-openai", action="store_true", help="gRPC only (no bodies to the OpenAI routes)"
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    def fuzz(target: str, http: str | None) -> FuzzReport:
        return run_fuzz(
            target,
            args.requests,
            seed=args.seed,
            threads=args.threads,
            huge=not args.no_huge,
            http=http,
            openai=not args.no_openai,
        )

    if args.target:
        report = fuzz(args.target, args.http)
    else:
        with (
            tempfile.TemporaryDirectory(prefix="tgis-fuzz-") as tmp,
            tiny_server(Path(tmp)) as (
                target,
                http,
            ),
        ):
            report = fuzz(target, http)
    print(json.dumps(report.as_dict(), indent=2) if args.json else format_report(report))
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
