"""The public API's protobuf conversion: ``fmaas`` messages in, router types out, and back.

Everything the edge reads from or writes to a ``generation_pb2`` message goes through here:
requests become :class:`GenerationCall` s (their ``Parameters`` a :class:`GenerationParams`,
by TGIS's conversion rules, spec §1.3), and the router's events, token details and tokenizer
results become responses. Intake and the core loop see plain Python types only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace

from google.protobuf.message import Message

from tgis.pb import generation_pb2
from tgis.router.core.request_state import TokenEvent
from tgis.router.intake.admission import GenerationCall
from tgis.router.intake.tokenization import TokenizeResult
from tgis.router.intake.validation import DEFAULT_MAX_NEW_TOKENS
from tgis.router.request_types import (
    GenerationParams,
    GuidedKind,
    GuidedRequest,
    LengthPenalty,
    ResponseOptions,
    SamplingParams,
    StoppingParams,
)
from tgis.shard_api.messages import TokenDetail

pb = generation_pb2
_I32_MAX = (1 << 31) - 1

TokenText = Callable[[int], str]
"""Token id -> its raw vocabulary string (``RouterTokenizer.id_to_token``)."""


def optional_string(message: Message, name: str) -> str | None:
    """An ``optional string`` field of a request: None when absent."""
    return getattr(message, name) if message.HasField(name) else None


def generation_call(
    request: generation_pb2.BatchedGenerationRequest | generation_pb2.SingleGenerationRequest,
    texts: Sequence[str],
    *,
    default_include_stop_seqs: bool,
    now: float,
) -> GenerationCall:
    """A Generate (``texts``: every input's) or GenerateStream (its one input) request in
    plain terms, its parameters converted (:func:`convert_params`)."""
    params = request.params if request.HasField("params") else None
    return GenerationCall(
        texts=tuple(texts),
        params=convert_params(params, default_include_stop_seqs=default_include_stop_seqs, now=now),
        prefix_id=optional_string(request, "prefix_id"),
        adapter_id=optional_string(request, "adapter_id") or "",
    )


def convert_params(
    params: generation_pb2.Parameters | None,
    *,
    default_include_stop_seqs: bool,
    now: float,
) -> GenerationParams:
    """Convert proto ``Parameters`` exactly as TGIS's ``convert_params`` does (spec §1.3).

    ``now`` is the request's arrival time on the ``time.monotonic()`` clock; a positive
    ``time_limit_millis`` becomes the absolute deadline ``now + ms / 1000``.

    Zero means "unset" for ``max_new_tokens`` (-> 20), ``repetition_penalty`` (-> 1.0),
    ``top_p`` / ``typical_p`` (-> 1.0, disabled) and SAMPLE-mode ``temperature`` (-> 1.0). In
    GREEDY mode every ``sampling`` field, including the seed, is ignored. ``top_k`` is cast to
    i32 like TGIS, so values above 2^31-1 become negative and fail rule 4.

    ``length_penalty``: copied whenever present, so a ``decay_factor`` outside [1.0, 10.0]
    (0.0 when the field is present but unset) fails rule 8, as in TGIS.

    ``min_new_tokens`` goes into the stopping criteria and the sampling parameters alike
    (the shard masks EOS until it is reached).
    """
    if params is None:
        return GenerationParams(
            sampling=SamplingParams(),
            stopping=StoppingParams(include_stop_sequence=default_include_stop_seqs),
            response=ResponseOptions(),
        )
    stopping = _stopping(params, default_include_stop_seqs, now)
    return GenerationParams(
        sampling=_sampling(params, stopping.min_new_tokens),
        stopping=stopping,
        response=_response(params),
        truncate_input_tokens=params.truncate_input_tokens,
        guided=_guided(params.decoding) if params.HasField("decoding") else None,
    )


def _guided(decoding: generation_pb2.DecodingParameters) -> GuidedRequest | None:
    """vllm-tgis-adapter's ``oneof guided``: None when unset or ``format: TEXT`` (no
    constraint; the adapter fails on it)."""
    which = decoding.WhichOneof("guided")
    if which is None:
        return None
    if which == "format":
        if decoding.format == pb.DecodingParameters.ResponseFormat.TEXT:
            return None
        if decoding.format == pb.DecodingParameters.ResponseFormat.JSON:
            return GuidedRequest(GuidedKind.JSON_OBJECT)
        # A number outside the enum (proto3 keeps it): refused at intake.
        return GuidedRequest(GuidedKind.JSON_OBJECT, text=str(decoding.format))
    if which == "choice":
        return GuidedRequest(GuidedKind.CHOICE, choices=tuple(decoding.choice.choices))
    return GuidedRequest(GuidedKind(which), text=getattr(decoding, which))


def _response(params: generation_pb2.Parameters) -> ResponseOptions:
    if not params.HasField("response"):
        return ResponseOptions()
    r = params.response
    return ResponseOptions(
        input_text=r.input_text,
        generated_tokens=r.generated_tokens,
        input_tokens=r.input_tokens,
        token_logprobs=r.token_logprobs,
        token_ranks=r.token_ranks,
        top_n_tokens=r.top_n_tokens,
    )


def _stopping(
    params: generation_pb2.Parameters, default_include_stop_seqs: bool, now: float
) -> StoppingParams:
    if not params.HasField("stopping"):
        return StoppingParams(include_stop_sequence=default_include_stop_seqs)
    s = params.stopping
    return StoppingParams(
        max_new_tokens=s.max_new_tokens if s.max_new_tokens != 0 else DEFAULT_MAX_NEW_TOKENS,
        min_new_tokens=s.min_new_tokens,
        stop_sequences=tuple(s.stop_sequences),
        include_stop_sequence=(
            s.include_stop_sequence
            if s.HasField("include_stop_sequence")
            else default_include_stop_seqs
        ),
        deadline=now + s.time_limit_millis / 1000.0 if s.time_limit_millis > 0 else None,
    )


def _sampling(params: generation_pb2.Parameters, min_new_tokens: int) -> SamplingParams:
    """The decoding and (SAMPLE mode only) sampling fields; GREEDY, or any other method
    value, ignores the sampling fields silently."""
    repetition_penalty = 1.0
    length_penalty: LengthPenalty | None = None
    if params.HasField("decoding"):
        d = params.decoding
        if d.repetition_penalty != 0.0:
            repetition_penalty = d.repetition_penalty
        if d.HasField("length_penalty"):
            length_penalty = LengthPenalty(
                start_index=d.length_penalty.start_index,
                decay_factor=d.length_penalty.decay_factor,
            )
    greedy = SamplingParams(
        repetition_penalty=repetition_penalty,
        min_new_tokens=min_new_tokens,
        length_penalty=length_penalty,
    )
    if params.method != pb.SAMPLE:
        return greedy
    if not params.HasField("sampling"):
        return replace(greedy, temperature=1.0)
    sp = params.sampling
    return replace(
        greedy,
        # sampling with temperature 0 means plain sampling at 1.0
        temperature=sp.temperature if sp.temperature != 0.0 else 1.0,
        top_k=sp.top_k if sp.top_k <= _I32_MAX else sp.top_k - (1 << 32),
        top_p=sp.top_p if sp.top_p != 0.0 else 1.0,
        typical_p=sp.typical_p if sp.typical_p != 0.0 else 1.0,
        seed=sp.seed if sp.HasField("seed") else None,
    )


def token_info(detail: TokenDetail, to_text: TokenText) -> pb.TokenInfo:
    """One token's details as TGIS sends them (raw vocabulary strings)."""
    return pb.TokenInfo(
        text=to_text(detail.token_id),
        logprob=detail.logprob,
        rank=detail.rank,
        top_tokens=[
            pb.TokenInfo.TopToken(text=to_text(tid), logprob=lp) for tid, lp in detail.top_tokens
        ],
    )


def token_infos(details: Iterable[TokenDetail], to_text: TokenText) -> list[pb.TokenInfo]:
    return [token_info(d, to_text) for d in details]


def stream_message(event: TokenEvent, to_text: TokenText) -> pb.GenerationResponse:
    """A streamed message for generated tokens."""
    return pb.GenerationResponse(
        generated_token_count=event.generated_token_count,
        text=event.text,
        tokens=token_infos(event.tokens, to_text),
        stop_reason=pb.StopReason.Name(event.stop_reason),
        stop_sequence=event.stop_sequence,
    )


def stream_header(input_token_count: int, text: str, seed: int) -> pb.GenerationResponse:
    """A stream's first message: the input token count (and the input text if asked)."""
    return pb.GenerationResponse(input_token_count=input_token_count, text=text, seed=seed)


def input_tokens_message(infos: list[pb.TokenInfo]) -> pb.GenerationResponse:
    """The streamed message with every input position's details."""
    return pb.GenerationResponse(input_token_count=len(infos), input_tokens=infos)


def unary_response(
    *,
    input_token_count: int,
    final: TokenEvent,
    text: str,
    seed: int,
    tokens: list[pb.TokenInfo],
    input_tokens: list[pb.TokenInfo],
) -> pb.GenerationResponse:
    """One input's response of a Generate call."""
    return pb.GenerationResponse(
        input_token_count=input_token_count,
        generated_token_count=final.generated_token_count,
        text=text,
        stop_reason=pb.StopReason.Name(final.stop_reason),
        stop_sequence=final.stop_sequence,
        seed=seed,
        tokens=tokens,
        input_tokens=input_tokens,
    )


def batched_response(responses: Sequence[pb.GenerationResponse]) -> pb.BatchedGenerationResponse:
    return pb.BatchedGenerationResponse(responses=responses)


def tokenize_response(results: Sequence[TokenizeResult]) -> pb.BatchedTokenizeResponse:
    """The Tokenize RPC's reply (offsets in UTF-8 bytes, as computed by the tokenizer)."""
    return pb.BatchedTokenizeResponse(
        responses=[
            pb.TokenizeResponse(
                token_count=r.token_count,
                tokens=r.tokens,
                offsets=[pb.TokenizeResponse.Offset(start=s, end=e) for s, e in r.offsets],
            )
            for r in results
        ]
    )


def model_info_response(
    *, is_seq2seq: bool, max_sequence_length: int, max_new_tokens: int
) -> pb.ModelInfoResponse:
    kind = pb.ModelInfoResponse.ENCODER_DECODER if is_seq2seq else pb.ModelInfoResponse.DECODER_ONLY
    return pb.ModelInfoResponse(
        model_kind=kind, max_sequence_length=max_sequence_length, max_new_tokens=max_new_tokens
    )
