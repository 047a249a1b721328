"""The router<->shard contract as plain router-side types (protobuf lives in shard_client)."""

from __future__ import annotations

from dataclasses import dataclass

from tgis.router.request_types import SamplingParams


@dataclass(frozen=True, slots=True)
class ShardInfo:
    """What the shard reported about its model and KV cache (Info RPC)."""

    is_seq2seq: bool
    eos_token_ids: frozenset[int]
    vocab_size: int
    block_size: int
    num_blocks: int
    world_size: int
    max_position_embeddings: int
    model_type: str
    dtype: str
    device: str
    attention_backend: str


@dataclass(frozen=True, slots=True)
class DetailOptions:
    """Which token details the shard computes for one sequence."""

    logprobs: bool = False
    ranks: bool = False
    top_n: int = 0
    input_tokens: bool = False
    generated_tokens: bool = False


@dataclass(frozen=True, slots=True)
class NewSequence:
    request_id: int
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    min_new_tokens: int
    details: DetailOptions


@dataclass(frozen=True, slots=True)
class ScheduledChunk:
    """Compute `num_tokens` more tokens of one sequence; its block table grows by new_block_ids."""

    request_id: int
    num_tokens: int
    new_block_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class StepPlan:
    """One forward pass: a diff against the shard's sequence state."""

    step_id: int
    new_sequences: tuple[NewSequence, ...]
    scheduled: tuple[ScheduledChunk, ...]
    finished_ids: tuple[int, ...]
    preempted_ids: tuple[int, ...] = ()
    """Keep their tokens and sampler, drop their blocks (after forgetting finished_ids)."""

    @property
    def has_message(self) -> bool:
        """Worth sending even without work: the shard must forget or preempt something."""
        return bool(self.scheduled or self.finished_ids or self.preempted_ids)


@dataclass(frozen=True, slots=True)
class TokenDetail:
    token_id: int
    logprob: float = 0.0
    rank: int = 0
    top_tokens: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class StepOutput:
    """What one Step produced: a token per sequence whose prompt is complete, errors by id."""

    tokens: dict[int, TokenDetail]
    input_tokens: dict[int, tuple[TokenDetail, ...]]
    errors: dict[int, str]
    forward_time_ns: int
