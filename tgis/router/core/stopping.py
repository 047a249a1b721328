"""Per-token stopping decision (spec §1.5, TGIS ``batcher.rs::check_stopping_criteria``).

After every generated token the engine calls :meth:`StopChecker.check`, which applies, in this
precedence: TIME_LIMIT, the min_new_tokens gate, EOS_TOKEN, MAX_TOKENS / TOKEN_LIMIT,
STOP_SEQUENCE. Stop sequences are matched on the UTF-8 bytes of the generated text only, in
windows that overlap the bytes the last token added; the rightmost occurrence counts and the
first stop sequence in request order that matches wins.

Unlike TGIS, EOS is a *set* of ids (Llama-3 style configs list several; TGIS weak point 16).

A guided request ends at EOS even before ``min_new_tokens``: the shard masks EOS out until
then unless the grammar allows nothing else (its output is complete), so an EOS in that
phase means the constraint is fulfilled, and padding the output with more EOS tokens would
only inflate the counts.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from tgis.router.request_types import StoppingParams, StopReason

__all__ = [
    "StopChecker",
    "StopDecision",
    "find_stop_sequence",
    "stream_hold_back_bytes",
]


@dataclass(frozen=True, slots=True)
class StopDecision:
    """Why a request finished (:meth:`StopChecker.check` returns None while it has not).

    ``truncate_at_bytes`` is set only for STOP_SEQUENCE: the UTF-8 length the output text must
    be cut to (``IncrementalDetokenizer.flush(truncate_at_bytes)``).
    """

    reason: StopReason
    stop_sequence: str | None = None
    truncate_at_bytes: int | None = None


_TIME_LIMIT = StopDecision(StopReason.TIME_LIMIT)
_EOS = StopDecision(StopReason.EOS_TOKEN)
_MAX_TOKENS = StopDecision(StopReason.MAX_TOKENS)
_TOKEN_LIMIT = StopDecision(StopReason.TOKEN_LIMIT)


def find_stop_sequence(
    stop_sequences: Sequence[bytes], output: bytes | bytearray, bytes_added: int
) -> tuple[int, int] | None:
    """Match stop sequences against the end of the output (TGIS ``matches_stop_sequence``).

    Args:
        stop_sequences: UTF-8 encoded stop sequences in request order.
        output: the whole generated text so far, UTF-8.
        bytes_added: bytes the latest token appended to ``output``.

    Returns:
        ``(index into stop_sequences, byte offset of the match in output)`` for the first stop
        sequence that occurs in a window overlapping the new bytes (its rightmost such
        occurrence), or None.
    """
    if bytes_added <= 0:
        return None
    next_off = len(output) + 1 - bytes_added
    for index, ss in enumerate(stop_sequences):
        pos = output.rfind(ss, max(0, next_off - len(ss)))
        if pos >= 0:
            return index, pos
    return None


def stream_hold_back_bytes(stopping: StoppingParams) -> int:
    """TGIS's detokenizer hold-back for a *streaming* request with stop sequences: 1 with
    ``include_stop_sequence``, else the longest stop sequence's UTF-8 length; 0 without stop
    sequences (unary requests also use 0: their text is taken after the final flush)."""
    if not stopping.stop_sequences:
        return 0
    if stopping.include_stop_sequence:
        return 1
    return max(len(ss.encode("utf-8")) for ss in stopping.stop_sequences)


class StopChecker:
    """Stopping rules of one request.

    Args:
        stopping: the request's (per-input) stopping parameters.
        eos_token_ids: the model's EOS ids.
        constrained: the request is guided (an EOS ends it whatever min_new_tokens says).
    """

    __slots__ = ("_constrained", "_encoded", "_eos", "_stop_ids", "_stopping")

    def __init__(
        self,
        stopping: StoppingParams,
        eos_token_ids: Collection[int],
        *,
        constrained: bool = False,
    ) -> None:
        self._stopping = stopping
        self._eos = frozenset(eos_token_ids)
        self._stop_ids = frozenset(stopping.stop_token_ids)
        self._constrained = constrained
        self._encoded = tuple(ss.encode("utf-8") for ss in stopping.stop_sequences)

    @property
    def needs_text(self) -> bool:
        """Whether :meth:`check` needs the output text (the request has stop sequences)."""
        return bool(self._encoded)

    def check(
        self,
        token_id: int,
        generated_count: int,
        output_bytes: bytes | bytearray = b"",
        bytes_added: int = 0,
        *,
        now: float | None = None,
    ) -> StopDecision | None:
        """Decide after a token was generated; None means "not finished".

        Args:
            token_id: the token just generated.
            generated_count: tokens generated so far, this one included.
            output_bytes: the generated text so far as UTF-8, after this token was pushed to the
                detokenizer (``IncrementalDetokenizer.output_bytes``); only read when the
                request has stop sequences.
            bytes_added: bytes this token appended (``IncrementalDetokenizer.bytes_added``).
            now: ``time.monotonic()`` (taken if omitted).
        """
        st = self._stopping
        if st.deadline is not None:
            if now is None:
                now = time.monotonic()
            if now > st.deadline:
                return _TIME_LIMIT
        if generated_count < st.min_new_tokens and not (
            self._constrained and token_id in self._eos
        ):
            # Stop sequences are not searched in this phase (their bytes are never "new" again).
            return None
        if token_id in self._eos or token_id in self._stop_ids:
            return _EOS
        if generated_count >= st.max_new_tokens:
            return _TOKEN_LIMIT if st.truncated_to_fit else _MAX_TOKENS
        if self._encoded and bytes_added > 0:
            match = find_stop_sequence(self._encoded, output_bytes, bytes_added)
            if match is not None:
                index, offset = match
                end = offset + len(self._encoded[index]) if st.include_stop_sequence else offset
                return StopDecision(StopReason.STOP_SEQUENCE, st.stop_sequences[index], end)
        return None
