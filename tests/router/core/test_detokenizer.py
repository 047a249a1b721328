"""IncrementalDetokenizer: chunk concatenation equals the full decode (§3.3, §7.5)."""

from __future__ import annotations

import random

import pytest

from tgis.router.core.detokenizer import IncrementalDetokenizer
from tgis.router.intake.tokenization import RouterTokenizer

POOL = [
    "the", "quick", "fox", "confused", "é", "naïve", "señor", "日本語", "東京", "の", "😀",
    "🎉", "👍🏽", "👨‍👩‍👧", "\n", "—", "“q”", "☃", "Ω", "x", "  ", "\t", "'", "0",
]  # fmt: skip


def random_text(rng: random.Random) -> str:
    parts = []
    for _ in range(rng.randint(1, 12)):
        parts.append(rng.choice(POOL))
        if rng.random() < 0.4:
            parts.append(" ")
    return "".join(parts)


def structured_ids(tok: RouterTokenizer, rng: random.Random) -> list[int]:
    """Encodings of random texts (CJK, emoji, ZWJ sequences, accents), sometimes with special
    tokens in between, cut at a random point (often inside a multi-byte character)."""
    specials = [tok.token_to_id("<s>"), tok.token_to_id("</s>")]
    ids: list[int] = []
    for _ in range(rng.randint(1, 3)):
        ids += tok.tokenizer.encode(random_text(rng), add_special_tokens=False).ids
        if rng.random() < 0.3:
            ids.append(rng.choice([s for s in specials if s is not None]))
    return ids[: rng.randint(1, len(ids))] if ids else ids


def run(
    tok: RouterTokenizer, ids: list[int], skip: bool, hold_back: int = 0, **kw: object
) -> tuple[list[str], str, IncrementalDetokenizer]:
    det = IncrementalDetokenizer(tok, skip, hold_back, **kw)  # type: ignore[arg-type]
    chunks = []
    emitted = 0
    for token_id in ids:
        chunk = det.push(token_id)
        chunks.append(chunk)
        emitted += len(chunk.encode())
        # Emitted text is always a prefix of the accumulated text ...
        assert det.text.startswith("".join(chunks))
        assert det.output_bytes == det.text.encode() and det.total_bytes == len(det.output_bytes)
        # ... and with hold-back never reaches into the newest token's text plus N bytes.
        if hold_back:
            assert emitted <= max(0, det.total_bytes - det.bytes_added - hold_back)
    final = det.flush()
    return chunks, final, det


def check_concatenation(tok: RouterTokenizer, ids: list[int], skip: bool, hold_back: int) -> None:
    chunks, final, det = run(tok, ids, skip, hold_back)
    expected = tok.decode_output(ids, skip)
    assert "".join(chunks) + final == expected == det.text, ids


def test_bytelevel_any_id_sequence(bytelevel_tokenizer: RouterTokenizer) -> None:
    """ByteLevel: for *any* ids, concatenation == tokenizer.decode(ids) minus trailing U+FFFD."""
    rng = random.Random(1234)
    vocab = bytelevel_tokenizer.vocab_size
    for _ in range(1500):
        ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 25))]
        skip = rng.random() < 0.5
        hold_back = rng.choice([0, 0, 1, 2, 7])
        chunks, final, _ = run(bytelevel_tokenizer, ids, skip, hold_back)
        expected = bytelevel_tokenizer.decode(ids, skip).rstrip("\ufffd")
        assert "".join(chunks) + final == expected, ids


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("hold_back", [0, 1, 5])
def test_structured_sequences(any_tokenizer: RouterTokenizer, skip: bool, hold_back: int) -> None:
    rng = random.Random(hold_back * 2 + skip)
    for _ in range(250):
        check_concatenation(any_tokenizer, structured_ids(any_tokenizer, rng), skip, hold_back)


def test_llama_random_ids_without_broken_byte_runs(llama_tokenizer: RouterTokenizer) -> None:
    """Random non-byte tokens mixed with complete byte-fallback characters (valid UTF-8 runs)."""
    rng = random.Random(7)
    normal = [i for i in range(259, llama_tokenizer.vocab_size)]
    chars = ["日", "😀", "Ω", "☃", "👍🏽", "é"]
    for _ in range(500):
        ids: list[int] = []
        for _ in range(rng.randint(1, 15)):
            if rng.random() < 0.35:
                ids += [3 + b for b in rng.choice(chars).encode()]
            else:
                ids.append(rng.choice(normal))
        ids = ids[: rng.randint(1, len(ids))]  # may end inside a character
        check_concatenation(llama_tokenizer, ids, rng.random() < 0.5, rng.choice([0, 3]))


def test_emoji_split_over_tokens_is_deferred(any_tokenizer: RouterTokenizer) -> None:
    ids = any_tokenizer.tokenizer.encode("ok ☃", add_special_tokens=False).ids
    det = IncrementalDetokenizer(any_tokenizer, True)
    out = [det.push(i) for i in ids]
    pieces = [any_tokenizer.id_to_token(i) for i in ids]
    assert len(ids) >= 3, pieces  # the snowman is not a single token in either vocabulary
    assert out[-1].endswith("☃")
    assert "\ufffd" not in "".join(out)
    assert det.bytes_added >= 3  # the whole character arrived with the last token


def test_llama_keeps_the_first_leading_space(llama_tokenizer: RouterTokenizer) -> None:
    ids = llama_tokenizer.tokenizer.encode("was so", add_special_tokens=False).ids
    det = IncrementalDetokenizer(llama_tokenizer, True)
    assert "".join(det.push(i) for i in ids) + det.flush() == " was so"
    seq2seq = IncrementalDetokenizer(llama_tokenizer, True, continuation=False)
    assert "".join(seq2seq.push(i) for i in ids) + seq2seq.flush() == "was so"


def test_bytes_added(bytelevel_tokenizer: RouterTokenizer) -> None:
    det = IncrementalDetokenizer(bytelevel_tokenizer, True)
    for token_id in bytelevel_tokenizer.tokenizer.encode("a😀", add_special_tokens=False).ids:
        det.push(token_id)
    assert det.text == "a😀" and det.bytes_added == 4 and det.total_bytes == 5


def test_hold_back_delays_but_keeps_everything(bytelevel_tokenizer: RouterTokenizer) -> None:
    text = " Hello world, how are you today?"
    ids = bytelevel_tokenizer.tokenizer.encode(text, add_special_tokens=False).ids
    chunks, final, _ = run(bytelevel_tokenizer, ids, True, hold_back=4)
    assert "".join(chunks) + final == text
    assert chunks[0] == ""  # the newest token's text is always held back
    assert len(final.encode()) >= 4 + len(bytelevel_tokenizer.decode(ids[-1:]).encode())
    plain, plain_final, _ = run(bytelevel_tokenizer, ids, True)
    assert "".join(plain) == text and plain_final == ""


def test_flush_truncates(bytelevel_tokenizer: RouterTokenizer) -> None:
    ids = bytelevel_tokenizer.tokenizer.encode(" I am so confused.", add_special_tokens=False).ids
    det = IncrementalDetokenizer(bytelevel_tokenizer, True, hold_back_bytes=6)
    streamed = "".join(det.push(i) for i in ids)
    assert streamed == " I am so co"  # 18 bytes minus "." (newest token) minus 6
    rest = det.flush(13)
    assert rest == "nf"
    assert streamed + rest == " I am so conf" == det.text
    assert det.output_bytes == b" I am so conf"


def test_flush_truncation_inside_a_character(bytelevel_tokenizer: RouterTokenizer) -> None:
    ids = bytelevel_tokenizer.tokenizer.encode("日本", add_special_tokens=False).ids
    det = IncrementalDetokenizer(bytelevel_tokenizer, True, hold_back_bytes=10)
    streamed = "".join(det.push(i) for i in ids)
    assert streamed == ""
    assert det.flush(4) == "日" == det.text  # 4 bytes fall inside 本: cut back to a boundary
    assert det.flush() == ""  # idempotent


def test_flush_below_what_was_already_emitted(bytelevel_tokenizer: RouterTokenizer) -> None:
    ids = bytelevel_tokenizer.tokenizer.encode("Hello world", add_special_tokens=False).ids
    det = IncrementalDetokenizer(bytelevel_tokenizer, True)
    assert "".join(det.push(i) for i in ids) == "Hello world"
    assert det.flush(5) == ""
    assert det.text == "Hello"


def test_trailing_eos_is_dropped_with_special_tokens_shown(any_tokenizer: RouterTokenizer) -> None:
    eos = any_tokenizer.token_to_id("</s>")
    assert eos is not None
    ids = any_tokenizer.tokenizer.encode("so confused", add_special_tokens=False).ids
    det = IncrementalDetokenizer(any_tokenizer, False, eos_token_ids={eos})
    text = "".join(det.push(i) for i in [*ids, eos]) + det.flush()
    assert text.endswith("so confused") and "</s>" not in text
    # Without telling it the EOS id, the special token is text like any other.
    det = IncrementalDetokenizer(any_tokenizer, False)
    assert ("".join(det.push(i) for i in [*ids, eos]) + det.flush()).endswith("confused</s>")
    # An EOS that is followed by more tokens is not trailing.
    det = IncrementalDetokenizer(any_tokenizer, False, eos_token_ids={eos})
    text = "".join(det.push(i) for i in [*ids, eos, *ids]) + det.flush()
    assert "</s>" in text


def test_push_after_flush_is_an_error(bytelevel_tokenizer: RouterTokenizer) -> None:
    det = IncrementalDetokenizer(bytelevel_tokenizer, True)
    det.flush()
    with pytest.raises(RuntimeError):
        det.push(5)
    with pytest.raises(ValueError):
        IncrementalDetokenizer(bytelevel_tokenizer, True, -1)
