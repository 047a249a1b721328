"""Plain-Python mirrors of the shard protocol messages (``protos/shard.proto``).

The servicer converts protobuf to these at the edge, so the model runner, the sampler and
the tests never touch protobuf. They are frozen and picklable: with tensor parallelism,
rank 0 broadcasts each ``StepPlan`` to the other ranks as is.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class ModelKind(Enum):
    """What kind of model the shard serves (mirrors ``shard.proto``'s ``ModelKind``)."""

    CAUSAL_LM = 0
    SEQ2SEQ_LM = 1


@dataclass(frozen=True)
class LengthPenalty:
    """Exponential boost of the EOS score once ``start_index`` tokens have been generated."""

    start_index: int
    decay_factor: float


@dataclass(frozen=True)
class SamplingParams:
    """Per-sequence decoding parameters; the defaults mean greedy with no processing."""

    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = disabled
    top_p: float = 1.0  # 1.0 = disabled
    typical_p: float = 1.0  # 1.0 or <= 0 = disabled
    seed: int | None = None
    repetition_penalty: float = 1.0  # 1.0 = no penalty
    min_new_tokens: int = 0
    length_penalty: LengthPenalty | None = None

    @property
    def is_greedy(self) -> bool:
        """Whether the sequence takes the argmax instead of sampling."""
        return self.temperature == 0.0


@dataclass(frozen=True)
class DetailOptions:
    """Which token details to compute for a sequence (``TokenDetailOptions``)."""

    logprobs: bool = False
    ranks: bool = False
    top_n: int = 0
    input_tokens: bool = False
    generated_tokens: bool = False


@dataclass(frozen=True)
class NewSequence:
    """A sequence announced to the shard, with its whole prompt."""

    request_id: int
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams = SamplingParams()
    details: DetailOptions = DetailOptions()


@dataclass(frozen=True)
class ScheduledSequence:
    """One sequence's share of a step: how many tokens to compute, which blocks it gained."""

    request_id: int
    num_tokens: int
    new_block_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class StepPlan:
    """One forward pass, as a diff against the shard's state (``StepRequest``)."""

    step_id: int = 0
    new_sequences: tuple[NewSequence, ...] = ()
    scheduled: tuple[ScheduledSequence, ...] = ()
    finished_request_ids: tuple[int, ...] = ()
    # Kept (tokens, counters, generator) but their blocks dropped: recomputed when resumed.
    preempted_request_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class TopToken:
    """One of the most likely alternatives at a position."""

    token_id: int
    logprob: float


@dataclass(frozen=True)
class TokenDetail:
    """A token and whichever details were asked for (0 / empty when not asked)."""

    token_id: int
    logprob: float = 0.0
    rank: int = 0
    top_tokens: tuple[TopToken, ...] = ()


@dataclass(frozen=True)
class SampledToken:
    """The token sampled for one sequence in a step."""

    request_id: int
    token: TokenDetail


@dataclass(frozen=True)
class InputTokenDetails:
    """Details of every prompt position of a sequence, sent once when its prompt completes."""

    request_id: int
    tokens: tuple[TokenDetail, ...]


@dataclass(frozen=True)
class SequenceError:
    """A sequence that failed on its own; the shard has already forgotten it."""

    request_id: int
    message: str


@dataclass(frozen=True)
class StepOutput:
    """The result of one step (``StepResponse``)."""

    step_id: int
    tokens: tuple[SampledToken, ...] = ()
    input_tokens: tuple[InputTokenDetails, ...] = ()
    errors: tuple[SequenceError, ...] = ()
    forward_time_ns: int = 0


@dataclass(frozen=True)
class ShardInfo:
    """Static facts about the loaded model and its KV cache (``InfoResponse``)."""

    model_kind: ModelKind
    eos_token_ids: tuple[int, ...]
    vocab_size: int
    block_size: int
    num_blocks: int
    world_size: int
    max_position_embeddings: int
    model_type: str
    dtype: str
    device: str
    attention_backend: str
