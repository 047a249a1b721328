"""The router's tokenizer: a thin, torch-free wrapper around the Rust ``tokenizers`` library.

Used for validation (token counts with special tokens), the Tokenize RPC (spec §4.1), token
strings for token details (§1.7) and output decoding (§7.5). Encoding runs on a thread pool so
it never blocks the event loop; the Rust tokenizer releases the GIL while it works.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from os import PathLike
from typing import TypeVar

from tokenizers import Tokenizer

from tgis.router.core.detokenizer import REPLACEMENT_CHAR
from tgis.router.errors import TokenizationError

__all__ = ["REPLACEMENT_CHAR", "RouterTokenizer", "TokenizeResult"]


# Decoders that drop the leading space of the first token of a decode call: decoding a
# continuation needs a placeholder token in front (TGIS ``decoder.rs``); "None" (no decoder)
# joins tokens with spaces, for which the placeholder yields TGIS's leading " ".
_PLACEHOLDER_DECODERS = frozenset({"Metaspace", "WordPiece", "Sequence", None})

# How far back decode_output looks for the end of the last complete character (an incomplete
# UTF-8 character spans at most 3 ids).
_MAX_INCOMPLETE_IDS = 8

_T = TypeVar("_T")

INLINE_ENCODE_CHARS = 512
"""Inputs of at most this many characters in all are tokenized on the event loop (about
0.4 µs per character: ~0.2 ms at most). Handing them to the thread pool costs more than
that: the worker waits for the GIL (up to the 5 ms switch interval, twice per job) while
the loop is busy, and under load the single worker's queue grew to ~190 ms per request."""


@dataclass(frozen=True, slots=True)
class TokenizeResult:
    """One ``TokenizeResponse``: counts, raw vocabulary strings and UTF-8 byte offsets."""

    token_count: int
    tokens: tuple[str, ...] = ()
    offsets: tuple[tuple[int, int], ...] = ()


def _utf8_len(ch: str) -> int:
    cp = ord(ch)
    if cp < 0x80:
        return 1
    if cp < 0x800:
        return 2
    if cp < 0x10000:
        return 3
    return 4


def _char_to_byte_offsets(text: str, offsets: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """Convert the Python binding's character offsets back to the UTF-8 byte offsets that the
    Rust library (and so TGIS) reports. Exact because offsets always fall on character
    boundaries of the original text."""
    if text.isascii():
        return [(start, end) for start, end in offsets]
    byte_pos = list(itertools.accumulate(map(_utf8_len, text), initial=0))
    return [(byte_pos[start], byte_pos[end]) for start, end in offsets]


class RouterTokenizer:
    """Wraps a ``tokenizers.Tokenizer`` with truncation and padding disabled.

    Args:
        tokenizer: a loaded tokenizer (modified in place: truncation/padding are disabled) or
            the path of a ``tokenizer.json``.
        workers: size of the thread pool used by the ``*_async`` methods.
    """

    def __init__(self, tokenizer: Tokenizer | str | PathLike[str], *, workers: int = 1) -> None:
        if workers < 1:
            raise ValueError("tokenization_workers must be > 0")
        if not isinstance(tokenizer, Tokenizer):
            tokenizer = Tokenizer.from_file(str(tokenizer))
        truncation = tokenizer.truncation
        self.configured_max_length: int | None = (
            int(truncation["max_length"]) if truncation else None
        )
        """``max_length`` of the truncation settings found in tokenizer.json, if any (the caller
        may warn when it is below ``max_sequence_length``); truncation is disabled regardless."""
        tokenizer.no_truncation()
        tokenizer.no_padding()
        self._tok = tokenizer
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tokenizer")

        decoder = tokenizer.decoder
        self.decoder_type: str | None = None if decoder is None else type(decoder).__name__
        """Class name of the top-level decoder (``ByteLevel``, ``Sequence``, ``Metaspace``...)."""

        self.bos_token_id: int | None = self._detect_bos()
        """Id of the BOS token the post-processor adds in front of every input, else None."""

        placeholder = tokenizer.encode("A", add_special_tokens=False).ids
        self.placeholder_id: int | None = None
        """Token put in front of a continuation decode (see :meth:`decode_output`)."""
        self._placeholder_text: dict[bool, str] = {}
        if self.decoder_type in _PLACEHOLDER_DECODERS and placeholder:
            self.placeholder_id = placeholder[0]
            self._placeholder_text = {
                skip: self.decode([self.placeholder_id], skip) for skip in (False, True)
            }

    @classmethod
    def from_file(cls, path: str | PathLike[str], *, workers: int = 1) -> RouterTokenizer:
        """Load ``tokenizer.json``."""
        return cls(path, workers=workers)

    def _detect_bos(self) -> int | None:
        """The id the post-processor puts at position 0 (marked special), if any.

        Works for TemplateProcessing ("<s> $A", Llama), RobertaProcessing/BertProcessing
        (``<s>``/``[CLS]``) and returns None for GPT-2 style (no specials) and T5 (``</s>`` at the
        end only).
        """
        enc = self._tok.encode("A", add_special_tokens=True)
        if enc.ids and enc.special_tokens_mask and enc.special_tokens_mask[0] == 1:
            plain = self._tok.encode("A", add_special_tokens=False)
            if len(enc.ids) > len(plain.ids):
                return int(enc.ids[0])
        return None

    @property
    def tokenizer(self) -> Tokenizer:
        """The wrapped ``tokenizers.Tokenizer``."""
        return self._tok

    def to_json(self) -> str:
        """The tokenizer as tokenizer.json text (what llguidance reads its vocabulary from)."""
        return str(self._tok.to_str())

    @property
    def vocab_size(self) -> int:
        """Vocabulary size including added tokens."""
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    # ------------------------------------------------------------------ encoding

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` with special tokens (what validation counts)."""
        try:
            return list(self._tok.encode(text, add_special_tokens=True).ids)
        except Exception as err:  # the binding raises plain Exception
            raise TokenizationError(str(err)) from err

    def encode_batch(
        self, texts: Sequence[str], add_special_tokens: bool = True
    ) -> list[list[int]]:
        """:meth:`encode` for several texts (parallel inside the Rust library);
        ``add_special_tokens`` False for texts that hold them already (a chat template's)."""
        try:
            encodings = self._tok.encode_batch(list(texts), add_special_tokens=add_special_tokens)
        except Exception as err:
            raise TokenizationError(str(err)) from err
        return [list(e.ids) for e in encodings]

    def tokenize(
        self,
        texts: Sequence[str],
        return_tokens: bool = False,
        return_offsets: bool = False,
        truncate: int = 0,
    ) -> list[TokenizeResult]:
        """The Tokenize RPC (spec §4.1), one result per text in order.

        ``truncate`` (``truncate_input_tokens``, 0 = none) keeps the *last* ``truncate`` entries
        (no BOS substitution, unlike generation). ``tokens`` are raw vocabulary strings;
        ``offsets`` are UTF-8 *byte* offsets, ``(0, 0)`` for added special tokens.
        """
        try:
            encodings = self._tok.encode_batch(list(texts), add_special_tokens=True)
        except Exception as err:
            raise TokenizationError(str(err)) from err
        results = []
        for text, enc in zip(texts, encodings, strict=True):
            count = len(enc.ids)
            start = count - truncate if 0 < truncate < count else 0
            tokens: tuple[str, ...] = tuple(enc.tokens[start:]) if return_tokens else ()
            offsets: tuple[tuple[int, int], ...] = ()
            if return_offsets:
                offsets = tuple(_char_to_byte_offsets(text, enc.offsets[start:]))
            results.append(
                TokenizeResult(token_count=count - start, tokens=tokens, offsets=offsets)
            )
        return results

    # ------------------------------------------------------------------ async helpers

    async def _run(self, fn: functools.partial[_T]) -> _T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn)

    async def encode_async(self, text: str) -> list[int]:
        """:meth:`encode` on the tokenizer thread pool."""
        return await self._run(functools.partial(self.encode, text))

    async def encode_batch_async(
        self, texts: Sequence[str], add_special_tokens: bool = True
    ) -> list[list[int]]:
        """:meth:`encode_batch`: on the event loop for short inputs (``INLINE_ENCODE_CHARS``),
        else on the tokenizer thread pool."""
        if sum(len(t) for t in texts) <= INLINE_ENCODE_CHARS:
            return self.encode_batch(texts, add_special_tokens)
        return await self._run(functools.partial(self.encode_batch, texts, add_special_tokens))

    async def run_async(self, fn: Callable[[], _T]) -> _T:
        """``fn()`` on the tokenizer thread pool: tokenizer work too big for the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn)

    def close(self) -> None:
        """Shut the thread pool down (pending work is finished first)."""
        self._executor.shutdown(wait=True)

    # ------------------------------------------------------------------ ids -> text

    def id_to_token(self, token_id: int) -> str:
        """Raw vocabulary string of ``token_id`` (e.g. ``Ġfirst``, ``▁The``, ``<0x0A>``); ``""`` if
        unknown."""
        if token_id < 0:
            return ""
        token = self._tok.id_to_token(token_id)
        return "" if token is None else token

    def token_to_id(self, token: str) -> int | None:
        """Id of a vocabulary string, or None."""
        token_id = self._tok.token_to_id(token)
        return None if token_id is None else int(token_id)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Plain ``tokenizers`` decode (unknown ids are skipped)."""
        return str(self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens))

    @property
    def uses_placeholder(self) -> bool:
        """Whether continuation decodes put :attr:`placeholder_id` in front."""
        return self.placeholder_id is not None

    def decode_output(
        self,
        ids: Sequence[int],
        skip_special_tokens: bool = True,
        *,
        eos_token_ids: Collection[int] = (),
        continuation: bool = True,
    ) -> str:
        """Text of a whole generated sequence, as TGIS's ``Decoder::decode`` produces it.

        * a trailing EOS id (any of ``eos_token_ids``) is dropped;
        * for decoders that strip the leading space of a decode call (Metaspace, Sequence as in
          Llama-2, WordPiece, no decoder) and ``continuation`` true (causal models), the ids are
          decoded behind a placeholder token whose text is then removed, so the first word
          keeps its leading space (``" was so"``); pass ``continuation=False`` for the first
          decoder output of an encoder-decoder model;
        * an incomplete final UTF-8 character is dropped (trailing U+FFFD trimmed); complete
          characters before it in the same byte-fallback run are kept.

        This is the reference that :class:`~tgis.router.core.detokenizer.IncrementalDetokenizer`
        reproduces chunk by chunk.
        """
        seq = list(ids)
        if seq and seq[-1] in eos_token_ids:
            seq.pop()
        text = self.decode_window(seq, skip_special_tokens, continuation=continuation)
        if not text.endswith(REPLACEMENT_CHAR):
            return text
        # An incomplete final character. With byte fallback (Llama-2) the decoder turns the
        # *whole* run of byte tokens it belongs to into U+FFFD, wiping complete characters
        # before it (TGIS's unary text loses them while its stream shows them). Keep the text up
        # to the last id that ends cleanly, as the incremental detokenizer does.
        for end in range(len(seq) - 1, max(-1, len(seq) - 1 - _MAX_INCOMPLETE_IDS), -1):
            clean = self.decode_window(seq[:end], skip_special_tokens, continuation=continuation)
            if not clean.endswith(REPLACEMENT_CHAR):
                if text.startswith(clean):
                    return text.rstrip(REPLACEMENT_CHAR)
                return clean
        return text.rstrip(REPLACEMENT_CHAR)

    def decode_window(
        self, ids: Sequence[int], skip_special_tokens: bool, *, continuation: bool = True
    ) -> str:
        """Decode ``ids`` as a continuation (placeholder in front, its text removed) if the
        decoder needs it and ``continuation`` is true; a plain decode otherwise."""
        if continuation and self.placeholder_id is not None:
            with_ph = self.decode([self.placeholder_id, *ids], skip_special_tokens)
            ph_text = self._placeholder_text[skip_special_tokens]
            if with_ph.startswith(ph_text):
                return with_ph[len(ph_text) :]
        return self.decode(ids, skip_special_tokens)
