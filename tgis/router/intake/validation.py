"""Parameter conversion and request validation (spec §1.3, §1.4 "Seeds", §1.6, §2).

Two steps on plain types, called at admission after ``edge/fmaas.py: convert_params`` (proto
``Parameters`` -> :class:`GenerationParams`, TGIS's "zero means default" rules):

1. :func:`validate_params` -- the request-wide rules 1-11 of §2, first failure wins.
2. :func:`validate_input` -- per input (after tokenization): truncation, rules 14/15 (with
   the prompt prefix's length), seed assignment and the TOKEN_LIMIT reduction of
   ``max_new_tokens``.

Rules 12 (prompt-prefix lookup, ``prefixes.py``) and 13 (tokenizer failure) sit between the
two steps and belong to the caller; :func:`prefix_lookup_error` and
:func:`tokenizer_validation_error` build their messages. So do the adapter rules of
vllm-tgis-adapter (``adapter_id``, ``adapters.py``), checked before rule 12, in this order:

12a. ``adapter_id`` (non-empty) without an adapter cache on the shard:
     :data:`ADAPTERS_DISABLED_MESSAGE`.
12b. an id that does not fully match ``[/\\w\\-]+``, starts with ``/`` or has a ``..``
     component: :func:`check_adapter_id`, before any RPC.
12c. the shard's ``AdapterLookup`` refused it: its message verbatim
     (:func:`adapter_lookup_error` when the call itself failed); a LoRA adapter on a shard
     that allows none: :func:`unsupported_adapter_error`.
12d. a prompt-tuning adapter with a ``prefix_id``: :data:`PREFIX_WITH_PROMPT_TUNING_MESSAGE`
     (a LoRA adapter and a prefix go together).
"""

from __future__ import annotations

import math
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass, replace

from tgis.router.errors import ValidationError
from tgis.router.request_types import (
    NO_ADAPTERS,
    GenerationParams,
    ResolvedAdapters,
    ResponseOptions,
    SamplingParams,
    StoppingParams,
    ValidatedRequest,
)
from tgis.settings.batching import MAX_BEST_OF, MAX_STOP_SEQUENCES

__all__ = [
    "ADAPTERS_DISABLED_MESSAGE",
    "DEFAULT_MAX_NEW_TOKENS",
    "MAX_STOP_SEQUENCES",
    "MAX_STOP_SEQUENCE_BYTES",
    "PREFIX_WITH_PROMPT_TUNING_MESSAGE",
    "ServerLimits",
    "adapter_lookup_error",
    "check_adapter_id",
    "prefix_lookup_error",
    "tokenizer_validation_error",
    "undecodable_request_error",
    "unsupported_adapter_error",
    "validate_input",
    "validate_inputs",
    "validate_params",
]

DEFAULT_MAX_NEW_TOKENS = 20
MAX_STOP_SEQUENCE_BYTES = 240


def _f32(value: float) -> float:
    """``value`` rounded to the nearest float32 (TGIS compares proto floats as f32)."""
    result: float = struct.unpack("<f", struct.pack("<f", value))[0]
    return result


# Proto floats arrive as the exact float32 value; comparing them with the float32 constant
# reproduces the Rust f32 comparisons bit for bit (0.05 is not exact in binary).
_MIN_TEMPERATURE = _f32(0.05)
_MIN_DECAY_FACTOR = 1.0
_MAX_DECAY_FACTOR = 10.0
_I32_MAX = (1 << 31) - 1


@dataclass(frozen=True, slots=True)
class ServerLimits:
    """Server-wide limits validation checks against.

    ``max_new_tokens`` is the *effective* limit, i.e. already lowered to
    ``max_sequence_length - 1`` where needed (use :meth:`from_args`).
    """

    max_sequence_length: int
    max_new_tokens: int
    max_stop_sequences: int = MAX_STOP_SEQUENCES
    max_stop_sequence_bytes: int = MAX_STOP_SEQUENCE_BYTES
    max_input_tokens: int | None = None
    """``--max-input-tokens``: longer inputs (after truncation) are refused; None: no limit."""
    max_client_batch_size: int | None = None
    """``--max-client-batch-size``: most inputs per Generate (``limits.py``); None: no limit."""
    max_top_n_tokens: int | None = None
    """``--max-top-n-tokens``: the largest ``top_n_tokens``; None: no limit (TGIS)."""
    max_best_of: int = MAX_BEST_OF
    """``--max-best-of``: the largest ``best_of``; one sequence is generated per choice, so
    a ``best_of`` above 1 is refused whatever it says."""

    @classmethod
    def from_args(
        cls,
        max_sequence_length: int,
        max_new_tokens: int,
        *,
        max_input_tokens: int | None = None,
        max_client_batch_size: int | None = None,
        max_stop_sequences: int = MAX_STOP_SEQUENCES,
        max_top_n_tokens: int | None = None,
        max_best_of: int = MAX_BEST_OF,
    ) -> ServerLimits:
        """Limits from the router flags; ``max_new_tokens`` is capped at ``max_sequence_length - 1``
        (TGIS logs ``adjusting max_new_tokens (..) down to max_sequence_length - 1 (..)``)."""
        return cls(
            max_sequence_length=max_sequence_length,
            max_new_tokens=min(max_new_tokens, max_sequence_length - 1),
            max_stop_sequences=max_stop_sequences,
            max_input_tokens=max_input_tokens,
            max_client_batch_size=max_client_batch_size,
            max_top_n_tokens=max_top_n_tokens,
            max_best_of=max_best_of,
        )


def _stop_sequences_message(limits: ServerLimits) -> str:
    return (
        f"can specify at most {limits.max_stop_sequences} non-empty stop sequences, "
        f"each not more than {limits.max_stop_sequence_bytes} UTF8 bytes"
    )


def _decay_factor_ok(decay_factor: float) -> bool:
    """In [1.0, 10.0] (NaN is not)."""
    return _MIN_DECAY_FACTOR <= decay_factor <= _MAX_DECAY_FACTOR


def _require_finite(name: str, value: float) -> None:
    if not math.isfinite(value):
        raise ValidationError(f"{name} must be a finite number")


def validate_params(params: GenerationParams, limits: ServerLimits) -> None:
    """Check the request-wide rules 1-11 of spec §2 in order; raise the first failure.

    NaN and infinities pass TGIS's comparisons and fail later, inside a step: here every
    float parameter must be finite, checked where its rule is.

    Raises:
        ValidationError: with the verbatim TGIS message.
    """
    _check_warpers(params.sampling)  # 1-4
    _check_token_counts(params.stopping, params.sampling, limits)  # 5-6
    _check_penalties(params.sampling)  # 7-8
    _check_stops_and_details(params.stopping, params.response, limits)  # 9-11


def _check_warpers(s: SamplingParams) -> None:
    # 1
    _require_finite("temperature", s.temperature)
    # compared as float32, as the gRPC field carries it: an OpenAI body's 0.05 passes too
    if s.temperature != 0.0 and _f32(s.temperature) < _MIN_TEMPERATURE:
        raise ValidationError("temperature must be >= 0.05")
    # 2
    _require_finite("top_p", s.top_p)
    if s.top_p <= 0.0 or s.top_p > 1.0:
        raise ValidationError("top_p must be > 0.0 and <= 1.0")
    # 3
    _require_finite("typical_p", s.typical_p)
    if s.typical_p > 1.0:
        raise ValidationError("typical_p must be <= 1.0")
    # 4 (only reachable through the u32 -> i32 overflow; the message is TGIS's)
    if s.top_k < 0:
        raise ValidationError("top_k must be strictly positive")


def _check_token_counts(st: StoppingParams, s: SamplingParams, limits: ServerLimits) -> None:
    # 5
    if st.max_new_tokens > limits.max_new_tokens:
        raise ValidationError(f"max_new_tokens must be <= {limits.max_new_tokens}")
    # 6
    if st.min_new_tokens > st.max_new_tokens:
        raise ValidationError("min_new_tokens must be <= max_new_tokens")


def _check_penalties(s: SamplingParams) -> None:
    # 7
    _require_finite("repetition_penalty", s.repetition_penalty)
    if s.repetition_penalty <= 0.0:
        raise ValidationError("repetition_penalty must be > 0.0")
    # 8
    if s.length_penalty is not None and not _decay_factor_ok(s.length_penalty.decay_factor):
        raise ValidationError("length_penalty must be >= 1.0 and <= 10.0")


def _check_stops_and_details(st: StoppingParams, r: ResponseOptions, limits: ServerLimits) -> None:
    # 9
    if len(st.stop_sequences) > limits.max_stop_sequences:
        raise ValidationError(_stop_sequences_message(limits))
    # 10
    if (r.token_logprobs or r.token_ranks or r.top_n_tokens != 0) and not (
        r.input_tokens or r.generated_tokens
    ):
        raise ValidationError(
            "must request input and/or generated tokens to request extra token detail"
        )
    # 11
    if any(
        not ss or len(ss.encode("utf-8")) > limits.max_stop_sequence_bytes
        for ss in st.stop_sequences
    ):
        raise ValidationError(_stop_sequences_message(limits))
    # 11b (not in TGIS, which forwards any top_n_tokens): --max-top-n-tokens, when set
    if limits.max_top_n_tokens is not None and r.top_n_tokens > limits.max_top_n_tokens:
        raise ValidationError(
            f"top_n_tokens ({r.top_n_tokens}) must be <= {limits.max_top_n_tokens}"
        )


def prefix_lookup_error(prefix_id: str, message: str) -> ValidationError:
    """Rule 12: a failed prompt-prefix lookup (``message`` is the shard's error text)."""
    return ValidationError(f"can't retrieve prompt prefix with id '{prefix_id}': {message}")


ADAPTERS_DISABLED_MESSAGE = "adapter_id supplied but no adapter store was configured"
"""Rule 12a: an ``adapter_id`` for a shard without an adapter cache."""
PREFIX_WITH_PROMPT_TUNING_MESSAGE = "prefix_id and a prompt-tuning adapter_id cannot be combined"
"""Rule 12d: both supply virtual tokens; only a LoRA adapter goes with a ``prefix_id``."""
_ADAPTER_ID = re.compile(r"[/\w\-]+")


def check_adapter_id(adapter_id: str) -> None:
    """Rule 12b: an adapter id is a relative path inside the adapter cache made of word
    characters, ``-`` and ``/`` (vllm-tgis-adapter's ``[/\\w\\-]+``, Unicode ``\\w``), neither
    absolute nor with a ``..`` component. The shard checks it again (symbolic links
    included).

    Raises:
        ValidationError: ``Invalid adapter id '<id>', must contain only alphanumeric, _
            and - and /``.
    """
    if (
        _ADAPTER_ID.fullmatch(adapter_id) is None
        or adapter_id.startswith("/")
        or ".." in adapter_id.split("/")
    ):
        raise ValidationError(
            f"Invalid adapter id '{adapter_id}', must contain only alphanumeric, _ and - and /"
        )


def adapter_lookup_error(adapter_id: str, detail: str) -> ValidationError:
    """Rule 12c when the shard could not answer at all (connection, internal error); its
    refusals are sent to the client verbatim instead."""
    return ValidationError(f"can't retrieve adapter with id '{adapter_id}': {detail}")


def unsupported_adapter_error(adapter_type: str) -> ValidationError:
    """Rule 12c for an adapter type the server cannot apply (the shard's message)."""
    return ValidationError(f"adapter type {adapter_type} is not currently supported")


def tokenizer_validation_error(error: object) -> ValidationError:
    """Rule 13: the router tokenizer failed on an input."""
    return ValidationError(f"tokenizer error {error}")


_DECODE_ERROR_PREFIX = "Error parsing message with type "


def undecodable_request_error(message_type: str, error: object) -> ValidationError:
    """A request whose bytes are not a valid ``message_type`` (rule 0, before everything
    else; not in TGIS, whose tonic server answers ``INTERNAL``): a string field that is not
    valid UTF-8 (proto3 requires it), a truncated or corrupt message.

    ``error`` is protobuf's ``DecodeError``; its ``Error parsing message with type '..': ``
    prefix is replaced by the message's own, e.g. ``request is not a valid
    fmaas.BatchedGenerationRequest message: String field had bad UTF-8``.
    """
    detail = str(error)
    if detail.startswith(_DECODE_ERROR_PREFIX) and ": " in detail:
        detail = detail.split(": ", 1)[1]
    return ValidationError(f"request is not a valid {message_type} message: {detail}")


def validate_input(
    text: str,
    input_ids_full: Sequence[int],
    params: GenerationParams,
    limits: ServerLimits,
    *,
    adapters: ResolvedAdapters = NO_ADAPTERS,
    bos_token_id: int | None = None,
) -> ValidatedRequest:
    """Validate one tokenized input (rules 14, 14b and 15) and build its :class:`ValidatedRequest`.

    Args:
        text: the original input text (echoed untruncated when ``input_text`` is requested).
        input_ids_full: the router's encoding of ``text`` with special tokens.
        params: converted and already :func:`validate_params`-checked parameters.
        limits: server limits.
        adapters: the request's prompt prefix and adapter, kept on the result; their virtual
            tokens (``prefix_length``) count towards the limits and the TOKEN_LIMIT
            reduction but not ``input_length``.
        bos_token_id: the BOS id if the tokenizer adds one; truncation then overwrites the
            first kept token with it, as TGIS's shards do for ``add_bos_token`` tokenizers.

    Truncation (``truncate_input_tokens`` = T, applied only when ``0 < T < len``) keeps the last
    T tokens. If ``input + prefix + max_new_tokens`` exceeds ``max_sequence_length``,
    ``max_new_tokens`` is lowered to fit and ``truncated_to_fit`` is set (-> TOKEN_LIMIT). A
    sampling request without a client seed gets its own random 32-bit seed; a client seed is
    kept as is (and so shared by all inputs of a batch).

    Raises:
        ValidationError: rule 14 or 15 with the verbatim TGIS message, or rule 14b
            (``max_input_tokens``).
    """
    ids = _truncated(input_ids_full, params.truncate_input_tokens, bos_token_id)
    _check_length(len(ids), adapters.prefix_length, params.stopping, limits)
    stopping = params.stopping
    effective_length = len(ids) + adapters.prefix_length
    max_len = limits.max_sequence_length
    if effective_length + stopping.max_new_tokens > max_len:
        stopping = replace(
            stopping, max_new_tokens=max_len - effective_length, truncated_to_fit=True
        )
    return ValidatedRequest(
        text=text,
        input_ids=tuple(ids),
        params=params,
        stopping=stopping,
        sampling=params.sampling.seeded(),
        prefix_id=adapters.prefix_id,
        prefix_length=adapters.prefix_length,
        adapter_id=adapters.adapter_id,
        adapter_kind=adapters.adapter_kind,
        prefix_version=adapters.prefix_version,
        adapter_version=adapters.adapter_version,
    )


def _truncated(ids: Sequence[int], truncate: int, bos_token_id: int | None) -> list[int]:
    """The last ``truncate`` ids when ``0 < truncate < len(ids)`` (the first kept one
    replaced by BOS when the tokenizer adds one), else all of them."""
    kept = list(ids)
    if 0 < truncate < len(kept):
        kept = kept[-truncate:]
        if bos_token_id is not None:
            kept[0] = bos_token_id
    return kept


def _check_length(
    input_length: int, prefix_length: int, stopping: StoppingParams, limits: ServerLimits
) -> None:
    """Rules 14, 14b and 15."""
    effective_length = input_length + prefix_length
    max_len = limits.max_sequence_length
    # 14: the input alone may not fill the whole sequence.
    if effective_length >= max_len:
        raise ValidationError(
            f"input tokens ({input_length}) plus prefix length ({prefix_length}) "
            f"must be < {max_len}"
        )
    # 14b (not in TGIS, only with --max-input-tokens): the same rule with a lower limit.
    if limits.max_input_tokens is not None and effective_length > limits.max_input_tokens:
        raise ValidationError(
            f"input tokens ({input_length}) plus prefix length ({prefix_length}) "
            f"must be <= {limits.max_input_tokens} (max_input_tokens)"
        )
    # 15
    if effective_length + stopping.min_new_tokens > max_len:
        raise ValidationError(
            f"input tokens ({input_length}) plus prefix length ({prefix_length}) "
            f"plus min_new_tokens ({stopping.min_new_tokens}) must be <= {max_len}"
        )


def validate_inputs(
    texts: Sequence[str],
    encodings: Sequence[Sequence[int]],
    params: GenerationParams,
    limits: ServerLimits,
    *,
    adapters: ResolvedAdapters = NO_ADAPTERS,
    bos_token_id: int | None = None,
) -> list[ValidatedRequest]:
    """:func:`validate_input` for every input of a batch, in order (all share the prompt
    prefix and the adapter); the first failure wins."""
    if len(texts) != len(encodings):
        raise ValueError("texts and encodings differ in length")
    return [
        validate_input(text, ids, params, limits, adapters=adapters, bos_token_id=bos_token_id)
        for text, ids in zip(texts, encodings, strict=True)
    ]
