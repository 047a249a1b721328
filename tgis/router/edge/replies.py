"""Reply assembly: a request's events (``core/request_state.py``) become fmaas responses.

* Unary (Generate): every input's events are collected into one ``GenerationResponse``
  (the deltas concatenated, so unary text always equals the concatenated stream); a batch's
  inputs all succeed or the call fails with the first failure.
* Streaming (GenerateStream): TGIS's layout (spec §3.2): a first message with the input
  token count (and the input text if asked), then the input-token details if asked, then
  one message per event; events already queued behind the one being sent go out as one
  message when the request asked for no token details (:func:`merge_queued`).

Token details carry raw vocabulary strings. Each completed input is recorded in the
metrics and logged as TGIS does.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Coroutine, Sequence
from typing import Any, TypeVar

from tgis.pb import generation_pb2
from tgis.router.core.request_state import Event, InputTokensEvent, RequestState, TokenEvent
from tgis.router.edge import fmaas as api
from tgis.router.intake.tokenization import RouterTokenizer
from tgis.router.ops.metrics import Metrics
from tgis.router.request_types import StopReason

__all__ = ["Replies", "all_or_nothing", "merge_queued"]

log = logging.getLogger(__name__)

pb = generation_pb2
_T = TypeVar("_T")


class Replies:
    """Builds the responses of generation calls from their requests' events."""

    def __init__(self, *, tokenizer: RouterTokenizer, metrics: Metrics, is_seq2seq: bool) -> None:
        self.to_text = tokenizer.id_to_token
        self.metrics = metrics
        self.is_seq2seq = is_seq2seq

    async def unary(
        self, states: Sequence[RequestState], kind: str, arrival: float
    ) -> list[pb.GenerationResponse]:
        """One response per input, in order; the first failure fails them all."""
        count = len(states)
        return await all_or_nothing(
            [self._collect(s, kind, arrival, i, count) for i, s in enumerate(states)]
        )

    async def _collect(
        self, state: RequestState, kind: str, arrival: float, index: int, count: int
    ) -> pb.GenerationResponse:
        validated = state.request
        texts: list[str] = []
        tokens: list[pb.TokenInfo] = []
        input_tokens: list[pb.TokenInfo] = []
        while True:
            event = await state.events.get()
            if isinstance(event, BaseException):
                raise event
            if isinstance(event, InputTokensEvent):
                input_tokens = api.token_infos(event.tokens, self.to_text)
                continue
            texts.append(event.text)
            tokens.extend(api.token_infos(event.tokens, self.to_text))
            if event.is_final:
                break
        output = "".join(texts)
        text = output
        if validated.params.response.input_text:
            text = validated.text + ("\n\n" if self.is_seq2seq else "") + output
        self.record_success(state, event, kind, arrival, output, index, count)
        return api.unary_response(
            input_token_count=validated.input_length,
            final=event,
            text=text,
            seed=validated.sampling.seed or 0,
            tokens=tokens,
            input_tokens=input_tokens,
        )

    async def stream(
        self, state: RequestState, arrival: float
    ) -> AsyncIterator[pb.GenerationResponse]:
        """The messages of one streamed input, the last one carrying the stop reason."""
        validated = state.request
        seed = validated.sampling.seed or 0
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
                yield api.input_tokens_message(api.token_infos(event.tokens, self.to_text))
                continue
            if not event.tokens:  # no token details asked for: one message for what is queued
                event, carry = merge_queued(state.events, event)
            output.append(event.text)
            message = api.stream_message(event, self.to_text)
            if event.is_final:
                message.seed = seed
                yield message
                self.record_success(state, event, "stream", arrival, "".join(output), 0, 1)
                return
            yield message

    def record_success(
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


def merge_queued(
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


async def all_or_nothing(coros: list[Coroutine[Any, Any, _T]]) -> list[_T]:
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
