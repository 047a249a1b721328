"""OpenAI chat completion bodies from a request's events, whole or as stream chunks.

Each choice's text goes through its reader (``openai_tool_output.py: choice_output``): plain
content, or content and tool calls by the request's ``tool_choice``. Unary: the message's
``content`` (null when the choice only called tools) and ``tool_calls``. Streaming: a first
chunk per choice with the assistant role, then one chunk per event, its delta holding the
content and the calls that event completed (``tool_calls`` entries with ``index``, and
``id``, ``type`` and ``function.name`` on a call's first entry), its ``finish_reason`` on
the last. The stream's deltas reassemble into the unary message: both come from the same
reader over the same text.

``finish_reason`` is ``tool_calls`` when a choice called tools and stopped by itself
(``auto`` and ``required``), ``stop`` for a named function's call (as OpenAI: the call was
forced), else as for completions.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

from tgis.router.core.request_state import InputTokensEvent, RequestState, TokenEvent
from tgis.router.edge.openai_choices import Choice, finish_reason, interleaved, usage
from tgis.router.edge.openai_replies import OpenAIReplies, StreamHead
from tgis.router.edge.openai_requests import OpenAIRequest
from tgis.router.edge.openai_tool_output import choice_output, delta_of, message_of
from tgis.router.edge.openai_tool_parsers import ChoiceOutput, Piece

__all__ = ["ChatReplies"]


def _finish(request: OpenAIRequest, output: ChoiceOutput, event: TokenEvent) -> str | None:
    reason = finish_reason(event.stop_reason)
    named = request.tools is not None and request.tools.mode == "named"
    if reason == "stop" and output.calls and not named:
        return "tool_calls"
    return reason


class ChatReplies:
    """Chat bodies, on the completions' shared builders."""

    def __init__(self, replies: OpenAIReplies) -> None:
        self.replies = replies

    async def chat(
        self, request: OpenAIRequest, states: Sequence[RequestState], arrival: float
    ) -> dict[str, Any]:
        choices = [Choice(s) for s in states]
        await self.replies.collect(choices, arrival)
        body = []
        for i, choice in enumerate(choices):
            output = choice_output(request.tools, request.tool_call_parser)
            pieces: list[Piece] = []
            for text in choice.texts:
                pieces += output.feed(text)
            pieces += output.finish()
            logprobs = None
            if request.logprobs is not None:
                logprobs = self.replies.logprobs.chat(choice.tokens)
            body.append(
                {
                    "index": i,
                    "message": message_of(pieces),
                    "logprobs": logprobs,
                    "finish_reason": _finish(request, output, choice.ended),
                }
            )
        counts = usage(choices, request.n)
        return self.replies.envelope(request, "chatcmpl", "chat.completion", body, usage=counts)

    async def chat_chunks(
        self, request: OpenAIRequest, states: Sequence[RequestState], arrival: float
    ) -> AsyncIterator[dict[str, Any]]:
        """The chunks of a streamed chat completion: each choice's role first, then its
        content and calls (several choices: interleaved)."""
        replies = self.replies
        head = replies.stream_head(request, "chatcmpl", "chat.completion.chunk")
        choices = [Choice(s) for s in states]
        outputs = [choice_output(request.tools, request.tool_call_parser) for _ in states]
        for i in range(len(states)):
            yield replies.chunk(head, i, delta={"role": "assistant", "content": ""})
        async for index, event in interleaved(states):
            if isinstance(event, InputTokensEvent):
                continue
            choices[index].add(event)
            chunk = self._chunk(head, request, outputs[index], index, event)
            if chunk is not None:
                yield chunk
            if event.is_final:
                replies.record_streamed(choices[index], index, len(states), arrival)
        if request.include_usage:
            yield replies.usage_chunk(head, usage(choices, request.n))

    def _chunk(
        self,
        head: StreamHead,
        request: OpenAIRequest,
        output: ChoiceOutput,
        index: int,
        event: TokenEvent,
    ) -> dict[str, Any] | None:
        """The chunk of one event; None when it says nothing (text held back, no
        logprobs, not the last)."""
        pieces = output.feed(event.text)
        if event.is_final:
            pieces += output.finish()
        logprobs = None
        if request.logprobs is not None:
            logprobs = self.replies.logprobs.chat(event.tokens)
        if not pieces and logprobs is None and not event.is_final:
            return None
        delta = delta_of(pieces)
        if event.is_final and delta == {"content": ""}:
            delta = {}
        finish = _finish(request, output, event) if event.is_final else None
        return self.replies.chunk(head, index, delta=delta, logprobs=logprobs, finish=finish)
