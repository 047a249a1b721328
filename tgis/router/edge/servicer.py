"""fmaas.GenerationService: RPC plumbing only.

Each generation RPC: open the call (``calls.py``: drain, correlation id, span), count it,
convert the request (``fmaas.py``), admit it (``intake/admission.py``: batch size, permits,
validation, lookups, tokenization), submit each input to the engine, and pump the replies
(``replies.py``); any ``RouterError`` on the way becomes its status (``status.py``). When
the call ends, however it ends, its requests are aborted in the engine (a no-op for finished
ones) and its permits returned. Tokenize and ModelInfo answer from the tokenizer and the
limits. Registration on a gRPC server, with lenient parsing, is ``registration.py``'s.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from contextlib import aclosing
from typing import NoReturn

import grpc

from tgis.pb import generation_pb2, generation_pb2_grpc
from tgis.router.core.engine import Engine
from tgis.router.core.request_state import RequestState
from tgis.router.edge import fmaas as api
from tgis.router.edge.calls import CallGate, end_requests
from tgis.router.edge.registration import Undecodable, refuse_undecodable
from tgis.router.edge.replies import Replies
from tgis.router.edge.status import abort
from tgis.router.edge.tracing import RequestSpan
from tgis.router.errors import GenerationError, RouterError, TokenizationError, ValidationError
from tgis.router.intake.admission import Admission
from tgis.router.ops.metrics import Metrics
from tgis.router.ops.stalled_streams import StalledStreams
from tgis.router.request_types import ValidatedRequest

__all__ = ["GenerationServicer"]

log = logging.getLogger(__name__)

pb = generation_pb2


class GenerationServicer(generation_pb2_grpc.GenerationServiceServicer):
    def __init__(
        self,
        *,
        admission: Admission,
        engine: Engine,
        replies: Replies,
        calls: CallGate,
        default_include_stop_seqs: bool,
        stalled_streams: StalledStreams | None = None,
    ) -> None:
        self.admission = admission
        self.engine = engine
        self.replies = replies
        self.calls = calls
        self.metrics: Metrics = admission.metrics
        self.default_include_stop_seqs = default_include_stop_seqs
        self.stalled_streams = stalled_streams if stalled_streams is not None else StalledStreams()

    # ---- generation -------------------------------------------------------------------------

    async def Generate(
        self, request: pb.BatchedGenerationRequest, context: grpc.aio.ServicerContext
    ) -> pb.BatchedGenerationResponse:
        arrival = time.monotonic()
        async with self.calls.open("Generate", context, arrival) as span:
            count = len(request.requests)
            kind = "single" if count == 1 else "batch"
            self.metrics.request_received(kind, count)
            _trace_adapters(span, request)
            if count == 0:
                return api.batched_response(())
            try:
                self.admission.check_batch_size(count)
                with self.admission.permits(count):
                    texts = [r.text for r in request.requests]
                    validated = await self._validate(request, texts, arrival, span)
                    states = self._submit(validated, arrival, span)
                    try:
                        responses = await self.replies.unary(states, kind, arrival)
                    finally:
                        end_requests(self.engine, self.admission, states)
                    return api.batched_response(responses)
            except RouterError as err:
                await self._refuse(context, err, "Request failed")

    async def GenerateStream(
        self, request: pb.SingleGenerationRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerationResponse]:
        if isinstance(request, Undecodable):  # see registration.py
            await refuse_undecodable(request, context, self.metrics)
        arrival = time.monotonic()
        async with self.calls.open("GenerateStream", context, arrival) as span:
            self.metrics.request_received("stream", 1)
            _trace_adapters(span, request)
            try:
                with self.admission.permits(1):
                    if not request.HasField("request"):
                        raise ValidationError("missing request")
                    validated = await self._validate(request, [request.request.text], arrival, span)
                    (state,) = self._submit(validated, arrival, span)
                    try:
                        async with aclosing(self._pump(state, arrival)) as messages:
                            async for message in messages:
                                yield message
                    finally:
                        end_requests(self.engine, self.admission, (state,))
            except RouterError as err:
                await self._refuse(context, err, "Streaming response failed")

    async def _validate(
        self,
        request: pb.BatchedGenerationRequest | pb.SingleGenerationRequest,
        texts: Sequence[str],
        arrival: float,
        span: RequestSpan | None,
    ) -> list[ValidatedRequest]:
        call = api.generation_call(
            request,
            texts,
            default_include_stop_seqs=self.default_include_stop_seqs,
            now=time.monotonic(),
        )
        on_compile = None if span is None else span.guided_compiled
        return await self.admission.validate(call, arrival, on_compile)

    def _submit(
        self, validated: Sequence[ValidatedRequest], arrival: float, span: RequestSpan | None
    ) -> list[RequestState]:
        states = [self.engine.submit(v, arrival) for v in validated]
        if span is not None:
            span.validated(states, time.monotonic())
        return states

    async def _pump(
        self, state: RequestState, arrival: float
    ) -> AsyncGenerator[pb.GenerationResponse, None]:
        """The stream's messages, each marked while gRPC holds it (flow control), so that a
        client that stops reading is found (``ops/stalled_streams.py``)."""
        watched = self.stalled_streams.watch()
        watched.request_id = state.request_id
        try:
            async for message in self.replies.stream(state, arrival):
                watched.sending_since = time.monotonic()
                yield message  # back here once gRPC has sent it (flow control permitting)
                watched.sending_since = None
        finally:
            self.stalled_streams.forget(watched)

    async def _refuse(
        self, context: grpc.aio.ServicerContext, error: RouterError, what: str
    ) -> NoReturn:
        """End the call with ``error``'s status; a failure during generation is counted
        (refusals before it were counted where they were found)."""
        if isinstance(error, GenerationError):
            self.metrics.request_failure("generate")
            log.error("%s: %s", what, error)
        await abort(context, error)

    # ---- Tokenize and ModelInfo -------------------------------------------------------------

    async def Tokenize(
        self, request: pb.BatchedTokenizeRequest, context: grpc.aio.ServicerContext
    ) -> pb.BatchedTokenizeResponse:
        started = time.monotonic()
        self.metrics.tokenize_received(len(request.requests))
        try:
            # Checked as for generation, then unused: the counts are the text's tokens only.
            await self.admission.resolve_adapters(
                api.optional_string(request, "prefix_id"),
                api.optional_string(request, "adapter_id") or "",
            )
        except ValidationError as err:
            await abort(context, err)
        texts = [r.text for r in request.requests]
        tokenizer = self.admission.tokenizer

        def tokenize() -> tuple[int, pb.BatchedTokenizeResponse]:
            results = tokenizer.tokenize(
                texts,
                return_tokens=request.return_tokens,
                return_offsets=request.return_offsets,
                truncate=request.truncate_input_tokens,
            )
            # The reply is built off the event loop too: a megabyte of text means a million
            # Offset messages, seconds of Python that would stall every other call.
            return sum(r.token_count for r in results), api.tokenize_response(results)

        try:
            token_count, response = await tokenizer.run_async(tokenize)
        except Exception as err:  # a tokenizer failure is the caller's input problem
            await abort(context, TokenizationError(str(err)))
        self.metrics.tokenize_done(token_count, time.monotonic() - started)
        return response

    async def ModelInfo(
        self, request: pb.ModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelInfoResponse:
        limits = self.admission.limits
        return api.model_info_response(
            is_seq2seq=self.replies.is_seq2seq,
            max_sequence_length=limits.max_sequence_length,
            max_new_tokens=limits.max_new_tokens,
        )


def _trace_adapters(
    span: RequestSpan | None,
    request: pb.BatchedGenerationRequest | pb.SingleGenerationRequest,
) -> None:
    if span is not None:
        span.adapters(
            api.optional_string(request, "prefix_id"), api.optional_string(request, "adapter_id")
        )
