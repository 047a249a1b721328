"""Guided decoding on the shard: a matcher per constrained sequence, and each step's masks.

The router compiled and checked every grammar (``router/intake/guided.py``); a sequence's
``SamplingParams.grammar`` is that llguidance grammar. :class:`Grammars` owns what the
matchers share: the model's vocabulary as llguidance sees it (from tokenizer.json, built on
first use), a cache of compiled matchers by grammar text (a new sequence gets a copy), and
one worker thread. Work goes to that thread in order, so a sequence's matcher is compiled
before its first mask is filled, and neither runs on the step's thread:

* ``guide(grammar)`` (the step that announces the sequence) queues the compilation and
  returns the sequence's :class:`Guide` at once;
* ``start_masks(guides)`` (before the forward pass) queues the step's mask filling; the
  forward runs meanwhile, and the sampler waits for the :class:`TokenMasks` only after it;
* ``Guide.consume(token)`` (when the step commits) advances the matcher.

A step's masks: for each constrained row, the tokens the grammar allows next (EOS only where
the grammar may end), as a boolean [rows, vocab] tensor; whether EOS is all it allows (then
EOS wins over min_new_tokens, which would otherwise leave no token); and the rows whose
matcher failed, which fail alone. Unconstrained rows are untouched.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from tgis.grammar_engine import grammar_tokenizer, parser_limits, short_error

if TYPE_CHECKING:
    import llguidance

__all__ = ["CACHE_CAPACITY", "NO_GRAMMARS", "Grammars", "Guide", "GuidedUnavailable", "TokenMasks"]

CACHE_CAPACITY = 64
"""Compiled matchers kept, by grammar text (least recently used dropped first)."""


class GuidedUnavailable(Exception):
    """A sequence's grammar cannot be used here (its sequence fails alone)."""


class Guide:
    """One constrained sequence's matcher (compiled on the worker; ``matcher`` waits)."""

    def __init__(self, matcher: Future[llguidance.LLMatcher]) -> None:
        self._matcher = matcher

    def matcher(self) -> llguidance.LLMatcher:
        """The matcher, once compiled; GuidedUnavailable if compiling failed."""
        return self._matcher.result()

    def consume(self, token_id: int) -> None:
        """Advance past a committed token (a refused one leaves the matcher in its error
        state, which fails the sequence at its next mask)."""
        self.matcher().consume_token(token_id)


@dataclass(frozen=True)
class TokenMasks:
    """What the grammars allow at one step, for the rows that have one."""

    rows: torch.Tensor  # [G] int64: the constrained rows of the step's sampling batch
    allowed: torch.Tensor  # [G, vocab] bool
    eos_only: tuple[bool, ...]  # per row of the batch: the grammar allows EOS and nothing else
    errors: dict[int, str]  # row -> why its matcher cannot go on

    def apply_(self, scores: torch.Tensor) -> None:
        """Set every token the grammars forbid to ``-inf`` in ``scores`` [rows, vocab], in
        place (the sampler's own copy of the logits)."""
        scores[self.rows] = scores[self.rows].masked_fill(~self.allowed, float("-inf"))


class PendingMasks:
    """A step's masks being filled on the worker."""

    def __init__(self, future: Future[TokenMasks], device: torch.device) -> None:
        self._future = future
        self._device = device

    def result(self) -> TokenMasks:
        masks = self._future.result()
        if self._device.type == "cpu":
            return masks
        return TokenMasks(
            rows=masks.rows.to(self._device, non_blocking=True),
            allowed=masks.allowed.pin_memory().to(self._device, non_blocking=True),
            eos_only=masks.eos_only,
            errors=masks.errors,
        )


def _model_tokenizer_json(model_dir: str) -> str:
    """The model's tokenizer.json text, or one transformers converts (slow tokenizers)."""
    from pathlib import Path

    path = Path(model_dir) / "tokenizer.json"
    if path.is_file():
        return path.read_text(encoding="utf-8")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir, use_fast=True)
    if not tokenizer.is_fast:
        raise GuidedUnavailable("guided decoding needs a fast tokenizer (tokenizer.json)")
    return str(tokenizer.backend_tokenizer.to_str())


class Grammars:
    """The shard's matchers: compiled from grammar text (cached), masks filled per step,
    all on one worker thread."""

    def __init__(
        self,
        tokenizer_json: Callable[[], str],
        vocab_size: int,
        eos_token_ids: Sequence[int],
        *,
        capacity: int = CACHE_CAPACITY,
    ) -> None:
        """``tokenizer_json``: gives the tokenizer.json text when first needed."""
        self._tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size
        self._eos = [t for t in eos_token_ids if 0 <= t < vocab_size]
        self._capacity = capacity
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._worker: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    @classmethod
    def for_model(cls, model_dir: str, vocab_size: int, eos_token_ids: Sequence[int]) -> Grammars:
        return cls(lambda: _model_tokenizer_json(model_dir), vocab_size, eos_token_ids)

    def _submit(self, fn: Callable[..., object], *args: object) -> Future:
        with self._lock:
            if self._worker is None:
                self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="guided")
            return self._worker.submit(fn, *args)

    def guide(self, grammar: str) -> Guide:
        """A new sequence's guide; its matcher compiles on the worker."""
        return Guide(self._submit(self._new_matcher, grammar))

    def _new_matcher(self, grammar: str) -> llguidance.LLMatcher:
        import llguidance

        template = self._compiled.get(grammar)
        if template is None:
            if self._tokenizer is None:
                self._tokenizer = grammar_tokenizer(
                    self._tokenizer_json(), self.vocab_size, self._eos
                )
            template = llguidance.LLMatcher(
                self._tokenizer, grammar, limits=parser_limits(), log_level=0
            )
            if template.is_error():
                raise GuidedUnavailable(f"guided decoding: {short_error(template.get_error())}")
            self._compiled[grammar] = template
            if len(self._compiled) > self._capacity:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(grammar)
        return template.deep_copy()

    def start_masks(self, guides: Sequence[Guide | None], device: torch.device) -> PendingMasks:
        """Queue the filling of this step's masks (``guides``: one per sampling row, None
        for unconstrained rows; at least one is not None)."""
        return PendingMasks(self._submit(self._fill, list(guides)), device)

    def _fill(self, guides: list[Guide | None]) -> TokenMasks:
        import llguidance.numpy as llg_numpy

        rows = [i for i, g in enumerate(guides) if g is not None]
        bitmask = llg_numpy.allocate_token_bitmask(len(rows), self.vocab_size)
        errors: dict[int, str] = {}
        for slot, row in enumerate(rows):
            guide = guides[row]
            assert guide is not None
            try:
                matcher = guide.matcher()
            except GuidedUnavailable as err:
                errors[row] = str(err)
                continue
            llg_numpy.fill_next_token_bitmask(matcher, bitmask, slot)
            if matcher.is_error():
                errors[row] = f"guided decoding: {short_error(matcher.get_error())}"
        allowed = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")
        allowed = allowed[:, : self.vocab_size].astype(bool)
        eos_only = [False] * len(guides)
        for slot, row in enumerate(rows):
            count = int(np.count_nonzero(allowed[slot]))
            if count == 0 and row not in errors:
                errors[row] = "guided decoding: the grammar allows no token here"
            elif self._eos and count == int(np.count_nonzero(allowed[slot, self._eos])):
                eos_only[row] = True
        return TokenMasks(
            rows=torch.tensor(rows, dtype=torch.long),
            allowed=torch.from_numpy(allowed),
            eos_only=tuple(eos_only),
            errors=errors,
        )


class _NoGrammars(Grammars):
    """An engine without guided decoding: every constrained sequence fails alone."""

    def __init__(self) -> None:
        super().__init__(lambda: "", 0, ())

    def guide(self, grammar: str) -> Guide:
        raise GuidedUnavailable("guided decoding is not available on this shard")


NO_GRAMMARS: Grammars = _NoGrammars()
