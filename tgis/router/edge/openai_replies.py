"""OpenAI completion bodies from a request's events (``core/request_state.py``), whole or as
stream chunks, and what chat replies (``openai_chat_replies.py``) share with them.

Unary: every choice's events are collected (the deltas concatenated, so the unary text
equals the concatenated stream), with ``usage``. Streaming: one chunk per event (events
queued behind the one being sent are merged when no logprobs were asked for, as the gRPC
stream does), several choices interleaved, each chunk naming its choice's ``index``;
every choice's last chunk holds its ``finish_reason``; with
``stream_options.include_usage`` every chunk has ``usage: null`` and a last chunk with no
choices carries the counts.

Choices: prompt p's j-th choice (of ``n``) is ``index`` ``p * n + j``, as OpenAI orders
them. ``echo`` puts the prompt before the output: a stream's first chunk of each choice is
its prompt (with its logprobs when asked for: sent when the prompt has been computed).
``max_tokens: 0`` (with echo) leaves the one token generated out: text, logprobs and
``completion_tokens``.

``finish_reason``: ``stop`` for EOS and stop sequences, ``length`` for ``max_tokens``, the
context limit and the time limit. Each finished choice is recorded in the metrics and
logged as a gRPC request is (``Replies.record_success``).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from tgis.router.core.request_state import InputTokensEvent, RequestState, TokenEvent
from tgis.router.edge.openai_choices import Choice, finish_reason, ident, interleaved, usage
from tgis.router.edge.openai_logprobs import Logprobs, joined
from tgis.router.edge.openai_requests import OpenAIRequest
from tgis.router.edge.replies import Replies, all_or_nothing
from tgis.router.intake.tokenization import RouterTokenizer

__all__ = ["OpenAIReplies", "StreamHead", "finish_reason"]


@dataclass(frozen=True)
class StreamHead:
    """What every chunk of one stream repeats."""

    ident: str
    created: int
    obj: str
    include_usage: bool
    model: str  # the name the client asked for (the served model, or an adapter's)


class OpenAIReplies:
    """Builds the OpenAI bodies of one model's requests."""

    def __init__(self, replies: Replies, tokenizer: RouterTokenizer, model: str) -> None:
        self.replies = replies
        self.tokenizer = tokenizer
        self.model = model
        self.logprobs = Logprobs(tokenizer)

    # ---- unary -------------------------------------------------------------------------------

    async def completion(
        self, request: OpenAIRequest, states: Sequence[RequestState], arrival: float
    ) -> dict[str, Any]:
        choices = [Choice(s) for s in states]
        await self.collect(choices, arrival)
        body = [
            {
                "index": i,
                "text": (c.state.request.text if request.echo else "")
                + ("" if request.drop_output else "".join(c.texts)),
                "logprobs": self._choice_logprobs(request, c),
                "finish_reason": finish_reason(c.ended.stop_reason),
            }
            for i, c in enumerate(choices)
        ]
        counts = usage(choices, request.n, request.drop_output)
        return self.envelope(request, "cmpl", "text_completion", body, usage=counts)

    def _choice_logprobs(self, request: OpenAIRequest, choice: Choice) -> dict[str, Any] | None:
        if request.logprobs is None:
            return None
        prompt, at = self.logprobs.completion(choice.prompt_tokens, prompt=True)
        output = [] if request.drop_output else choice.tokens
        return joined(prompt, self.logprobs.completion(output, at)[0])

    async def collect(self, choices: Sequence[Choice], arrival: float) -> None:
        """Every choice's events (the first failure fails them all, the others' waits
        cancelled), each finished choice recorded."""
        kind = "single" if len(choices) == 1 else "batch"

        async def collect(index: int, choice: Choice) -> None:
            await choice.collect()
            output = "".join(choice.texts)
            self.replies.record_success(
                choice.state, choice.ended, kind, arrival, output, index, len(choices)
            )

        await all_or_nothing([collect(i, c) for i, c in enumerate(choices)])

    def record_streamed(self, choice: Choice, index: int, count: int, arrival: float) -> None:
        output = "".join(choice.texts)
        self.replies.record_success(
            choice.state, choice.ended, "stream", arrival, output, index, count
        )

    # ---- streaming ---------------------------------------------------------------------------

    async def completion_chunks(
        self, request: OpenAIRequest, states: Sequence[RequestState], arrival: float
    ) -> AsyncIterator[dict[str, Any]]:
        """The chunks of a streamed completion (several choices: interleaved)."""
        head = self.stream_head(request, "cmpl", "text_completion")
        choices = [Choice(s) for s in states]
        prompt_logprobs = request.call.params.response.input_tokens
        if request.echo and not prompt_logprobs:
            for i, c in enumerate(choices):
                yield self.chunk(head, i, text=c.state.request.text)
        async for index, event in interleaved(states):
            choice = choices[index]
            choice.add(event)
            if isinstance(event, InputTokensEvent):
                logprobs, choice.offset = self.logprobs.completion(event.tokens, prompt=True)
                yield self.chunk(head, index, text=choice.state.request.text, logprobs=logprobs)
                continue
            if request.drop_output and not event.is_final:
                continue
            yield self._completion_chunk(head, request, choice, index, event)
            if event.is_final:
                self.record_streamed(choice, index, len(states), arrival)
        if request.include_usage:
            yield self.usage_chunk(head, usage(choices, request.n, request.drop_output))

    def _completion_chunk(
        self,
        head: StreamHead,
        request: OpenAIRequest,
        choice: Choice,
        index: int,
        event: TokenEvent,
    ) -> dict[str, Any]:
        drop = request.drop_output
        logprobs = None
        if request.logprobs is not None:
            tokens = () if drop else event.tokens
            logprobs, choice.offset = self.logprobs.completion(tokens, choice.offset)
        text = "" if drop else event.text
        finish = finish_reason(event.stop_reason)
        return self.chunk(head, index, text=text, logprobs=logprobs, finish=finish)

    # ---- bodies ------------------------------------------------------------------------------

    def envelope(
        self,
        request: OpenAIRequest,
        prefix: str,
        obj: str,
        choices: list[dict[str, Any]],
        **extra: Any,
    ) -> dict[str, Any]:
        return {
            "id": ident(prefix),
            "object": obj,
            "created": int(time.time()),
            "model": request.model or self.model,
            "choices": choices,
            **extra,
        }

    def stream_head(self, request: OpenAIRequest, prefix: str, obj: str) -> StreamHead:
        model = request.model or self.model
        return StreamHead(ident(prefix), int(time.time()), obj, request.include_usage, model)

    def chunk(
        self,
        head: StreamHead,
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

    def usage_chunk(self, head: StreamHead, counts: dict[str, int]) -> dict[str, Any]:
        return {**self._head(head, []), "usage": counts}

    def _head(self, head: StreamHead, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": head.ident,
            "object": head.obj,
            "created": head.created,
            "model": head.model,
            "choices": choices,
        }
