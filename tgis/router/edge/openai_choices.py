"""The choices of an OpenAI reply, from their requests' events (``core/request_state.py``):
each choice's output collected, several choices' events interleaved as they come, the usage
counts and the finish reasons, for ``openai_replies.py`` and ``openai_chat_replies.py``."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from tgis.router.core.request_state import Event, InputTokensEvent, RequestState, TokenEvent
from tgis.router.edge.replies import merge_queued
from tgis.router.request_types import StopReason
from tgis.shard_api.messages import TokenDetail

__all__ = ["Choice", "OutputEvent", "finish_reason", "ident", "interleaved", "usage"]

OutputEvent = TokenEvent | InputTokensEvent

_STOPPED = (StopReason.EOS_TOKEN, StopReason.STOP_SEQUENCE)


def finish_reason(reason: StopReason) -> str | None:
    """OpenAI's name of a stop reason: ``stop`` for EOS and stop sequences, ``length`` for
    ``max_tokens``, the context limit and the time limit."""
    if reason == StopReason.NOT_FINISHED:
        return None
    return "stop" if reason in _STOPPED else "length"


@dataclass
class Choice:
    """One choice's output so far."""

    state: RequestState
    texts: list[str] = field(default_factory=list)
    tokens: list[TokenDetail] = field(default_factory=list)
    prompt_tokens: tuple[TokenDetail, ...] = ()  # asked for by echo with logprobs
    final: TokenEvent | None = None
    offset: int = 0  # a stream's next text_offset

    @property
    def ended(self) -> TokenEvent:
        assert self.final is not None
        return self.final

    def add(self, event: OutputEvent) -> None:
        if isinstance(event, InputTokensEvent):
            self.prompt_tokens = event.tokens
            return
        self.texts.append(event.text)
        self.tokens.extend(event.tokens)
        if event.is_final:
            self.final = event

    async def collect(self) -> None:
        """Every event until the final one (a failure is raised)."""
        while self.final is None:
            self.add(_output_event(await self.state.events.get()))


def usage(choices: Sequence[Choice], n: int = 1, drop_output: bool = False) -> dict[str, int]:
    """OpenAI's counts: each prompt once (its ``n`` choices share it), every choice's
    generated tokens (none when they are dropped: ``max_tokens`` 0)."""
    prompt = sum(c.state.request.input_length for c in choices[::n])
    completion = 0
    if not drop_output:
        completion = sum(c.final.generated_token_count for c in choices if c.final is not None)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def ident(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


async def interleaved(states: Sequence[RequestState]) -> AsyncIterator[tuple[int, OutputEvent]]:
    """Every state's output events as they come, each with its state's index, until all
    are final; a failure (an exception event) is raised."""
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
            event = _output_event(queued)
            yield index, event
            live -= isinstance(event, TokenEvent) and event.is_final
    finally:
        for task in tasks:
            task.cancel()


async def _events_of(state: RequestState) -> AsyncIterator[OutputEvent]:
    """One state's output events until the final one; without token details, the token
    events queued behind one are merged into it (``merge_queued``), as the gRPC stream
    does."""
    carry: Event | None = None
    while True:
        event = _output_event(carry if carry is not None else await state.events.get())
        carry = None
        if isinstance(event, TokenEvent) and not event.tokens:
            event, carry = merge_queued(state.events, event)
        yield event
        if isinstance(event, TokenEvent) and event.is_final:
            return


def _output_event(event: Event) -> OutputEvent:
    if isinstance(event, BaseException):
        raise event
    return event
