"""RequestState: the one mutable record per request, owned by the engine task.

It carries the request's place in the schedule (counters the scheduler keeps), its output so
far with the detokenizer and stop checker that turn each generated token into a
``TokenEvent``, and the queue the servicer reads events from.
"""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass, field

from tgis.router.core.detokenizer import IncrementalDetokenizer, TokenDecoder
from tgis.router.core.draft_policy import DraftStats
from tgis.router.core.ngram import NgramIndex
from tgis.router.core.stopping import StopChecker, StopDecision, stream_hold_back_bytes
from tgis.router.request_types import StopReason, ValidatedRequest
from tgis.shard_api.messages import ShardInfo, TokenDetail


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """Generated tokens' effect on the response (text may be "" while held back).

    ``tokens`` holds the details of the tokens it covers when the request asked for them.
    """

    text: str
    generated_token_count: int
    tokens: tuple[TokenDetail, ...] = ()
    stop_reason: StopReason = StopReason.NOT_FINISHED
    stop_sequence: str = ""

    @property
    def is_final(self) -> bool:
        return self.stop_reason != StopReason.NOT_FINISHED


@dataclass(frozen=True, slots=True)
class InputTokensEvent:
    """Details of every prompt position, sent once when the prompt has been processed."""

    tokens: tuple[TokenDetail, ...]


Event = TokenEvent | InputTokensEvent | BaseException


@dataclass(slots=True, eq=False)
class RequestState:
    request_id: int
    request: ValidatedRequest
    arrival: float
    """time.monotonic() when the RPC arrived."""
    detokenizer: IncrementalDetokenizer
    stop_checker: StopChecker
    events: asyncio.Queue[Event] = field(default_factory=asyncio.Queue)
    status: RequestStatus = RequestStatus.WAITING
    generated_ids: list[int] = field(default_factory=list)
    pending_tokens: int = 0
    """Tokens the shard samples in steps sent but not answered yet (the overlap)."""
    block_ids: list[int] = field(default_factory=list)
    """KV blocks of this request's positions, in order (none while queued, preempted
    included); the first ones may be shared cached blocks. It holds all of them but the
    first ``released_blocks``."""
    released_blocks: int = 0
    """How many of the first ``block_ids`` it gave back, wholly behind every layer's
    sliding window (``Scheduler.kv_window``): their ids stay in place, so every block keeps
    its position's index, and the shard's table keeps them too but never reads them."""
    registered_blocks: int = 0
    """How many of ``block_ids`` are in the prefix cache (shared, or registered by it)."""
    block_hashes: list[bytes] = field(default_factory=list)
    """The prefix-cache hashes of its full blocks of known tokens computed so far (they do
    not depend on where the blocks are, so they outlive a preemption)."""
    blocks_sent: int = 0
    """How many of `block_ids` the shard has been told about."""
    num_computed: int = 0
    """Tokens whose KV entries are in the shard's cache once the steps sent have run."""
    preemptions: int = 0
    """Times it was taken out of the running batch to be recomputed later."""
    state_slot: int | None = None
    """Its recurrent-state slot while it runs (``state_slots.py``; a model with Mamba
    layers), None otherwise."""
    aborted: bool = False
    """Set by the servicer when the client went away; acted on by the engine."""
    known_to_shard: bool = False
    last_token_at: float | None = None
    """time.monotonic() of the latest generated token (inter-token latency)."""
    started_at: float | None = None
    """time.monotonic() when the request was first scheduled."""
    finish_reason: StopReason | None = None
    correlation_id: str | None = None
    """The client's x-correlation-id, for the engine's log lines about this request."""
    ngram: NgramIndex | None = None
    """Its ids' n-grams, built when speculative decoding first drafts for it."""
    draft_stats: DraftStats | None = None
    """Its drafts' recent acceptance (``draft_policy.py``), from its first decode step
    while speculative decoding is on."""

    @property
    def held_blocks(self) -> list[int]:
        """The blocks it holds: ``block_ids`` after the released ones."""
        return self.block_ids[self.released_blocks :]

    @property
    def prompt_length(self) -> int:
        """Prompt positions to compute, a prompt prefix's virtual tokens included (every
        count below, and the KV blocks, are in these positions)."""
        return self.request.prompt_length

    @property
    def in_prompt(self) -> bool:
        return self.num_computed < self.prompt_length

    @property
    def known_length(self) -> int:
        """Prompt plus generated tokens, those still on their way included."""
        return self.prompt_length + len(self.generated_ids) + self.pending_tokens

    @property
    def uncomputed(self) -> int:
        """Tokens to feed the model: rest of the prompt (or of a recompute after a
        preemption), or the last sampled token."""
        return self.known_length - self.num_computed

    @property
    def prefilling(self) -> bool:
        """Computing prompt tokens (or recomputing known ones), not decoding: these tokens
        count against the step's prefill budget."""
        return self.num_computed < self.prompt_length or self.uncomputed > 1

    @property
    def generation_scheduled(self) -> bool:
        """Every token it may generate has been asked of the shard (max_new_tokens)."""
        return len(self.generated_ids) + self.pending_tokens >= self.request.stopping.max_new_tokens

    @property
    def worst_case_length(self) -> int:
        return self.prompt_length + self.request.stopping.max_new_tokens

    def emit(self, event: Event) -> None:
        self.events.put_nowait(event)

    # ---- output -------------------------------------------------------------------------

    def accept_token(self, token: TokenDetail, now: float) -> tuple[TokenEvent | None, bool]:
        """Add a generated token: detokenize it and check the stopping criteria.

        Returns the event for the client (None when there is nothing to send yet: no text
        and no token details) and whether the request is finished.
        """
        self.generated_ids.append(token.token_id)
        self.last_token_at = now
        count = len(self.generated_ids)
        detok = self.detokenizer
        text = detok.push(token.token_id)
        stop = self.stop_checker.check(
            token_id=token.token_id,
            generated_count=count,
            output_bytes=detok.output_bytes if self.stop_checker.needs_text else b"",
            bytes_added=detok.bytes_added,
            now=now,
        )
        details = (token,) if self.request.params.response.generated_tokens else ()
        if stop is None:
            if text or details:
                return TokenEvent(text, count, details), False
            return None, False
        return self.final_event(stop, text, details), True

    def final_event(
        self, stop: StopDecision, text: str = "", details: tuple[TokenDetail, ...] = ()
    ) -> TokenEvent:
        """The last event: whatever text is held back (cut at a stop sequence), the reason."""
        text += self.detokenizer.flush(stop.truncate_at_bytes)
        return TokenEvent(
            text, len(self.generated_ids), details, stop.reason, stop.stop_sequence or ""
        )


@dataclass(frozen=True, slots=True)
class OutputRules:
    """How the tokens a request generates become text and when they stop: one set for the
    whole server, from the tokenizer and the shard's facts."""

    tokenizer: TokenDecoder
    eos_token_ids: tuple[int, ...]
    skip_special_tokens: bool = True
    continuation: bool = True
    """Decoder-only output continues the prompt; encoder-decoder output starts fresh (its
    first word has no leading space)."""

    @classmethod
    def for_shard(
        cls, tokenizer: TokenDecoder, info: ShardInfo, output_special_tokens: bool = False
    ) -> OutputRules:
        return cls(
            tokenizer=tokenizer,
            eos_token_ids=info.eos_token_ids,
            skip_special_tokens=not output_special_tokens,
            continuation=not info.is_seq2seq,
        )

    def new_state(
        self,
        request_id: int,
        request: ValidatedRequest,
        arrival: float,
        correlation_id: str | None = None,
    ) -> RequestState:
        """A queued request's state, with its own detokenizer and stop checker."""
        skip = request.params.response.skip_special_tokens
        return RequestState(
            request_id=request_id,
            request=request,
            arrival=arrival,
            detokenizer=IncrementalDetokenizer(
                self.tokenizer,
                skip_special_tokens=self.skip_special_tokens if skip is None else skip,
                hold_back_bytes=stream_hold_back_bytes(request.stopping),
                eos_token_ids=self.eos_token_ids,
                continuation=self.continuation,
            ),
            stop_checker=StopChecker(
                request.stopping,
                self.eos_token_ids,
                constrained=bool(request.sampling.grammar),
            ),
            correlation_id=correlation_id,
        )
