"""HF TGI's response bodies from a request's events (``core/request_state.py``): ``/generate``'s
``{"generated_text", "details"}``, ``/generate_stream``'s events, ``/tokenize``'s tokens and
``/info``.

A generated token is ``{"id", "text", "logprob", "special"}``; its text is what it added to
the output (so the texts of a stream add up to ``generated_text``; an incomplete UTF-8
character shows in the token that completes it), except a special token's, which is its own
text (``</s>``) as TGI's, though ``generated_text`` leaves it out. Prefill and top tokens
are each token's own text. A logprob that is not a number (the first prompt token's) is
``null``. ``finish_reason``: ``eos_token``, ``stop_sequence``, else ``length`` (max tokens,
the context limit). ``seed`` is the one sampled with, ``null`` for greedy requests.

The stream is one event per generated token (``index`` counting from 1), ``generated_text``
``null`` until the last, which carries it and, when ``details`` was asked, ``details``
(finish reason, counts, seed). Each finished request is recorded in the metrics and logged
as a gRPC request is (``Replies.record_success``).
"""

from __future__ import annotations

import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from tgis import __version__
from tgis.router.config import RouterConfig
from tgis.router.core.request_state import InputTokensEvent, RequestState, TokenEvent
from tgis.router.edge.replies import Replies
from tgis.router.edge.tgi_requests import TGIRequest, TokenizeRequest
from tgis.router.intake.tokenization import RouterTokenizer
from tgis.router.intake.validation import ServerLimits
from tgis.router.request_types import StopReason
from tgis.shard_api.messages import ShardInfo, TokenDetail

__all__ = ["TGIReplies", "finish_reason", "server_info"]

_FINISH = {StopReason.EOS_TOKEN: "eos_token", StopReason.STOP_SEQUENCE: "stop_sequence"}


def finish_reason(reason: StopReason) -> str:
    return _FINISH.get(reason, "length")


def _logprob(value: float) -> float | None:
    return value if math.isfinite(value) else None


@dataclass
class _Output:
    """One request's answer so far."""

    texts: list[str] = field(default_factory=list)
    tokens: list[dict[str, Any]] = field(default_factory=list)
    top_tokens: list[list[dict[str, Any]]] = field(default_factory=list)
    prefill: list[dict[str, Any]] = field(default_factory=list)
    final: TokenEvent | None = None


class TGIReplies:
    """Builds the TGI bodies of one model's requests."""

    def __init__(self, replies: Replies, tokenizer: RouterTokenizer) -> None:
        self.replies = replies
        self.tokenizer = tokenizer
        added = tokenizer.tokenizer.get_added_tokens_decoder()
        self.special_ids = frozenset(i for i, t in added.items() if t.special)

    # ---- /generate -----------------------------------------------------------------------

    async def generate(
        self, request: TGIRequest, state: RequestState, arrival: float
    ) -> tuple[dict[str, Any], dict[str, str]]:
        """The body and TGI's timing and count headers of a whole answer."""
        out = _Output()
        while out.final is None:
            event = await state.events.get()
            if isinstance(event, BaseException):
                raise event
            if isinstance(event, InputTokensEvent):
                out.prefill = [self._prefill_token(t) for t in event.tokens]
                continue
            self._add(out, event)
        text = "".join(out.texts)
        self.replies.record_success(state, out.final, "single", arrival, text, 0, 1)
        body: dict[str, Any] = {"generated_text": self._full_text(request, state, text)}
        if request.details:
            body["details"] = {**self._details(state, out.final), "prefill": out.prefill}
            body["details"]["tokens"] = out.tokens
            if request.top_n_tokens:
                body["details"]["top_tokens"] = out.top_tokens
        return body, _headers(state, out.final, arrival)

    def _add(self, out: _Output, event: TokenEvent) -> None:
        out.texts.append(event.text)
        for i, token in enumerate(event.tokens):
            last = i == len(event.tokens) - 1
            out.tokens.append(self._token(token, event.text if last else ""))
            out.top_tokens.append(
                [self._top_token(t.token_id, t.logprob) for t in token.top_tokens]
            )
        if event.is_final:
            out.final = event

    # ---- /generate_stream ----------------------------------------------------------------

    async def events(
        self, request: TGIRequest, state: RequestState, arrival: float
    ) -> AsyncIterator[list[dict[str, Any]]]:
        """The stream's events, one per generated token, the last with the text; the events
        of tokens already queued behind one come with it (one write for them all)."""
        out = _Output()
        while out.final is None:
            batch: list[dict[str, Any]] = []
            event = await state.events.get()
            while True:
                if isinstance(event, BaseException):
                    if batch:
                        yield batch  # what came before the failure, then the failure
                    raise event
                if isinstance(event, TokenEvent):
                    batch += self._token_events(request, state, out, event, arrival)
                if out.final is not None or state.events.empty():
                    break
                event = state.events.get_nowait()
            if batch:
                yield batch

    def _token_events(
        self,
        request: TGIRequest,
        state: RequestState,
        out: _Output,
        event: TokenEvent,
        arrival: float,
    ) -> list[dict[str, Any]]:
        count = len(out.tokens)
        self._add(out, event)
        if not event.tokens:  # no token (none is generated after a time limit)
            out.tokens.append({"id": -1, "text": "", "logprob": None, "special": True})
            out.top_tokens.append([])
        return [
            self._stream_event(request, state, out, index, arrival)
            for index in range(count, len(out.tokens))
        ]

    def _stream_event(
        self, request: TGIRequest, state: RequestState, out: _Output, index: int, arrival: float
    ) -> dict[str, Any]:
        event: dict[str, Any] = {"index": index + 1, "token": out.tokens[index]}
        if request.top_n_tokens:
            event["top_tokens"] = out.top_tokens[index]
        event["generated_text"] = None
        event["details"] = None
        final = out.final
        if final is not None and index == len(out.tokens) - 1:
            text = "".join(out.texts)
            self.replies.record_success(state, final, "stream", arrival, text, 0, 1)
            event["generated_text"] = self._full_text(request, state, text)
            if request.details:
                event["details"] = self._details(state, final)
        return event

    # ---- pieces --------------------------------------------------------------------------

    def _full_text(self, request: TGIRequest, state: RequestState, text: str) -> str:
        return state.request.text + text if request.return_full_text else text

    def _details(self, state: RequestState, final: TokenEvent) -> dict[str, Any]:
        sampling = state.request.sampling
        return {
            "finish_reason": finish_reason(StopReason(final.stop_reason)),
            "generated_tokens": final.generated_token_count,
            "input_length": state.request.input_length,
            "seed": None if sampling.is_greedy else sampling.seed,
        }

    def _text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _token(self, token: TokenDetail, text: str) -> dict[str, Any]:
        special = token.token_id in self.special_ids
        if special and not text:
            text = self._text(token.token_id)
        return {
            "id": token.token_id,
            "text": text,
            "logprob": _logprob(token.logprob),
            "special": special,
        }

    def _top_token(self, token_id: int, logprob: float) -> dict[str, Any]:
        return {
            "id": token_id,
            "text": self._text(token_id),
            "logprob": _logprob(logprob),
            "special": token_id in self.special_ids,
        }

    def _prefill_token(self, token: TokenDetail) -> dict[str, Any]:
        return {
            "id": token.token_id,
            "text": self._text(token.token_id),
            "logprob": _logprob(token.logprob),
        }

    # ---- /tokenize -----------------------------------------------------------------------

    def tokenize(self, request: TokenizeRequest) -> list[dict[str, Any]]:
        """TGI's tokens of ``inputs``: id, text and character offsets (``truncate``: the
        last tokens only). Runs on the tokenizer's pool (``RouterTokenizer.run_async``)."""
        text = request.inputs
        encoding = self.tokenizer.tokenizer.encode(
            text, add_special_tokens=request.add_special_tokens
        )
        pairs = list(zip(encoding.ids, encoding.offsets, strict=True))
        if 0 < request.truncate < len(pairs):
            pairs = pairs[-request.truncate :]
        return [
            {"id": i, "text": text[start:stop], "start": start, "stop": stop}
            for i, (start, stop) in pairs
        ]


def _headers(state: RequestState, final: TokenEvent, arrival: float) -> dict[str, str]:
    """TGI's headers of a whole answer: the counts, and times in milliseconds."""
    now = time.monotonic()
    started = state.started_at if state.started_at is not None else now
    generated = max(final.generated_token_count, 1)
    return {
        "x-prompt-tokens": str(state.request.input_length),
        "x-generated-tokens": str(final.generated_token_count),
        "x-total-time": str(int((now - arrival) * 1000)),
        "x-queue-time": str(int((started - arrival) * 1000)),
        "x-inference-time": str(int((now - started) * 1000)),
        "x-time-per-token": str(int((now - started) * 1000 / generated)),
    }


def server_info(
    config: RouterConfig, shard: ShardInfo, limits: ServerLimits, kv_tokens: int
) -> dict[str, Any]:
    """``/info``: TGI's ``Info`` fields, from what the router knows (``kv_tokens``: the KV
    capacity the scheduler holds, in tokens). ``max_top_n_tokens`` is ``null`` without
    ``--max-top-n-tokens`` (no limit); no commit or image label is known (``null``)."""
    max_input = limits.max_input_tokens or limits.max_sequence_length - 1
    return {
        "model_id": config.served_model_name,
        "model_sha": None,
        "model_dtype": shard.dtype,
        "model_device_type": shard.device.split(":")[0],
        "model_pipeline_tag": "text2text-generation" if shard.is_seq2seq else "text-generation",
        "max_concurrent_requests": config.max_concurrent_requests,
        "max_best_of": limits.max_best_of,
        "max_stop_sequences": limits.max_stop_sequences,
        "max_input_tokens": max_input,
        "max_input_length": max_input,  # TGI 1's name of it
        "max_total_tokens": limits.max_sequence_length,
        "max_new_tokens": limits.max_new_tokens,
        "max_top_n_tokens": limits.max_top_n_tokens,
        "waiting_served_ratio": config.waiting_served_ratio,
        "max_batch_total_tokens": kv_tokens,
        "max_waiting_tokens": config.max_waiting_tokens,
        "max_batch_size": config.effective_max_batch_size,
        "validation_workers": config.tokenization_workers,
        "max_client_batch_size": limits.max_client_batch_size,
        "router": "text-generation-router",
        "version": __version__,
        "sha": None,
        "docker_label": None,
    }
