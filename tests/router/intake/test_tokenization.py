"""RouterTokenizer: encoding with specials, BOS detection, Tokenize semantics (§4.1), decoding."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

from tgis.router.intake.tokenization import INLINE_ENCODE_CHARS, RouterTokenizer, TokenizeResult


def test_bos_detection(
    bytelevel_tokenizer: RouterTokenizer, llama_tokenizer: RouterTokenizer, bytelevel_raw: Tokenizer
) -> None:
    assert bytelevel_tokenizer.bos_token_id == bytelevel_raw.token_to_id("<s>") == 0
    assert llama_tokenizer.bos_token_id == 1
    plain = Tokenizer.from_str(bytelevel_raw.to_str())
    plain.post_processor = None
    assert RouterTokenizer(plain).bos_token_id is None
    # T5 style: </s> appended at the end is not a BOS.
    t5 = Tokenizer.from_str(bytelevel_raw.to_str())
    t5.post_processor = processors.TemplateProcessing(
        single="$A </s>", special_tokens=[("</s>", 1)]
    )
    rt5 = RouterTokenizer(t5)
    assert rt5.bos_token_id is None
    assert rt5.encode("Hello")[-1] == 1


def test_encode_counts_special_tokens(
    any_tokenizer: RouterTokenizer, sample_texts: list[str]
) -> None:
    bos = any_tokenizer.bos_token_id
    for text in sample_texts:
        ids = any_tokenizer.encode(text)
        assert ids[0] == bos
        raw = any_tokenizer.tokenizer.encode(text, add_special_tokens=False).ids
        assert ids == [bos, *raw]
    assert any_tokenizer.encode("") == [bos]  # empty input = BOS only
    assert any_tokenizer.encode_batch(sample_texts) == [
        any_tokenizer.encode(t) for t in sample_texts
    ]


def test_truncation_and_padding_from_the_file_are_disabled(bytelevel_raw: Tokenizer) -> None:
    tok = Tokenizer.from_str(bytelevel_raw.to_str())
    tok.enable_truncation(max_length=4)
    tok.enable_padding(length=64)
    rt = RouterTokenizer(tok)
    assert rt.configured_max_length == 4
    text = "The quick brown fox jumps over the lazy dog."
    ids = rt.encode(text)
    assert len(ids) > 4
    assert len(ids) < 64
    assert rt.tokenize([text])[0].token_count == len(ids)


def test_from_path(tmp_path: Path, bytelevel_raw: Tokenizer) -> None:
    path = tmp_path / "tokenizer.json"
    bytelevel_raw.save(str(path))
    rt = RouterTokenizer(path)
    assert rt.encode("Hello world") == RouterTokenizer.from_file(path, workers=3).encode(
        "Hello world"
    )
    rt.close()


def test_tokenize_tokens_and_offsets(bytelevel_tokenizer: RouterTokenizer) -> None:
    [r] = bytelevel_tokenizer.tokenize([" I am so confused."], True, True)
    assert r.token_count == 10
    assert r.tokens == ("<s>", "ĠI", "Ġa", "m", "Ġso", "Ġc", "on", "fus", "ed", ".")
    assert r.offsets[0] == (0, 0)  # the added BOS
    assert r.offsets[1:4] == ((0, 2), (2, 4), (4, 5))
    assert r.offsets[-1] == (17, 18)


def test_tokenize_byte_offsets_for_non_ascii(
    bytelevel_tokenizer: RouterTokenizer, llama_tokenizer: RouterTokenizer
) -> None:
    text = "a😀 日本"  # a=0..1, 😀=1..5, space=5..6, 日=6..9, 本=9..12 (bytes)
    [bl] = bytelevel_tokenizer.tokenize([text], True, True)
    assert bl.tokens == ("<s>", "a", "ðŁ", "ĺ", "Ģ", "Ġ", "æĹ¥æľ", "¬")
    assert bl.offsets == ((0, 0), (0, 1), (1, 5), (1, 5), (1, 5), (5, 6), (6, 12), (9, 12))
    [ll] = llama_tokenizer.tokenize([text], True, True)
    emoji = ("<0xF0>", "<0x9F>", "<0x98>", "<0x80>")
    cjk = ("<0xE6>", "<0x97>", "<0xA5>", "<0xE6>", "<0x9C>", "<0xAC>")
    assert ll.tokens == ("<s>", "▁a", *emoji, "▁", *cjk)
    assert ll.offsets == ((0, 0), (0, 1), *[(1, 5)] * 4, (5, 6), *[(6, 9)] * 3, *[(9, 12)] * 3)


def test_offsets_are_byte_offsets_for_every_sample(
    any_tokenizer: RouterTokenizer, sample_texts: list[str]
) -> None:
    results = any_tokenizer.tokenize(sample_texts, return_offsets=True)
    for text, r in zip(sample_texts, results, strict=True):
        encoding = any_tokenizer.tokenizer.encode(text)
        raw = text.encode()
        assert len(r.offsets) == r.token_count == len(encoding.ids)
        for (start, end), (cs, ce), special in zip(
            r.offsets, encoding.offsets, encoding.special_tokens_mask, strict=True
        ):
            if special:
                assert (start, end) == (0, 0)
                continue
            assert 0 <= start <= end <= len(raw)
            # Byte offsets select exactly the characters of the char offsets.
            assert raw[start:end].decode() == text[cs:ce]


def test_tokenize_truncation_keeps_the_tail(any_tokenizer: RouterTokenizer) -> None:
    text = "Once upon a time, there was a little girl."
    [full] = any_tokenizer.tokenize([text], True, True)
    [cut] = any_tokenizer.tokenize([text], True, True, truncate=3)
    assert cut.token_count == 3
    assert cut.tokens == full.tokens[-3:]
    assert cut.offsets == full.offsets[-3:]
    assert cut.tokens[0] != "<s>"  # no BOS substitution in Tokenize
    [big] = any_tokenizer.tokenize([text], True, True, truncate=10_000)
    assert big == full


def test_tokenize_flags(any_tokenizer: RouterTokenizer) -> None:
    texts = ["Hello world", "", "日本"]
    plain = any_tokenizer.tokenize(texts)
    assert [r.tokens for r in plain] == [(), (), ()]
    assert [r.offsets for r in plain] == [(), (), ()]
    assert [r.token_count for r in plain] == [len(any_tokenizer.encode(t)) for t in texts]
    only_offsets = any_tokenizer.tokenize(texts, return_offsets=True)
    assert only_offsets[0].tokens == () and len(only_offsets[0].offsets) > 0
    only_tokens = any_tokenizer.tokenize(texts, return_tokens=True)
    assert only_tokens[0].offsets == () and len(only_tokens[0].tokens) > 0
    assert any_tokenizer.tokenize([]) == []


def test_async_helpers(any_tokenizer: RouterTokenizer, sample_texts: list[str]) -> None:
    async def run() -> tuple[list[int], list[list[int]], list[TokenizeResult]]:
        return await asyncio.gather(
            any_tokenizer.encode_async("Hello world"),
            any_tokenizer.encode_batch_async(sample_texts),
            any_tokenizer.run_async(lambda: any_tokenizer.tokenize(sample_texts, True, True, 2)),
        )

    one, many, tokenized = asyncio.run(run())
    assert one == any_tokenizer.encode("Hello world")
    assert many == any_tokenizer.encode_batch(sample_texts)
    assert tokenized == any_tokenizer.tokenize(sample_texts, True, True, 2)


def test_short_inputs_are_encoded_on_the_loop_long_ones_on_the_pool(
    bytelevel_raw: Tokenizer,
) -> None:
    """Up to INLINE_ENCODE_CHARS in all the loop encodes (no thread hop); beyond, the pool
    does. With the pool shut down, only the inline path can still answer."""
    any_tokenizer = RouterTokenizer(Tokenizer.from_str(bytelevel_raw.to_str()))
    short = ["Hello", "world " * 10]
    long = ["x" * (INLINE_ENCODE_CHARS + 1)]
    expected = any_tokenizer.encode_batch(short)
    expected_long = any_tokenizer.encode_batch(long)
    assert asyncio.run(any_tokenizer.encode_batch_async(long)) == expected_long
    any_tokenizer.close()
    assert asyncio.run(any_tokenizer.encode_batch_async(short)) == expected
    with pytest.raises(RuntimeError):
        asyncio.run(any_tokenizer.encode_batch_async(long))


def test_id_to_token(llama_tokenizer: RouterTokenizer) -> None:
    assert llama_tokenizer.id_to_token(1) == "<s>"
    assert llama_tokenizer.id_to_token(3 + 0x0A) == "<0x0A>"
    assert llama_tokenizer.id_to_token(10**6) == ""
    assert llama_tokenizer.id_to_token(-1) == ""
    assert llama_tokenizer.token_to_id("</s>") == 2
    assert llama_tokenizer.token_to_id("no such token") is None


def test_decode_output_keeps_the_leading_space_of_a_continuation(
    llama_tokenizer: RouterTokenizer,
) -> None:
    ids = llama_tokenizer.tokenizer.encode("I am so confused", add_special_tokens=False).ids
    assert llama_tokenizer.decode(ids) == "I am so confused"
    assert llama_tokenizer.decode_output(ids) == " I am so confused"
    assert llama_tokenizer.decode_output(ids, continuation=False) == "I am so confused"


def test_decode_output_drops_a_trailing_eos_and_trims_incomplete_utf8(
    any_tokenizer: RouterTokenizer,
) -> None:
    eos = any_tokenizer.token_to_id("</s>")
    assert eos is not None
    ids = any_tokenizer.tokenizer.encode("so confused ☃", add_special_tokens=False).ids
    expected = any_tokenizer.decode_output(ids)
    assert expected.endswith("confused ☃")
    assert any_tokenizer.decode_output([*ids, eos], False, eos_token_ids={eos}) == expected
    assert any_tokenizer.decode_output([*ids, eos], False).endswith("</s>")
    # Cut inside the emoji: the incomplete character is trimmed, not shown as U+FFFD.
    assert any_tokenizer.decode_output(ids[:-1]).endswith("confused ")


def test_placeholder_only_for_space_stripping_decoders(
    bytelevel_tokenizer: RouterTokenizer, llama_tokenizer: RouterTokenizer
) -> None:
    assert bytelevel_tokenizer.decoder_type == "ByteLevel"
    assert not bytelevel_tokenizer.uses_placeholder
    assert llama_tokenizer.decoder_type == "Sequence"
    assert llama_tokenizer.uses_placeholder


def test_no_decoder_gets_a_leading_space() -> None:
    vocab = {"[UNK]": 0, "hello": 1, "world": 2}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    rt = RouterTokenizer(tok)
    assert rt.decoder_type is None
    assert rt.decode_output([1, 2]) == " hello world"  # TGIS: " " + decode(ids)
    tok.decoder = decoders.WordPiece()
    assert RouterTokenizer(tok).decode_output([1, 2]) == " hello world"


def test_workers_must_be_positive(bytelevel_raw: Tokenizer) -> None:
    with pytest.raises(ValueError, match="tokenization_workers must be > 0"):
        RouterTokenizer(bytelevel_raw, workers=0)


def test_incomplete_character_does_not_wipe_its_byte_run(llama_tokenizer: RouterTokenizer) -> None:
    ids = llama_tokenizer.tokenizer.encode("the 東京☃", add_special_tokens=False).ids
    # 東, 京 and ☃ are all byte-fallback tokens: one run of 9 byte tokens.
    assert [llama_tokenizer.id_to_token(i) for i in ids[-9:]] == [
        f"<0x{b:02X}>" for b in "東京☃".encode()
    ]
    cut = ids[:-1]  # generation stopped inside ☃
    assert llama_tokenizer.decode(cut).endswith("\ufffd" * 8)  # the raw decoder loses 東京
    assert llama_tokenizer.decode_output(cut) == " the 東京"
    assert llama_tokenizer.decode_output(ids) == " the 東京☃"
