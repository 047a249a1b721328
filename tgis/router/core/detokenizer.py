"""Incremental detokenization of generated ids (spec §3.3, §7.5).

Prefix/read-offset technique: each push decodes a short window of ids twice -- the ids already
turned into text (``prefix``) and the same ids plus the new ones -- and appends the difference.
Text is deferred while the window's text ends in U+FFFD (an incomplete UTF-8 sequence, e.g. an
emoji split over byte tokens). Because the difference is taken between two decodes of the same
window, tokenizer-specific context effects (ByteLevel byte merging, Metaspace/Strip leading
space removal, suffix-style BPE spaces) cancel out; decoders that strip the first word's space
get a placeholder token in front (:meth:`RouterTokenizer.decode_window`), so Llama-2 style
output keeps it (``" was so"``).

Invariant: the concatenation of all :meth:`IncrementalDetokenizer.push` results and the final
:meth:`~IncrementalDetokenizer.flush` equals ``tokenizer.decode_output(ids)`` -- for ByteLevel
tokenizers that is ``tokenizer.decode(ids)`` with trailing U+FFFD trimmed. (The one exception:
byte-fallback runs that are invalid UTF-8 *before* their end, whose full decode changes text
that was already complete -- e.g. "é" followed by a lone lead byte turns into three U+FFFD.
No incremental decoder can reproduce that; the output then differs only in those replacement
characters.)
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Protocol

__all__ = ["IncrementalDetokenizer"]


REPLACEMENT_CHAR = "\ufffd"
"""What a decoder writes for bytes that do not (yet) form valid UTF-8."""


class TokenDecoder(Protocol):
    """What the detokenizer needs of a tokenizer (``intake/tokenization.py:
    RouterTokenizer`` in the server)."""

    @property
    def placeholder_id(self) -> int | None:
        """A token decoded in front of every window, or None when the tokenizer needs none."""
        ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Turns generated token ids into text chunks, one push per token.

    Args:
        tokenizer: the router tokenizer.
        skip_special_tokens: ``not --output-special-tokens``.
        hold_back_bytes: 0 emits text as soon as it is decodable. ``N > 0`` (streaming with stop
            sequences) keeps back the text added by the latest push plus the ``N`` bytes before
            it, so nothing a stop sequence found at this token could trim has been emitted (TGIS
            uses ``N = 1`` with ``include_stop_sequence`` and the longest stop sequence's byte
            length without). Holding back never changes the concatenated output.
        eos_token_ids: EOS ids; a trailing EOS never contributes text (TGIS drops it even when
            special tokens are output). An EOS followed by more tokens is decoded normally.
        continuation: False only for the first output of an encoder-decoder model, whose first
            word has no leading space.
    """

    __slots__ = (
        "_bytes_added",
        "_emitted_bytes",
        "_eos",
        "_flushed",
        "_held_eos",
        "_hold_back",
        "_lead",
        "_prefix_text",
        "_raw",
        "_read",
        "_skip",
        "_text",
        "_tok",
        "_window",
    )

    def __init__(
        self,
        tokenizer: TokenDecoder,
        skip_special_tokens: bool,
        hold_back_bytes: int = 0,
        *,
        eos_token_ids: Collection[int] = (),
        continuation: bool = True,
    ) -> None:
        if hold_back_bytes < 0:
            raise ValueError("hold_back_bytes must be >= 0")
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._hold_back = hold_back_bytes
        self._eos = frozenset(eos_token_ids)
        # Placeholder in front of every window decode (its text cancels out in the difference).
        ph = tokenizer.placeholder_id
        self._lead: list[int] = [ph] if continuation and ph is not None else []
        # Current decode window: ids from the previous read offset on; ids before _read are
        # already text (their decode is _prefix_text).
        self._window: list[int] = []
        self._read = 0
        self._prefix_text = self._decode([])
        self._held_eos: list[int] = []
        self._text = ""
        self._raw = bytearray()  # self._text as UTF-8
        self._emitted_bytes = 0
        self._bytes_added = 0
        self._flushed = False

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(self._lead + ids, self._skip)

    def _append(self, piece: str) -> None:
        raw = piece.encode("utf-8")
        self._text += piece
        self._raw += raw
        self._bytes_added = len(raw)

    # ------------------------------------------------------------------ public API

    @property
    def text(self) -> str:
        """All output text decoded so far (after :meth:`flush`: possibly truncated)."""
        return self._text

    @property
    def output_bytes(self) -> bytes:
        """:attr:`text` as UTF-8 (what stop sequences are matched against)."""
        return bytes(self._raw)

    @property
    def total_bytes(self) -> int:
        """UTF-8 length of :attr:`text`."""
        return len(self._raw)

    @property
    def bytes_added(self) -> int:
        """UTF-8 bytes the last :meth:`push` appended to :attr:`text` (0 while deferred)."""
        return self._bytes_added

    def push(self, token_id: int) -> str:
        """Add one generated id; return the text that became available (possibly ``""``)."""
        if self._flushed:
            raise RuntimeError("push() after flush()")
        self._bytes_added = 0
        if token_id in self._eos:
            self._held_eos.append(token_id)
            return self._release()
        if self._held_eos:
            self._window.extend(self._held_eos)
            self._held_eos.clear()
        self._window.append(token_id)
        new_text = self._decode(self._window)
        if len(new_text) > len(self._prefix_text) and not new_text.endswith(REPLACEMENT_CHAR):
            self._append(new_text[len(self._prefix_text) :])
            # The ids just read become the next window's prefix.
            del self._window[: self._read]
            self._read = len(self._window)
            self._prefix_text = self._decode(self._window)
        return self._release()

    def flush(self, max_total_bytes: int | None = None) -> str:
        """Finish: decode what is pending (trailing U+FFFD trimmed, trailing EOS dropped), cut
        :attr:`text` to ``max_total_bytes`` UTF-8 bytes if given (stop-sequence trimming; cut
        at a character boundary), and return everything not returned yet."""
        if not self._flushed:
            self._flushed = True
            self._held_eos.clear()
            self._bytes_added = 0
            if self._read < len(self._window):
                new_text = self._decode(self._window).rstrip(REPLACEMENT_CHAR)
                if len(new_text) > len(self._prefix_text):
                    self._append(new_text[len(self._prefix_text) :])
        if max_total_bytes is not None and max_total_bytes < len(self._raw):
            self._truncate(max(0, max_total_bytes))
        return self._take(len(self._raw))

    # ------------------------------------------------------------------ internals

    def _char_boundary(self, pos: int) -> int:
        """``pos`` moved back to the start of the UTF-8 character it falls in."""
        raw = self._raw
        while 0 < pos < len(raw) and (raw[pos] & 0xC0) == 0x80:
            pos -= 1
        return pos

    def _truncate(self, max_bytes: int) -> None:
        cut = self._char_boundary(max_bytes)
        del self._raw[cut:]
        self._text = self._raw.decode("utf-8")
        if self._emitted_bytes > cut:  # already sent; can't take it back
            self._emitted_bytes = cut

    def _release(self) -> str:
        limit = len(self._raw)
        if self._hold_back > 0:
            limit -= self._bytes_added + self._hold_back
        return self._take(limit)

    def _take(self, limit: int) -> str:
        """Emit pending text up to byte ``limit`` of :attr:`text` (rounded down to a character
        boundary)."""
        cut = self._char_boundary(min(limit, len(self._raw)))
        if cut <= self._emitted_bytes:
            return ""
        out = self._raw[self._emitted_bytes : cut].decode("utf-8")
        self._emitted_bytes = cut
        return out
