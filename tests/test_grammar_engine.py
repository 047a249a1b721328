"""tgis/grammar_engine.py: llguidance's tokenizer with special-token text as plain text, the
parser limits and the short errors, on the embedded model's byte-level BPE and on a
Llama-style (Metaspace, byte-fallback) tokenizer.

The oracle is llguidance itself: on grammars whose text holds no special token, the token
masks of :func:`grammar_tokenizer` must equal those of llguidance's own tokenizer at every
step of random walks; on grammars that spell a special token, llguidance's own tokenizer
fails (shown here, so the test can fail) and ours must produce exactly the grammar's text.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable

import llguidance
import pytest
from tokenizers import Tokenizer

from tests.guided_tokenizers import embedded_tokenizer_json, llama_style_tokenizer_json
from tgis.grammar_engine import (
    ERROR_CHARS,
    grammar_tokenizer,
    parser_limits,
    short_error,
)

EOS = 2
TOKENIZERS: dict[str, Callable[[], str]] = {
    "byte-level": embedded_tokenizer_json,
    "llama-style": llama_style_tokenizer_json,
}
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "n": {"type": "integer"},
        "tags": {"type": "array", "items": {"enum": ["a", "bc"]}, "maxItems": 2},
    },
    "required": ["name", "n"],
}
PLAIN_GRAMMARS = [
    llguidance.LLMatcher.grammar_from_json_schema(
        json.dumps(SCHEMA), overrides={"whitespace_flexible": False}
    ),
    llguidance.LLMatcher.grammar_from_regex("[a-z]{1,5}-[0-9]{2}"),
    llguidance.LLMatcher.grammar_from_regex("hello world|hello there"),
    llguidance.LLMatcher.grammar_from_lark(
        'start: "SELECT " /[a-z]+/ " FROM " ("users" | "items")'
    ),
]


def vocab_size(tokenizer_json: str) -> int:
    return int(Tokenizer.from_str(tokenizer_json).get_vocab_size(with_added_tokens=True))


def allowed(matcher: llguidance.LLMatcher, n_vocab: int) -> list[int]:
    mask = matcher.compute_bitmask()
    return [t for t in range(n_vocab) if mask[t // 8] >> (t % 8) & 1]


def walk(
    tokenizer: llguidance.LLTokenizer, grammar: str, n_vocab: int, seed: int, steps: int = 40
) -> tuple[list[list[int]], list[int], str]:
    """A random walk through ``grammar``'s masks: the masks, the tokens, the matcher's error."""
    rng = random.Random(seed)
    matcher = llguidance.LLMatcher(tokenizer, grammar, limits=parser_limits(), log_level=0)
    masks: list[list[int]] = []
    tokens: list[int] = []
    for _ in range(steps):
        mask = allowed(matcher, n_vocab)
        masks.append(mask)
        if matcher.is_error() or not mask:
            break
        token = rng.choice(mask)
        matcher.consume_token(token)
        tokens.append(token)
        if matcher.is_error() or token == EOS:
            break
    return masks, tokens, matcher.get_error() if matcher.is_error() else ""


@pytest.mark.parametrize("name", TOKENIZERS)
@pytest.mark.parametrize("grammar", PLAIN_GRAMMARS, ids=["schema", "regex", "alternatives", "lark"])
def test_masks_equal_llguidances_own_where_no_special_text(name: str, grammar: str) -> None:
    text = TOKENIZERS[name]()
    n_vocab = vocab_size(text)
    own = llguidance.LLTokenizer(text, n_vocab=n_vocab, eos_token=EOS)
    ours = grammar_tokenizer(text, n_vocab, [EOS])
    for seed in range(6):
        masks, tokens, error = walk(own, grammar, n_vocab, seed)
        assert not error
        our_masks, our_tokens, our_error = walk(ours, grammar, n_vocab, seed)
        assert (our_masks, our_tokens, our_error) == (masks, tokens, error)


@pytest.mark.parametrize("name", TOKENIZERS)
@pytest.mark.parametrize("literal", ["<s>", "x</s>y", "<unk>", "a<s>b</s>", "</s>"])
def test_special_token_text_is_generated_as_text(name: str, literal: str) -> None:
    text = TOKENIZERS[name]()
    n_vocab = vocab_size(text)
    grammar = llguidance.LLMatcher.grammar_from_lark(f"start: {json.dumps(literal)}")
    own = llguidance.LLTokenizer(text, n_vocab=n_vocab, eos_token=EOS)
    *_, own_error = walk(own, grammar, n_vocab, 0)
    assert own_error, "llguidance's own tokenizer no longer forces the special token"
    ours = grammar_tokenizer(text, n_vocab, [EOS])
    decoder = Tokenizer.from_str(text)
    for seed in range(5):
        _, tokens, error = walk(ours, grammar, n_vocab, seed)
        assert not error and tokens[-1] == EOS
        assert decoder.decode(tokens[:-1], skip_special_tokens=True) == literal


def test_special_tokens_stay_reachable_by_id() -> None:
    text = embedded_tokenizer_json()
    ours = grammar_tokenizer(text, vocab_size(text), [EOS])
    matcher = llguidance.LLMatcher(ours, 'start: "x" <[1]>', limits=parser_limits())
    assert matcher.consume_token(ours.tokenize_str("x")[0])
    assert allowed(matcher, vocab_size(text)) == [1]


def test_tokenization_never_yields_a_special_token_for_text() -> None:
    text = embedded_tokenizer_json()
    n_vocab = vocab_size(text)
    own = llguidance.LLTokenizer(text, n_vocab=n_vocab, eos_token=EOS)
    ours = grammar_tokenizer(text, n_vocab, [EOS])
    for sample in ["x<s>y", "</s>", "<pad><unk>", "plain text", "é<s>日"]:
        ids = ours.tokenize_str(sample)
        assert not any(ours.is_special_token(t) for t in ids)
        assert ours.decode_str(ids) == sample
        if "<" not in sample:
            assert ids == own.tokenize_str(sample)


def test_padded_vocabulary() -> None:
    """A model whose embedding has more rows than its tokenizer has tokens."""
    text = embedded_tokenizer_json()
    ours = grammar_tokenizer(text, vocab_size(text) + 64, [EOS])
    grammar = llguidance.LLMatcher.grammar_from_regex("x<s>y")
    _, tokens, error = walk(ours, grammar, vocab_size(text) + 64, 3)
    assert not error and ours.decode_str(tokens[:-1]) == "x<s>y"


def test_a_wide_alternation_fits_the_rows() -> None:
    text = embedded_tokenizer_json()
    n_vocab = vocab_size(text)
    tokenizer = grammar_tokenizer(text, n_vocab, [EOS])
    lark = "start: " + " | ".join(json.dumps(f"c{i}") for i in range(2001))
    grammar = llguidance.LLMatcher.grammar_from_lark(lark)
    default = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    default.consume_token(allowed(default, n_vocab)[0])
    assert "max is 2000" in default.get_error()
    for seed in range(3):
        _, tokens, error = walk(tokenizer, grammar, n_vocab, seed)
        assert not error and tokens[-1] == EOS
        assert tokenizer.decode_str(tokens[:-1]) in {f"c{i}" for i in range(2001)}


def test_short_error_drops_state_and_bounds_the_text() -> None:
    message = 'Parser Error: token "x" doesn\'t satisfy the grammar\n<state>\nTokens: ...\n'
    assert short_error(message) == 'token "x" doesn\'t satisfy the grammar'
    assert short_error("NoExtensionBias\n<non-verbose/>") == "NoExtensionBias"
    long = short_error("Error: " + "g" * 50_000)
    assert len(long) == ERROR_CHARS and long.endswith("...")
    assert short_error("at 1(8): bad\n  ^") == "at 1(8): bad\n  ^"
    assert short_error("\n<state>") == "the grammar engine gave no reason"


def test_matcher_errors_carry_no_parser_state() -> None:
    text = embedded_tokenizer_json()
    tokenizer = grammar_tokenizer(text, vocab_size(text), [EOS])
    matcher = llguidance.LLMatcher(
        tokenizer, llguidance.LLMatcher.grammar_from_regex("ab"), limits=parser_limits()
    )
    matcher.consume_token(tokenizer.tokenize_str("zz")[0])
    assert matcher.is_error()
    assert "<state>" not in matcher.get_error()
