"""RequestState: the one mutable record per request, owned by the engine task.

The servicer only reads the events the engine puts on `events`.
"""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass, field

from tgis.router.request_types import StopReason, ValidatedRequest
from tgis.router.step import TokenDetail


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """One generated token's effect on the response (text may be "" while held back)."""

    text: str
    generated_token_count: int
    token: TokenDetail | None
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
    events: asyncio.Queue[Event] = field(default_factory=asyncio.Queue)
    status: RequestStatus = RequestStatus.WAITING
    generated_ids: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    """KV blocks this request owns (none while queued, preempted included)."""
    blocks_sent: int = 0
    """How many of `block_ids` the shard has been told about."""
    num_computed: int = 0
    """Tokens whose KV entries are in the shard's cache."""
    preemptions: int = 0
    """Times it was taken out of the running batch to be recomputed later."""
    aborted: bool = False
    """Set by the servicer when the client went away; acted on by the engine."""
    known_to_shard: bool = False
    last_token_at: float | None = None
    """time.monotonic() of the latest generated token (inter-token latency)."""
    started_at: float | None = None
    """time.monotonic() when the request was first scheduled."""
    finish_reason: StopReason | None = None

    @property
    def prompt_length(self) -> int:
        return self.request.input_length

    @property
    def in_prompt(self) -> bool:
        return self.num_computed < self.prompt_length

    @property
    def known_length(self) -> int:
        """Prompt plus generated tokens."""
        return self.prompt_length + len(self.generated_ids)

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
    def worst_case_length(self) -> int:
        return self.prompt_length + self.request.stopping.max_new_tokens

    def emit(self, event: Event) -> None:
        self.events.put_nowait(event)
