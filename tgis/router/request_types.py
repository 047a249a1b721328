"""The router's request vocabulary: plain types a request passes through (no protobuf, no torch).

Chain: pb GenerationRequest -> (edge/fmaas.py) GenerationParams -> (intake) ValidatedRequest
-> (core) RequestState -> TokenEvent -> pb GenerationResponse.

Sampling parameters are the shard contract's own :class:`SamplingParams` (one type on both
sides), built once at the edge with TGIS's zero-means-unset rules applied; ``min_new_tokens``
is both a stopping rule here and the sampler's EOS mask there, so the edge writes the
client's value into both.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from tgis.shard_api.messages import (
    AdapterKind,
    DetailOptions,
    LengthPenalty,
    NewSequence,
    SamplingParams,
)

__all__ = [
    "NO_ADAPTERS",
    "GenerationParams",
    "GuidedKind",
    "GuidedRequest",
    "LengthPenalty",
    "ResolvedAdapters",
    "ResponseOptions",
    "SamplingParams",
    "StopReason",
    "StoppingParams",
    "ValidatedRequest",
]


class StopReason(enum.IntEnum):
    """Why a request finished; values equal fmaas.StopReason on the wire."""

    NOT_FINISHED = 0
    MAX_TOKENS = 1
    EOS_TOKEN = 2
    CANCELLED = 3
    TIME_LIMIT = 4
    STOP_SEQUENCE = 5
    TOKEN_LIMIT = 6
    ERROR = 7


@dataclass(frozen=True, slots=True)
class StoppingParams:
    max_new_tokens: int = 20
    min_new_tokens: int = 0
    stop_sequences: tuple[str, ...] = ()
    include_stop_sequence: bool = False
    # Absolute time.monotonic() deadline, or None.
    deadline: float | None = None
    # True when max_new_tokens was lowered to fit max_sequence_length (-> TOKEN_LIMIT).
    truncated_to_fit: bool = False
    # vLLM's stop_token_ids (OpenAI routes): these ids end the request as EOS does (after
    # min_new_tokens), their text kept unless they are special tokens.
    stop_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class ResponseOptions:
    input_text: bool = False
    generated_tokens: bool = False
    input_tokens: bool = False
    token_logprobs: bool = False
    token_ranks: bool = False
    top_n_tokens: int = 0
    # vLLM's skip_special_tokens for this request (None: the server's --output-special-tokens).
    skip_special_tokens: bool | None = None


class GuidedKind(enum.Enum):
    """Which guided-decoding field a request set; the value labels its metrics."""

    JSON_OBJECT = "json_object"  # format: JSON
    JSON_SCHEMA = "json_schema"
    REGEX = "regex"
    CHOICE = "choice"
    GRAMMAR = "grammar"

    @property
    def field(self) -> str:
        """The request field it came from, as error messages name it."""
        return "format" if self is GuidedKind.JSON_OBJECT else self.value


@dataclass(frozen=True, slots=True)
class GuidedRequest:
    """The client's constraint on the output, as sent (``intake/guided.py`` compiles it)."""

    kind: GuidedKind
    text: str = ""  # the schema, regex or grammar (JSON_OBJECT: an unknown format number)
    choices: tuple[str, ...] = ()  # CHOICE only


@dataclass(frozen=True, slots=True)
class GenerationParams:
    """The whole converted `Parameters` message, shared by every input of one RPC."""

    sampling: SamplingParams
    stopping: StoppingParams
    response: ResponseOptions
    truncate_input_tokens: int = 0
    # Guided decoding (None: unconstrained, also for format: TEXT). Once compiled, the
    # grammar travels in ``sampling.grammar``.
    guided: GuidedRequest | None = None


@dataclass(frozen=True, slots=True)
class ResolvedAdapters:
    """What a call's ``prefix_id`` and ``adapter_id`` resolved to."""

    prefix_id: str = ""
    prefix_length: int = 0
    """The prefix's virtual tokens, or a prompt-tuning adapter's."""
    adapter_id: str = ""
    adapter_kind: AdapterKind | None = None
    prefix_version: str = ""
    adapter_version: str = ""
    """The versions of their contents the shard reported (``PrefixInfo``, ``AdapterInfo``)."""


NO_ADAPTERS = ResolvedAdapters()


@dataclass(frozen=True, slots=True)
class ValidatedRequest:
    """One input, tokenized and checked against the server limits; ready to queue."""

    text: str
    # Prompt token ids after left truncation (what the model sees).
    input_ids: tuple[int, ...]
    params: GenerationParams
    # Per-input stopping (max_new_tokens may have been reduced -> TOKEN_LIMIT).
    stopping: StoppingParams
    # Per-input sampling: each sampled input of a batch without a client seed gets its own.
    sampling: SamplingParams
    # The request's prompt-tuning prefix ("": none; shared by every input of a batch) and
    # its virtual tokens, which the model sees before ``input_ids``; with a prompt-tuning
    # adapter, ``prefix_id`` is "" and ``prefix_length`` the adapter's virtual tokens.
    prefix_id: str = ""
    prefix_length: int = 0
    # The request's adapter (vllm-tgis-adapter's ``adapter_id``; "": none, shared by every
    # input of a batch) and its kind (None without one).
    adapter_id: str = ""
    adapter_kind: AdapterKind | None = None
    # The versions of the prefix's and the adapter's contents when the router looked them
    # up ("": none): the prefix cache keys blocks by them.
    prefix_version: str = ""
    adapter_version: str = ""

    @property
    def input_length(self) -> int:
        """Input tokens after truncation, without the prefix: what clients are told
        (``input_token_count``) and ``tgi_request_input_length`` records."""
        return len(self.input_ids)

    @property
    def cache_identity(self) -> tuple[str, str, str, str, int]:
        """What besides token ids changes this request's KV: the prefix-cache hash chain
        starts from it (``core/prefix_cache.py``)."""
        return (
            self.adapter_id,
            self.adapter_version,
            self.prefix_id,
            self.prefix_version,
            self.prefix_length,
        )

    @property
    def lora_id(self) -> str:
        """The LoRA adapter applied to this request ("": none), what ``max_loras`` counts."""
        return self.adapter_id if self.adapter_kind is AdapterKind.LORA else ""

    @property
    def prompt_length(self) -> int:
        """Prompt positions the shard computes and keeps in its KV cache: the prefix's
        virtual tokens and the input's."""
        return self.prefix_length + len(self.input_ids)

    def new_sequence(self, request_id: int, *, versioned: bool = False) -> NewSequence:
        """How the shard first hears of this input as request ``request_id``: its prompt,
        its prompt prefix or prompt-tuning adapter (whose virtual tokens come first in every
        count of its steps, as in :attr:`prompt_length`), its adapter, its sampling and the
        token details it asked for; ``versioned`` (the prefix cache is on): the versions of
        the prefix's and the adapter's contents, which the shard checks."""
        response = self.params.response
        return NewSequence(
            request_id=request_id,
            prompt_token_ids=self.input_ids,
            prefix_id=self.prefix_id,
            prefix_length=self.prefix_length,
            adapter_id=self.adapter_id,
            prefix_version=self.prefix_version if versioned else "",
            adapter_version=self.adapter_version if versioned else "",
            sampling=self.sampling,
            details=DetailOptions(
                logprobs=response.token_logprobs,
                ranks=response.token_ranks,
                top_n=response.top_n_tokens,
                input_tokens=response.input_tokens,
                generated_tokens=response.generated_tokens,
            ),
        )
