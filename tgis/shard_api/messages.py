"""The router↔shard contract (``protos/shard.proto``) as plain Python: one face for both sides.

The router builds these and the shard consumes them (and the other way round for
``StepOutput``); ``codec.py`` is the only place they meet protobuf. The types are frozen and
picklable: with tensor parallelism rank 0 broadcasts each ``StepPlan`` to the other ranks
as is. Neither torch nor the router or shard packages are imported here.

Defaults are the "nothing asked" values of the wire (greedy, no penalty, no details), and
``SamplingParams`` uses the shard's meaning of disabled: ``top_p``/``typical_p`` 1.0,
``repetition_penalty`` 1.0, ``top_k`` 0.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, replace
from enum import Enum
from typing import NamedTuple


class ModelKind(Enum):
    """What kind of model the shard serves (``shard.proto``'s ``ModelKind``)."""

    CAUSAL_LM = 0
    SEQ2SEQ_LM = 1


class AdapterKind(Enum):
    """What an adapter from the shard's adapter cache is (``shard.proto``'s ``AdapterKind``)."""

    LORA = 0
    PROMPT_TUNING = 1


@dataclass(frozen=True, slots=True)
class AdapterInfo:
    """The shard's answer to ``AdapterLookup``: the adapter's kind, for a prompt-tuning
    adapter its number of virtual tokens (0 for LoRA), and the version of its contents
    (a digest of the files read: it changes when the adapter is rewritten in its store)."""

    kind: AdapterKind
    prefix_length: int = 0
    version: str = ""

    @property
    def is_lora(self) -> bool:
        return self.kind is AdapterKind.LORA


@dataclass(frozen=True, slots=True)
class PrefixInfo:
    """The shard's answer to ``PrefixLookup``: a prompt-tuning prefix's virtual tokens and
    the version of its contents (a digest of the files read)."""

    length: int
    version: str = ""


@dataclass(frozen=True, slots=True)
class LengthPenalty:
    """Exponential boost of the EOS score once ``start_index`` tokens have been generated."""

    start_index: int
    decay_factor: float


SEED_BITS = 32
"""Width of a drawn seed: TGIS draws a u32, so the seed a client is told stays short."""


def random_seed() -> int:
    """A fresh random seed (the one rule for sequences that sample without a client seed)."""
    return secrets.randbits(SEED_BITS)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Per-sequence decoding parameters, the one sampling type of router and shard; the
    defaults mean greedy with no processing. The router builds them once, at its edge, from
    the client's request (TGIS's zero-means-unset rules applied there)."""

    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = disabled
    top_p: float = 1.0  # 1.0 = disabled
    typical_p: float = 1.0  # applies only strictly between 0 and 1 (typical_p_active)
    seed: int | None = None  # the router sets one for every sampled sequence
    repetition_penalty: float = 1.0  # 1.0 = no penalty
    min_new_tokens: int = 0  # EOS is masked (and stops ignored) until this many tokens
    length_penalty: LengthPenalty | None = None
    # Guided decoding: the llguidance grammar the output must match ("": unconstrained),
    # compiled by the router from the client's json_schema, regex, choice or grammar.
    grammar: str = ""
    # OpenAI's penalties over the generated ids (0 = none): presence once per token that
    # occurs, frequency per occurrence; its logit bias, (token id, value) pairs; vLLM's
    # min_p (0 = disabled). The gRPC API has none of them.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_p: float = 0.0

    @property
    def needs_history(self) -> bool:
        """Whether sampling reads the ids the sequence has seen (penalties)."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    @property
    def is_greedy(self) -> bool:
        """Whether the sequence takes the argmax instead of sampling."""
        return self.temperature == 0.0

    @property
    def typical_p_active(self) -> bool:
        """Whether typical-p filtering applies: for a mass strictly between 0 and 1 only;
        1.0 (the default) and anything outside that range mean disabled."""
        return 0.0 < self.typical_p < 1.0

    def seeded(self) -> SamplingParams:
        """These parameters with a :func:`random_seed` when they sample and have no seed
        (unchanged otherwise): every seedless sampling sequence gets its seed here."""
        if self.is_greedy or self.seed is not None:
            return self
        return replace(self, seed=random_seed())


@dataclass(frozen=True, slots=True)
class DetailOptions:
    """Which token details to compute for a sequence (``TokenDetailOptions``)."""

    logprobs: bool = False
    ranks: bool = False
    top_n: int = 0
    input_tokens: bool = False
    generated_tokens: bool = False


@dataclass(frozen=True, slots=True)
class NewSequence:
    """A sequence announced to the shard, with its whole prompt.

    With a prompt-tuning prefix (``prefix_id``) or a prompt-tuning adapter (``adapter_id``,
    ``prefix_id`` empty), the prompt is ``prefix_length`` virtual positions followed by
    ``prompt_token_ids``, and every count in a Step includes them. A LoRA adapter
    (``adapter_id``) adds no positions; it may come with a ``prefix_id``.
    """

    request_id: int
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams = SamplingParams()
    details: DetailOptions = DetailOptions()
    prefix_id: str = ""
    prefix_length: int = 0
    adapter_id: str = ""
    # The versions of the prefix's and the adapter's contents the router looked up ("": not
    # checked). The prefix cache keys blocks by them; contents now of another version fail
    # the sequence alone.
    prefix_version: str = ""
    adapter_version: str = ""

    @property
    def prompt_length(self) -> int:
        """Positions of the prompt: the prefix's virtual tokens and the input's."""
        return self.prefix_length + len(self.prompt_token_ids)


@dataclass(frozen=True, slots=True)
class ScheduledSequence:
    """One sequence's share of a step: how many tokens to compute, which blocks it gained,
    (a prefix-cache hit, only when it starts from position 0) how many leading positions
    those blocks already hold, and (speculative decoding) the tokens drafted after its last
    known one, which ``num_tokens`` counts too."""

    request_id: int
    num_tokens: int
    new_block_ids: tuple[int, ...] = ()
    cached_tokens: int = 0
    draft_token_ids: tuple[int, ...] = ()
    spec_tokens: int = 0
    """Drafts the shard's draft model proposes and verifies (``ShardInfo.draft_model``)."""
    state_slot: int | None = None
    """The sequence's recurrent-state slot (``ShardInfo.state_slots``; None: the model has
    none). A chunk from position 0 starts from a zero state, any other from the slot's."""


@dataclass(frozen=True, slots=True)
class StepPlan:
    """One forward pass, as a diff against the shard's state (``StepRequest``).

    ``base_step_id`` is the step this one was planned on top of (0: none, e.g. the first
    step after a Reset); the shard refuses a plan whose base is not the last step it
    completed, so a step planned before an earlier one failed never runs.
    """

    step_id: int = 0
    new_sequences: tuple[NewSequence, ...] = ()
    scheduled: tuple[ScheduledSequence, ...] = ()
    finished_request_ids: tuple[int, ...] = ()
    # Kept (tokens, counters, generator) but their blocks dropped: recomputed when resumed.
    preempted_request_ids: tuple[int, ...] = ()
    base_step_id: int = 0

    @property
    def has_message(self) -> bool:
        """Worth sending even without work: the shard must forget or preempt something."""
        return bool(self.scheduled or self.finished_request_ids or self.preempted_request_ids)


class TopToken(NamedTuple):
    """One of the most likely alternatives at a position."""

    token_id: int
    logprob: float


@dataclass(frozen=True, slots=True)
class TokenDetail:
    """A token and whichever details were asked for (0 / empty when not asked)."""

    token_id: int
    logprob: float = 0.0
    rank: int = 0
    top_tokens: tuple[TopToken, ...] = ()


@dataclass(frozen=True, slots=True)
class SampledToken:
    """The token sampled for one sequence in a step."""

    request_id: int
    token: TokenDetail


@dataclass(frozen=True, slots=True)
class InputTokenDetails:
    """Details of every prompt position of a sequence, sent once when its prompt completes."""

    request_id: int
    tokens: tuple[TokenDetail, ...]


@dataclass(frozen=True, slots=True)
class SequenceError:
    """A sequence that failed on its own; the shard has already forgotten it.
    ``constraint``: its guided-decoding grammar could not be followed."""

    request_id: int
    message: str
    constraint: bool = False


@dataclass(frozen=True, slots=True)
class StepOutput:
    """The result of one step (``StepResponse``)."""

    step_id: int
    tokens: tuple[SampledToken, ...] = ()
    input_tokens: tuple[InputTokenDetails, ...] = ()
    errors: tuple[SequenceError, ...] = ()
    forward_time_ns: int = 0


DEFAULT_MAX_BATCH_SIZE = 256
"""The running batch's ceiling when --max-batch-size is unset (vLLM's max_num_seqs; the KV
cache is the real limit): the router schedules no more, and a GPU shard's warm-up measures a
step this large."""


@dataclass(frozen=True, slots=True)
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
    step_channel: str = ""
    """Unix socket path of the step channel (set by the server that answers Info)."""
    adapters_enabled: bool = False
    """An adapter cache is configured (``AdapterLookup`` and ``NewSequence.adapter_id``)."""
    max_loras: int = 0
    """Most different LoRA adapters one step may contain (0: adapters disabled, or no LoRA)."""
    prefix_caching: bool = False
    # The engine verifies drafted tokens (``ScheduledSequence.draft_token_ids``).
    speculation: bool = False
    # A draft model drafts on the shard (``ScheduledSequence.spec_tokens``).
    draft_model: bool = False
    """The engine starts sequences after cached tokens (``ScheduledSequence.cached_tokens``);
    False for the transformers fallback and encoder-decoder engines."""
    state_slots: int = 0
    """Slots of per-sequence recurrent state (a hybrid model's Mamba layers; 0 for models
    without): every running sequence holds one (``ScheduledSequence.state_slot``)."""
    kv_window: int = 0
    """The largest sliding window over the model's layers, in tokens (0: some layer, or the
    draft model, reads every position): a query at ``p`` reads no key at or before
    ``p - kv_window``, so the router gives back the blocks behind that."""

    @property
    def is_seq2seq(self) -> bool:
        """An encoder-decoder model (it cannot recompute generated tokens)."""
        return self.model_kind is ModelKind.SEQ2SEQ_LM


class StepErrorCode(Enum):
    """Why a whole Step failed (the gRPC status the shard answers with)."""

    INVALID_PLAN = "invalid_plan"  # INVALID_ARGUMENT: the plan breaks the protocol
    OUT_OF_MEMORY = "out_of_memory"  # RESOURCE_EXHAUSTED: the device ran out of memory
    STALE_BASE = "stale_base"  # ABORTED: planned on top of a step that failed
    INTERNAL = "internal"  # INTERNAL: anything else
