"""Plain types a request passes through inside the router (no protobuf, no torch).

Chain: pb GenerationRequest -> (validation) ValidatedRequest -> (engine) RequestState
-> TokenEvent -> pb GenerationResponse.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from tgis.shard_api.messages import AdapterKind, LengthPenalty

__all__ = [
    "GenerationParams",
    "LengthPenalty",
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
class SamplingParams:
    """Decoding parameters after TGIS's zero-means-default conversion (spec §1.3).

    temperature == 0.0 means greedy.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    typical_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    length_penalty: LengthPenalty | None = None

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


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


@dataclass(frozen=True, slots=True)
class ResponseOptions:
    input_text: bool = False
    generated_tokens: bool = False
    input_tokens: bool = False
    token_logprobs: bool = False
    token_ranks: bool = False
    top_n_tokens: int = 0


@dataclass(frozen=True, slots=True)
class GenerationParams:
    """The whole converted `Parameters` message, shared by every input of one RPC."""

    sampling: SamplingParams
    stopping: StoppingParams
    response: ResponseOptions
    truncate_input_tokens: int = 0


@dataclass(frozen=True, slots=True)
class ValidatedRequest:
    """One input, tokenized and checked against the server limits; ready to queue."""

    text: str
    # Prompt token ids after left truncation (what the model sees).
    input_ids: tuple[int, ...]
    params: GenerationParams
    # Per-input stopping (max_new_tokens may have been reduced -> TOKEN_LIMIT).
    stopping: StoppingParams
    # Per-input sampling (each sampled input of a batch gets its own random seed).
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

    @property
    def input_length(self) -> int:
        """Input tokens after truncation, without the prefix: what clients are told
        (``input_token_count``) and ``tgi_request_input_length`` records."""
        return len(self.input_ids)

    @property
    def lora_id(self) -> str:
        """The LoRA adapter applied to this request ("": none), what ``max_loras`` counts."""
        return self.adapter_id if self.adapter_kind is AdapterKind.LORA else ""

    @property
    def prompt_length(self) -> int:
        """Prompt positions the shard computes and keeps in its KV cache: the prefix's
        virtual tokens and the input's."""
        return self.prefix_length + len(self.input_ids)
