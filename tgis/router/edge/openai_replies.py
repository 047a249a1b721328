"""OpenAI response bodies from a request's events (``core/request_state.py``): completions
and chat completions, whole or as stream chunks.

Unary: every choice's events are collected (the deltas concatenated, so the unary text
equals the concatenated stream), with ``usage``. Streaming: one chunk per event (events
queued behind the one being sent are merged when no logprobs were asked for, as the gRPC
stream does); a chat stream opens with a chunk carrying the assistant role, and every
stream ends with a chunk holding the choice's ``finish_reason``; with
``stream_options.include_usage`` every chunk has ``usage: null`` and a last chunk with no
choices carries the counts. Several completion prompts stream interleaved, each chunk
naming its choice's ``index``.

``finish_reason``: ``stop`` for EOS and stop sequences, ``length`` for ``max_tokens``, the
context limit and the time limit. Each finished choice is recorded in the metrics and
logged as a gRPC request is (``Replies.record_success``).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from tgis.router.core.request_state import Event, RequestState, TokenEvent
from tgis.router.edge.openai_requests import OpenAIRequest
from tgis.router.edge.replies import Replies, all_or_nothing, merge_queued
from tgis.router.intake.tokenization import RouterTokenizer
from tgis.router.request_types import StopReason
from tgis.shard_api.messages import TokenDetail

__all__ = ["OpenAIReplies", "finish_reason"]

_STOPPED = (StopReason.EOS_TOKEN, StopReason.STOP_SEQUENCE)


def finish_reason(reason: StopReason) -> str | None:
    if reason == StopReason.NOT_FINISHED:
        return None
    return "stop" if reason in _STOPPED else "length"


@dataclass(frozen=True)
class _Stream:
    """What every chunk of one stream repeats."""

    ident: str
    created: int
    obj: str
    include_usage: bool
    model: str  # the name the client asked for (the served model, or an adapter's)


@dataclass
class _Choice:
    """One choice's output so far."""

    state: RequestState
    texts: list[str] = field(default_factory=list)
    tokens: list[TokenDetail] = field(default_factory=list)
    final: TokenEvent | None = None


class OpenAIReplies:
    """Builds the OpenAI bodies of one model's requests."""

    def __init__(self, replies: Replies, tokenizer: RouterTokenizer, model: str) -> None:
        self.replies = replies
        self.tokenizer = tokenizer
        self.model = model

    # ---- unary -------------------------------------------------------------------------------

    async def completion(
        self, request: OpenAIRequest, states: Sequence[RequestState], arrival: float
    ) -> dict[str, Any]:
        choices = [_Choice(s) for s in states]
        kind = "single" if len(states) == 1 else "batch"
        # The first failure fails them all, the others' waits cancelled.
        await all_or_nothing(
            [self._collect(c, kind, arrival, i, len(states)) for i, c in enumerate(choices)]
        )
        body = [
            {
                "index": i,
                "text": (c.state.request.text if request.echo else "") + "".join(c.texts),
                "logprobs": self._completion_logprobs(c.tokens)
                if request.logprobs is not None
                else None,
                "finish_reason": finish_reason(_final(c).stop_reason),
            }
            for i, c in enumerate(choices)
        ]
        return self._envelope(request, "cmpl", "text_completion", body, usage=_usage(choices))

    async def chat(
        self, request: OpenAIRequest, state: RequestState, arrival: float
    ) -> dict[str, Any]:
        choice = _Choice(state)
        await self._collect(choice, "single", arrival, 0, 1)
        logprobs = None
        if request.logprobs is not None:
            logprobs = {"content": [self._chat_logprob(t) for t in choice.tokens]}
        body = [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "".join(choice.texts)},
                "logprobs": logprobs,
                "finish_reason": finish_reason(_final(choice).stop_reason),
            }
        ]
        return self._envelope(request, "chatcmpl", "chat.completion", body, usage=_usage([choice]))

    async def _collect(
        self, choice: _Choice, kind: str, arrival: float, index: int, count: int
    ) -> None:
        while choice.final is None:
            event = await choice.state.events.get()
            if isinstance(event, BaseException):
                raise event
            if not isinstance(event, TokenEvent):
                continue
            choice.texts.append(event.text)
            choice.tokens.extend(event.tokens)
            if event.is_final:
                choice.final = event
        self.replies.record_success(
            choice.state, choice.final, kind, arrival, "".join(choice.texts), index, count
        )

    # ---- streaming ---------------------------------------------------------------------------

    async def completion_chunks(
        self, request: OpenAIRequest, states: Sequence[RequestState], arrival: float
    ) -> AsyncIterator[dict[str, Any]]:
        """The chunks of a streamed completion (several prompts: interleaved)."""
        head = _Stream(
            _ident("cmpl"),
            int(time.time()),
            "text_completion",
            request.include_usage,
            request.model or self.model,
        )
        choices = [_Choice(s) for s in states]
        if request.echo:
            for i, c in enumerate(choices):
                yield self._chunk(head, i, text=c.state.request.text)
        async for index, event in _interleaved(states):
            choice = choices[index]
            logprobs = None
            if request.logprobs is not None:
                logprobs = self._completion_logprobs(list(event.tokens))
            finish = finish_reason(event.stop_reason)
            yield self._chunk(head, index, text=event.text, logprobs=logprobs, finish=finish)
            choice.texts.append(event.text)
            if event.is_final:
                choice.final = event
                output = "".join(choice.texts)
                self.replies.record_success(
                    choice.state, event, "stream", arrival, output, index, len(states)
                )
        if request.include_usage:
            yield self._usage_chunk(head, choices)

    async def chat_chunks(
        self, request: OpenAIRequest, state: RequestState, arrival: float
    ) -> AsyncIterator[dict[str, Any]]:
        """The chunks of a streamed chat completion: the role first, then the content."""
        head = _Stream(
            _ident("chatcmpl"),
            int(time.time()),
            "chat.completion.chunk",
            request.include_usage,
            request.model or self.model,
        )
        choice = _Choice(state)
        yield self._chunk(head, 0, delta={"role": "assistant", "content": ""})
        async for _, event in _interleaved([state]):
            logprobs = None
            if request.logprobs is not None:
                logprobs = {"content": [self._chat_logprob(t) for t in event.tokens]}
            choice.texts.append(event.text)
            delta = {"content": event.text} if event.text or not event.is_final else {}
            finish = finish_reason(event.stop_reason)
            yield self._chunk(head, 0, delta=delta, logprobs=logprobs, finish=finish)
            if event.is_final:
                choice.final = event
                output = "".join(choice.texts)
                self.replies.record_success(state, event, "stream", arrival, output, 0, 1)
        if request.include_usage:
            yield self._usage_chunk(head, [choice])

    # ---- bodies ------------------------------------------------------------------------------

    def _envelope(
        self,
        request: OpenAIRequest,
        prefix: str,
        obj: str,
        choices: list[dict[str, Any]],
        **extra: Any,
    ) -> dict[str, Any]:
        return {
            "id": _ident(prefix),
            "object": obj,
            "created": int(time.time()),
            "model": request.model or self.model,
            "choices": choices,
            **extra,
        }

    def _chunk(
        self,
        head: _Stream,
        index: int,
        *,
        text: str | None = None,
        delta: dict[str, Any] | None = None,
        logprobs: dict[str, Any] | None = None,
        finish: str | None = None,
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index}
        if delta is not None:
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        choice["logprobs"] = logprobs
        choice["finish_reason"] = finish
        chunk = self._head(head, [choice])
        if head.include_usage:
            chunk["usage"] = None
        return chunk

    def _usage_chunk(self, head: _Stream, choices: list[_Choice]) -> dict[str, Any]:
        return {**self._head(head, []), "usage": _usage(choices)}

    def _head(self, head: _Stream, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": head.ident,
            "object": head.obj,
            "created": head.created,
            "model": head.model,
            "choices": choices,
        }

    def _text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _chat_logprob(self, token: TokenDetail) -> dict[str, Any]:
        text = self._text(token.token_id)
        return {
            "token": text,
            "logprob": token.logprob,
            "bytes": list(text.encode("utf-8")),
            "top_logprobs": [
                {
                    "token": (t := self._text(top.token_id)),
                    "logprob": top.logprob,
                    "bytes": list(t.encode("utf-8")),
                }
                for top in token.top_tokens
            ],
        }

    def _completion_logprobs(self, tokens: list[TokenDetail]) -> dict[str, Any]:
        texts = [self._text(t.token_id) for t in tokens]
        offsets, at = [], 0
        for text in texts:
            offsets.append(at)
            at += len(text)
        return {
            "tokens": texts,
            "token_logprobs": [t.logprob for t in tokens],
            "top_logprobs": [
                {self._text(top.token_id): top.logprob for top in t.top_tokens} for t in tokens
            ],
            "text_offset": offsets,
        }


def _final(choice: _Choice) -> TokenEvent:
    assert choice.final is not None
    return choice.final


def _usage(choices: Sequence[_Choice]) -> dict[str, int]:
    prompt = sum(c.state.request.input_length for c in choices)
    completion = sum(c.final.generated_token_count for c in choices if c.final is not None)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def _ident(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


async def _interleaved(states: Sequence[RequestState]) -> AsyncIterator[tuple[int, TokenEvent]]:
    """Every state's token events as they come, each with its state's index, until all are
    final; a failure (an exception event) is raised."""
    if len(states) == 1:
        async for event in _events_of(states[0]):
            yield 0, event
        return
    merged: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()

    async def forward(index: int, state: RequestState) -> None:
        while True:
            event = await state.events.get()
            await merged.put((index, event))
            if isinstance(event, BaseException) or (
                isinstance(event, TokenEvent) and event.is_final
            ):
                return

    tasks = [asyncio.ensure_future(forward(i, s)) for i, s in enumerate(states)]
    try:
        live = len(states)
        while live:
            index, queued = await merged.get()
            token = _token_event(queued)
            if token is not None:
                yield index, token
                live -= token.is_final
    finally:
        for task in tasks:
            task.cancel()


async def _events_of(state: RequestState) -> AsyncIterator[TokenEvent]:
    """One state's token events until the final one; without token details, the events
    queued behind one are merged into it (``merge_queued``), as the gRPC stream does."""
    carry: Event | None = None
    while True:
        event = carry if carry is not None else await state.events.get()
        carry = None
        token = _token_event(event)
        if token is None:
            continue
        if not token.tokens:
            token, carry = merge_queued(state.events, token)
        yield token
        if token.is_final:
            return


def _token_event(event: Event) -> TokenEvent | None:
    if isinstance(event, BaseException):
        raise event
    return event if isinstance(event, TokenEvent) else None
