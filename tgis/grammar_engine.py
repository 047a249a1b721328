"""The grammar engine (llguidance), set up alike in the router and the shard.

The router checks a constraint at admission with the same tokenizer view and the same
parser limits the shard's matchers use at each step, so that what admission accepts is what
generation can follow. Three things differ from llguidance's defaults:

* **Special-token text is plain text.** llguidance's tokenizer (built from tokenizer.json)
  tokenizes text with the model's tokenizer, which turns the text ``<s>`` or ``</s>`` into
  the special token of that name. When a grammar forces such text (a regex ``x</s>y``, a
  choice ``"<s>"``), llguidance forces the special token, whose bytes the grammar does not
  accept: the request failed at the next token, or ended early on a forced EOS with the
  constraint broken. :func:`grammar_tokenizer` keeps llguidance's own token bytes and
  tokenization, except that a special token found in text is spelled out again in ordinary
  tokens (llguidance's greedy tokenization of its text), so grammars get text where they
  ask for text; special tokens themselves stay reachable by name (``<|im_end|>`` in Lark).
* **Wider parser rows.** One Earley row may hold up to :data:`MAX_ITEMS_IN_ROW` items
  (llguidance's 2,000 made a 2,001-way alternation fail after its first token), which is
  the per-step item budget llguidance already enforces.
* **Short errors.** :func:`parser_limits` turns llguidance's verbose errors (the parser's
  state and the grammar) off, and :func:`short_error` bounds what is left: a client sees
  why, never internal state or a message over gRPC's metadata limit.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import llguidance

__all__ = [
    "ERROR_CHARS",
    "MAX_ITEMS_IN_ROW",
    "grammar_tokenizer",
    "parser_limits",
    "short_error",
]

MAX_ITEMS_IN_ROW = 50_000
"""Earley items one parser row may hold (llguidance's step budget, ``step_max_items``)."""

ERROR_CHARS = 600
"""The longest grammar-engine message a client is shown."""


def parser_limits() -> llguidance.LLParserLimits:
    """The limits every matcher and every admission check uses."""
    import llguidance

    return llguidance.LLParserLimits(max_items_in_row=MAX_ITEMS_IN_ROW, verbose_errors=False)


def short_error(message: str) -> str:
    """A grammar-engine message without llguidance's prefix or parser state, at most
    :data:`ERROR_CHARS` characters (a compiler's message keeps its lines: the caret under
    the faulty spot is part of it)."""
    text = message
    for marker in ("<state>", "<non-verbose/>"):
        index = text.find(marker)
        if index >= 0:
            text = text[:index]
    text = text.strip()
    for prefix in ("Parser Error: ", "Error: "):
        if text.startswith(prefix):
            text = text[len(prefix) :]
    if len(text) > ERROR_CHARS:
        text = text[: ERROR_CHARS - 3].rstrip() + "..."
    return text or "the grammar engine gave no reason"


class _PlainTextTokenizer:
    """What llguidance's ``LLTokenizer`` takes in place of a ``TokenizerWrapper``: the token
    bytes of ``base`` (llguidance's own view of the model's tokenizer), its special tokens,
    and a tokenization of text that never yields a special token."""

    is_tokenizer_wrapper = True

    def __init__(self, base: llguidance.LLTokenizer, names: dict[int, str]) -> None:
        self._base = base
        n_vocab = base.vocab_size
        self.tokens = [base.decode_bytes([i]) for i in range(n_vocab)]
        self.special_token_ids = [i for i in range(n_vocab) if base.is_special_token(i)]
        self._special = frozenset(self.special_token_ids)
        self._names = names
        self.eos_token_id = base.eos_token
        self.bos_token_id = None

    def __call__(self, text: str) -> list[int]:
        # Called from llguidance's Rust side, which cannot take an exception: never raise.
        try:
            ids = self._base.tokenize_str(text)
            if self._special.isdisjoint(ids):
                return ids
            plain: list[int] = []
            for token in ids:
                if token in self._special:
                    spelled = self._names.get(token) or self._base.decode_str([token])
                    plain += self._base.greedy_tokenize(spelled)
                else:
                    plain.append(token)
            return plain
        except Exception:  # Rust calls this: it cannot take an exception
            return list(self._base.greedy_tokenize(text))


def _special_names(tokenizer_json: str) -> dict[int, str]:
    """The text of each added token of tokenizer.json, by id."""
    import json

    try:
        added = json.loads(tokenizer_json).get("added_tokens") or []
    except (ValueError, AttributeError):
        return {}
    return {
        int(token["id"]): str(token["content"])
        for token in added
        if isinstance(token, dict) and "id" in token and "content" in token
    }


def grammar_tokenizer(
    tokenizer_json: str, n_vocab: int, eos_token_ids: Sequence[int]
) -> llguidance.LLTokenizer:
    """llguidance's tokenizer for a model (its tokenizer.json text, vocabulary size and EOS
    ids), with special-token text tokenized as plain text (module docstring)."""
    import llguidance

    eos = list(eos_token_ids) or None
    base = llguidance.LLTokenizer(tokenizer_json, n_vocab=n_vocab, eos_token=eos)
    wrapper = _PlainTextTokenizer(base, _special_names(tokenizer_json))
    return llguidance.LLTokenizer(wrapper, n_vocab=n_vocab, eos_token=eos)  # type: ignore[arg-type]
