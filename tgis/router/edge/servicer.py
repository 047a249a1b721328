"""fmaas.GenerationService: protobuf in, engine events out, protobuf back. No logic of its own.

Generate: permits -> convert + validate params -> adapter (adapters.py) and prompt-prefix
length (prefixes.py) -> tokenize + validate each input -> Engine.submit per input -> wait
for every input's final event -> one response per input.
GenerateStream: the same for one input, yielding a message per event (spec §3.2).
Around both: refused with UNAVAILABLE while draining (drain.py); the x-correlation-id is
bound to the call's task for every log line (request_context.py); spans when tracing is
on (tracing.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextvars import Token
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError, Message

from tgis.log import bind_log_fields, reset_log_fields
from tgis.pb import generation_pb2, generation_pb2_grpc
from tgis.router.core.engine import Engine
from tgis.router.core.request_state import Event, InputTokensEvent, RequestState, TokenEvent
from tgis.router.core.shard_client import AdapterLookupError, PrefixLookupError, ShardError
from tgis.router.edge import fmaas as api
from tgis.router.errors import (
    GenerationError,
    OverloadedError,
    RouterError,
    TokenizationError,
    UnavailableError,
    ValidationError,
    abort,
)
from tgis.router.intake.adapters import AdapterKinds
from tgis.router.intake.concurrency import ConcurrencyLimiter
from tgis.router.intake.limits import enforce_client_batch_size
from tgis.router.intake.prefixes import PrefixLengths
from tgis.router.intake.tokenization import RouterTokenizer
from tgis.router.intake.validation import (
    ADAPTERS_DISABLED_MESSAGE,
    PREFIX_WITH_PROMPT_TUNING_MESSAGE,
    ServerLimits,
    adapter_lookup_error,
    check_adapter_id,
    prefix_lookup_error,
    undecodable_request_error,
    unsupported_adapter_error,
    validate_inputs,
    validate_params,
)
from tgis.router.ops.drain import SHUTTING_DOWN_MESSAGE, Drain
from tgis.router.ops.metrics import Metrics
from tgis.router.ops.request_context import correlation_id
from tgis.router.ops.stalled_streams import StalledStreams
from tgis.router.ops.tracing import RequestSpan, Tracing
from tgis.router.request_types import StopReason, ValidatedRequest
from tgis.shard_api.messages import AdapterInfo, AdapterKind

log = logging.getLogger(__name__)

pb = generation_pb2


@dataclass(frozen=True, slots=True)
class _Adapters:
    """What a request's ``prefix_id`` and ``adapter_id`` resolved to."""

    prefix_id: str = ""
    prefix_length: int = 0
    """The prefix's virtual tokens, or a prompt-tuning adapter's."""
    adapter_id: str = ""
    adapter_kind: AdapterKind | None = None


_NO_ADAPTERS = _Adapters()


class GenerationServicer(generation_pb2_grpc.GenerationServiceServicer):
    def __init__(
        self,
        *,
        engine: Engine,
        tokenizer: RouterTokenizer,
        limits: ServerLimits,
        limiter: ConcurrencyLimiter,
        metrics: Metrics,
        default_include_stop_seqs: bool,
        is_seq2seq: bool,
        prefixes: PrefixLengths | None = None,
        adapters: AdapterKinds | None = None,
        drain: Drain | None = None,
        tracing: Tracing | None = None,
        stalled_streams: StalledStreams | None = None,
    ) -> None:
        """``prefixes``: where prompt-prefix lengths come from (the shard, through a cache);
        None for a servicer without a shard, that finds no prefix. ``adapters``: where
        adapters' kinds come from (the shard's adapter cache, through a cache); None when
        the shard has no adapter cache, so that every ``adapter_id`` is refused."""
        self.prefixes = prefixes if prefixes is not None else PrefixLengths(_no_prefixes, metrics)
        self.adapters = adapters
        self.drain = drain if drain is not None else Drain()
        self.stalled_streams = stalled_streams if stalled_streams is not None else StalledStreams()
        self.tracing = tracing
        self.engine = engine
        self.tokenizer = tokenizer
        self.limits = limits
        self.limiter = limiter
        self.metrics = metrics
        self.default_include_stop_seqs = default_include_stop_seqs
        self.is_seq2seq = is_seq2seq

    # ---- RPCs -------------------------------------------------------------------------------

    async def Generate(
        self, request: pb.BatchedGenerationRequest, context: grpc.aio.ServicerContext
    ) -> pb.BatchedGenerationResponse:
        arrival = time.monotonic()
        fields, trace = await self._enter("Generate", context, arrival)
        error: BaseException | None = None
        try:
            return await self._generate(request, context, arrival, trace)
        except BaseException as err:
            error = err
            raise
        finally:
            self._leave(fields, trace, error, context)

    async def GenerateStream(
        self, request: pb.SingleGenerationRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerationResponse]:
        if isinstance(request, _Undecodable):  # see add_generation_service
            await _refuse_undecodable(request, context, self.metrics)
        arrival = time.monotonic()
        fields, trace = await self._enter("GenerateStream", context, arrival)
        error: BaseException | None = None
        try:
            async for message in self._generate_stream(request, context, arrival, trace):
                yield message
        except BaseException as err:
            error = err
            raise
        finally:
            self._leave(fields, trace, error, context)

    async def _generate(
        self,
        request: pb.BatchedGenerationRequest,
        context: grpc.aio.ServicerContext,
        arrival: float,
        trace: RequestSpan | None,
    ) -> pb.BatchedGenerationResponse:
        count = len(request.requests)
        kind = "single" if count == 1 else "batch"
        self.metrics.request_received(kind, count)
        if trace is not None:
            trace.adapters(_optional(request, "prefix_id"), _optional(request, "adapter_id"))
        if count == 0:
            return api.batched_response(())
        await enforce_client_batch_size(count, self.limits, context, self.metrics)
        await self._acquire(count, context)
        states: list[RequestState] = []
        try:
            validated = await self._validate(
                request, [r.text for r in request.requests], arrival, context
            )
            states = [self.engine.submit(v, arrival) for v in validated]
            if trace is not None:
                trace.validated(states, time.monotonic())
            responses = await _all_or_nothing(
                [self._collect_unary(s, kind, arrival, i, count) for i, s in enumerate(states)]
            )
            return api.batched_response(responses)
        except GenerationError as err:
            self.metrics.request_failure("generate")
            log.error("Request failed: %s", err)
            await abort(context, err)
        finally:
            for state in states:
                self.engine.abort(state)
            self.limiter.release(count)

    async def _generate_stream(
        self,
        request: pb.SingleGenerationRequest,
        context: grpc.aio.ServicerContext,
        arrival: float,
        trace: RequestSpan | None,
    ) -> AsyncIterator[pb.GenerationResponse]:
        self.metrics.request_received("stream", 1)
        if trace is not None:
            trace.adapters(_optional(request, "prefix_id"), _optional(request, "adapter_id"))
        await self._acquire(1, context)
        state: RequestState | None = None
        watched = self.stalled_streams.watch()
        try:
            if not request.HasField("request"):
                await abort(context, ValidationError("missing request"))
            (validated,) = await self._validate(request, [request.request.text], arrival, context)
            state = self.engine.submit(validated, arrival)
            watched.request_id = state.request_id
            if trace is not None:
                trace.validated((state,), time.monotonic())
            async for message in self._stream(state, validated, arrival):
                watched.sending_since = time.monotonic()
                yield message  # back here once gRPC has sent it (flow control permitting)
                watched.sending_since = None
        except GenerationError as err:
            self.metrics.request_failure("generate")
            log.error("Streaming response failed: %s", err)
            await abort(context, err)
        finally:
            self.stalled_streams.forget(watched)
            if state is not None:
                self.engine.abort(state)
            self.limiter.release(1)

    async def Tokenize(
        self, request: pb.BatchedTokenizeRequest, context: grpc.aio.ServicerContext
    ) -> pb.BatchedTokenizeResponse:
        started = time.monotonic()
        self.metrics.tokenize_received(len(request.requests))
        try:
            # Checked as for generation, then unused: the counts are the text's tokens only.
            await self._adapters(request)
        except ValidationError as err:
            await abort(context, err)
        texts = [r.text for r in request.requests]
        tokenizer = self.tokenizer

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
        return api.model_info_response(
            is_seq2seq=self.is_seq2seq,
            max_sequence_length=self.limits.max_sequence_length,
            max_new_tokens=self.limits.max_new_tokens,
        )

    # ---- steps of a generate call -------------------------------------------------------------

    async def _enter(
        self, method: str, context: grpc.aio.ServicerContext, arrival: float
    ) -> tuple[Token[Mapping[str, object]], RequestSpan | None]:
        """Count the call in (or refuse it while the server drains, SIGTERM), bind its
        correlation id to the task's log lines and open its span when tracing is on; what
        ``_leave`` undoes."""
        if not self.drain.enter():
            await abort(context, UnavailableError(SHUTTING_DOWN_MESSAGE))
        metadata = context.invocation_metadata()
        correlation = correlation_id(metadata)
        fields = bind_log_fields(correlation_id=correlation)
        trace = None
        if self.tracing is not None:
            trace = self.tracing.start(method, metadata, correlation, arrival)
        return fields, trace

    def _leave(
        self,
        fields: Token[Mapping[str, object]],
        trace: RequestSpan | None,
        error: BaseException | None,
        context: grpc.aio.ServicerContext,
    ) -> None:
        self.drain.exit()
        if trace is not None:
            trace.finish(_failure(error, context))
        with contextlib.suppress(ValueError):  # a generator closed from another context
            reset_log_fields(fields)

    async def _acquire(self, count: int, context: grpc.aio.ServicerContext) -> None:
        if not self.limiter.try_acquire(count):
            self.metrics.request_failure("conc_limit")
            await abort(context, OverloadedError())

    async def _validate(
        self, request: Any, texts: list[str], arrival: float, context: grpc.aio.ServicerContext
    ) -> list[ValidatedRequest]:
        """Convert and check params, resolve the adapter and the prompt prefix
        (``_adapters``), tokenize and check every input (first error wins).

        Metrics as TGIS: the raw length of every tokenized input (also of inputs rejected
        afterwards), then for a valid request each input's length and requested
        max_new_tokens and, once, the validation time since the RPC arrived.
        """
        try:
            params = api.convert_params(
                request.params if request.HasField("params") else None,
                default_include_stop_seqs=self.default_include_stop_seqs,
                now=time.monotonic(),
            )
            validate_params(params, self.limits)
            adapters = await self._adapters(request)
            try:
                encoded = await self.tokenizer.encode_batch_async(texts)
            except Exception as err:
                raise ValidationError(f"tokenizer error {err}") from err
            for ids in encoded:
                self.metrics.input_tokenized(len(ids))
            validated = validate_inputs(
                texts,
                encoded,
                params,
                self.limits,
                prefix_id=adapters.prefix_id,
                prefix_length=adapters.prefix_length,
                adapter_id=adapters.adapter_id,
                adapter_kind=adapters.adapter_kind,
                bos_token_id=self.tokenizer.bos_token_id,
            )
        except ValidationError as err:
            self.metrics.request_failure("validation")
            await abort(context, err)
        for v in validated:
            # The requested max_new_tokens (params), not the one lowered to fit (TOKEN_LIMIT).
            self.metrics.input_validated(v.input_length, v.params.stopping.max_new_tokens)
        self.metrics.validation_done(time.monotonic() - arrival)
        return validated

    async def _adapters(self, request: Any) -> _Adapters:
        """The request's adapter and prompt prefix (validation rules 12a-12d, then 12):

        * ``adapter_id`` (absent or "": none) is refused when the shard has no adapter cache
          (``adapter_id supplied but no adapter store was configured``) or when it is not a
          valid id (checked here, before any RPC); otherwise the shard is asked its kind
          (``AdapterKinds``, cached), its refusals going to the client verbatim;
        * ``prefix_id`` (when set, even to "") keeps TGIS's meaning: a prompt-tuning prefix
          whose length the shard tells (rule 12). It goes with a LoRA adapter, not with a
          prompt-tuning one (``prefix_id and a prompt-tuning adapter_id cannot be
          combined``), whose virtual tokens stand in for a prefix's instead.

        Raises:
            ValidationError: the first refusal.
        """
        adapter_id = request.adapter_id if request.HasField("adapter_id") else ""
        adapter: AdapterInfo | None = None
        if adapter_id:
            if self.adapters is None:
                raise ValidationError(ADAPTERS_DISABLED_MESSAGE)
            check_adapter_id(adapter_id)
            adapter = await self._adapter_info(self.adapters, adapter_id)
        kind = None if adapter is None else adapter.kind
        if request.HasField("prefix_id"):
            if kind is AdapterKind.PROMPT_TUNING:
                raise ValidationError(PREFIX_WITH_PROMPT_TUNING_MESSAGE)
            prefix_id = request.prefix_id
            return _Adapters(prefix_id, await self._prefix_length(prefix_id), adapter_id, kind)
        if adapter is None:
            return _NO_ADAPTERS
        prefix_length = adapter.prefix_length if kind is AdapterKind.PROMPT_TUNING else 0
        return _Adapters("", prefix_length, adapter_id, kind)

    @staticmethod
    async def _adapter_info(adapters: AdapterKinds, adapter_id: str) -> AdapterInfo:
        """The adapter's kind (rule 12c: ValidationError when the shard refuses it, with
        its message as is, or cannot tell)."""
        try:
            adapter = await adapters.get(adapter_id)
        except AdapterLookupError as err:
            raise ValidationError(err.message) from err
        except ShardError as err:
            raise adapter_lookup_error(adapter_id, err.detail) from err
        if adapter.is_lora and not adapters.lora_supported:
            raise unsupported_adapter_error("LORA")
        return adapter

    async def _prefix_length(self, prefix_id: str) -> int:
        """The prompt prefix's virtual tokens (rule 12: ValidationError when the shard
        cannot tell, with its message)."""
        try:
            return await self.prefixes.get(prefix_id)
        except PrefixLookupError as err:
            raise prefix_lookup_error(prefix_id, err.message) from err
        except ShardError as err:
            raise prefix_lookup_error(prefix_id, err.detail) from err

    async def _collect_unary(
        self, state: RequestState, kind: str, arrival: float, index: int, count: int
    ) -> pb.GenerationResponse:
        validated = state.request
        to_text = self.tokenizer.id_to_token
        texts: list[str] = []
        tokens: list[pb.TokenInfo] = []
        input_tokens: list[pb.TokenInfo] = []
        while True:
            event = await state.events.get()
            if isinstance(event, BaseException):
                raise event
            if isinstance(event, InputTokensEvent):
                input_tokens = api.token_infos(event.tokens, to_text)
                continue
            texts.append(event.text)
            tokens.extend(api.token_infos(event.tokens, to_text))
            if event.is_final:
                break
        output = "".join(texts)
        text = output
        if validated.params.response.input_text:
            text = validated.text + ("\n\n" if self.is_seq2seq else "") + output
        self._record_success(state, event, kind, arrival, output, index, count)
        return api.unary_response(
            input_token_count=validated.input_length,
            final=event,
            text=text,
            seed=validated.sampling.seed or 0,
            tokens=tokens,
            input_tokens=input_tokens,
        )

    async def _stream(
        self, state: RequestState, validated: ValidatedRequest, arrival: float
    ) -> AsyncIterator[pb.GenerationResponse]:
        seed = validated.sampling.seed or 0
        to_text = self.tokenizer.id_to_token
        input_text = validated.text if validated.params.response.input_text else ""
        yield api.stream_header(validated.input_length, input_text, seed)
        output: list[str] = []
        carry: Event | None = None
        while True:
            event = carry if carry is not None else await state.events.get()
            carry = None
            if isinstance(event, BaseException):
                raise event
            if isinstance(event, InputTokensEvent):
                yield api.input_tokens_message(api.token_infos(event.tokens, to_text))
                continue
            if not event.tokens:  # no token details asked for: one message for what is queued
                event, carry = _merge_queued(state.events, event)
            output.append(event.text)
            message = api.stream_message(event, to_text)
            if event.is_final:
                message.seed = seed
                yield message
                self._record_success(state, event, "stream", arrival, "".join(output), 0, 1)
                return
            yield message

    def _record_success(
        self,
        state: RequestState,
        event: TokenEvent,
        kind: str,
        arrival: float,
        output: str,
        index: int,
        count: int,
    ) -> None:
        now = time.monotonic()
        reason = StopReason(event.stop_reason)
        # A request that timed out while queued was never admitted: no inference time.
        started = state.started_at if state.started_at is not None else now
        self.metrics.request_succeeded(
            stop_reason=reason.name,
            kind=kind,
            input_length=state.request.input_length,
            generated_tokens=event.generated_token_count,
            duration=now - arrival,
            inference_seconds=now - started,
        )
        who = {"single": "Request", "stream": "Streaming response"}.get(
            kind, f"Sub-request {index} from batch of {count}"
        )
        level = logging.WARNING if reason == StopReason.TOKEN_LIMIT else logging.INFO
        log.log(
            level,
            "%s generated %d tokens before %s, output %d bytes: %r",
            who,
            event.generated_token_count,
            reason.name,
            len(output.encode()),
            output[:32],
        )


def _optional(request: Any, name: str) -> str | None:
    """An ``optional string`` field of a request: None when absent."""
    return getattr(request, name) if request.HasField(name) else None


async def _no_prefixes(prefix_id: str) -> int:
    """The lookup of a servicer without a shard: no prefix exists (the shard's message)."""
    raise PrefixLookupError(f'prefix id "{prefix_id}" not found')


def _failure(error: BaseException | None, context: grpc.aio.ServicerContext) -> str | None:
    """How a call failed, for its span: the status it was aborted with, or the exception."""
    if error is None or isinstance(error, GeneratorExit):  # GeneratorExit: closed at the end
        return None
    if isinstance(error, grpc.aio.AbortError):
        try:
            code = context.code()
            return f"{getattr(code, 'name', code)}: {context.details()}"
        except Exception:
            pass
    if isinstance(error, asyncio.CancelledError):
        return "CANCELLED: the client went away"
    return f"{type(error).__name__}: {error}"


def _merge_queued(
    events: asyncio.Queue[Event], event: TokenEvent
) -> tuple[TokenEvent, Event | None]:
    """``event`` merged with the token events already queued behind it (a client, or the
    transport, that reads slower than tokens come): one message, the texts concatenated,
    the latest count and stop reason. Only for requests without token details, so a message
    never carries more than one token's details and no client can tell the difference but
    by counts that jump (TGIS's own messages skip tokens whose text is held back). Returns
    the merged event and the first queued event that could not be merged, if any."""
    if event.is_final or events.empty():
        return event, None
    texts = [event.text]
    last = event
    while not last.is_final and not events.empty():
        queued = events.get_nowait()
        if not isinstance(queued, TokenEvent) or queued.tokens:
            return _merged(texts, last), queued
        texts.append(queued.text)
        last = queued
    return _merged(texts, last), None


def _merged(texts: list[str], last: TokenEvent) -> TokenEvent:
    if len(texts) == 1:
        return last
    return TokenEvent(
        "".join(texts), last.generated_token_count, (), last.stop_reason, last.stop_sequence
    )


async def _all_or_nothing(coros: list[Any]) -> list[Any]:
    """Await every coroutine; on the first failure cancel the rest and raise it."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in done:
            error = task.exception()
            if error is not None:
                raise error
        return [t.result() for t in tasks]
    finally:
        for task in tasks:
            task.cancel()


# ---- registration: undecodable requests are the client's error -----------------------------

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["GenerationService"].full_name


@dataclass(frozen=True, slots=True)
class _Undecodable:
    """What the deserializer hands the handler in place of a request it could not parse."""

    error: ValidationError


def _lenient_deserializer(message_type: Any) -> Callable[[bytes], Any]:
    """``message_type.FromString``, but a ``DecodeError`` (a string field that is not valid
    UTF-8, a corrupt or truncated message) becomes an :class:`_Undecodable` for the handler
    to refuse: raised in the deserializer, grpc.aio would answer ``UNKNOWN``."""
    name = message_type.DESCRIPTOR.full_name

    def deserialize(data: bytes) -> Message | _Undecodable:
        try:
            message: Message = message_type.FromString(data)
        except DecodeError as err:
            return _Undecodable(undecodable_request_error(name, err))
        return message

    return deserialize


def _refusing_undecodable_unary(
    method: Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]], metrics: Metrics | None
) -> Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]:
    async def handle(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, _Undecodable):
            await _refuse_undecodable(request, context, metrics)
        return await method(request, context)

    return handle


async def _refuse_undecodable(
    request: _Undecodable, context: grpc.aio.ServicerContext, metrics: Metrics | None
) -> None:
    """INVALID_ARGUMENT with the decoder's reason; a generation call counts as a
    validation failure (``tgi_request_failure{err="validation"}``)."""
    log.info("Refused an undecodable request: %s", request.error)
    if metrics is not None:
        metrics.request_failure("validation")
    await abort(context, request.error)


def add_generation_service(servicer: GenerationServicer, server: grpc.aio.Server) -> None:
    """Register ``servicer`` on ``server`` as ``fmaas.GenerationService``.

    The same handlers as ``generation_pb2_grpc.add_GenerationServiceServicer_to_server``,
    except that a request that does not parse gets ``INVALID_ARGUMENT`` (``request is not a
    valid <type> message: <reason>``) instead of grpc's ``UNKNOWN`` ``Unexpected <class
    'google.protobuf.message.DecodeError'>``.
    """
    metrics = servicer.metrics
    handlers = {
        "Generate": grpc.unary_unary_rpc_method_handler(
            _refusing_undecodable_unary(servicer.Generate, metrics),
            request_deserializer=_lenient_deserializer(pb.BatchedGenerationRequest),
            response_serializer=pb.BatchedGenerationResponse.SerializeToString,
        ),
        "GenerateStream": grpc.unary_stream_rpc_method_handler(
            servicer.GenerateStream,  # refuses an _Undecodable itself: no extra hop per message
            request_deserializer=_lenient_deserializer(pb.SingleGenerationRequest),
            response_serializer=pb.GenerationResponse.SerializeToString,
        ),
        "Tokenize": grpc.unary_unary_rpc_method_handler(
            _refusing_undecodable_unary(servicer.Tokenize, None),
            request_deserializer=_lenient_deserializer(pb.BatchedTokenizeRequest),
            response_serializer=pb.BatchedTokenizeResponse.SerializeToString,
        ),
        "ModelInfo": grpc.unary_unary_rpc_method_handler(
            _refusing_undecodable_unary(servicer.ModelInfo, None),
            request_deserializer=_lenient_deserializer(pb.ModelInfoRequest),
            response_serializer=pb.ModelInfoResponse.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


__all__ = ["GenerationServicer", "RouterError", "add_generation_service"]
