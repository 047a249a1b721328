"""Tokenizers for the router tests, trained at test time (no model hub, no files in the repo).

* ``bytelevel_tokenizer``: GPT-2/Llama-3 style ByteLevel BPE with ``<s>``/``</s>`` and a
  TemplateProcessing post-processor that adds ``<s>`` in front.
* ``llama_tokenizer``: Llama-2 style SentencePiece-like BPE: ``▁`` normalizer, byte fallback
  (``<0x00>``..``<0xFF>``), the Sequence decoder (Replace, ByteFallback, Fuse, Strip) and BOS.
"""

from __future__ import annotations

import json

import pytest
from tokenizers import (
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

from tgis.router.intake.tokenization import RouterTokenizer

CORPUS = [
    "The quick brown fox jumps over the lazy dog. I am so confused about the weather today.",
    "Once upon a time, there was a little girl who lived in a village near the forest.",
    "Whenever she went out, the little girl wore a red riding cloak, so everyone called her",
    "Little Red Riding Hood. One morning she said: I will visit my grandmother today!",
    "Café, naïve, résumé, über, señor, déjà vu: accents are common in borrowed words.",
    "日本語のテキストも少し含めます。東京は日本の首都です。",
    "Emoji: 😀 😃 🎉 👍🏽 and a family 👨‍👩‍👧 — plus dashes – and “quotes”.",
    "def main():\n    print('hello world')\n    return 0\n",
] * 3

# Texts used by the tests; they contain characters the tokenizers have to split or byte-fall-back.
SAMPLE_TEXTS = [
    "Hello world",
    " I am so confused.",
    "Café naïve 日本語 😀🎉 done",
    "👨‍👩‍👧 family, 東京!",
    "tab\tand\nnewline  double  space",
    "ü",
    "",
]


def _bytelevel() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=420,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 0)]
    )
    return tok


def _llama() -> Tokenizer:
    # Train on the Latin part of the corpus only, so CJK and emoji need byte fallback (an
    # alphabet cut by limit_alphabet would not be deterministic).
    latin = ["".join(ch for ch in line if ord(ch) < 0x250) for line in CORPUS]
    base = Tokenizer(models.BPE(unk_token="<unk>"))
    base.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
    )
    base.train_from_iterator(latin, trainer)
    spec = json.loads(base.to_str())
    vocab: dict[str, int] = spec["model"]["vocab"]
    specials = {"<unk>": 0, "<s>": 1, "</s>": 2}
    new_vocab = dict(specials)
    for b in range(256):
        new_vocab[f"<0x{b:02X}>"] = 3 + b
    for token, idx in sorted(vocab.items(), key=lambda kv: kv[1]):
        if token not in specials:
            new_vocab[token] = idx + 256 if idx >= 3 else len(new_vocab)
    spec["model"]["vocab"] = new_vocab
    spec["model"]["byte_fallback"] = True
    spec["model"]["fuse_unk"] = True
    tok = Tokenizer.from_str(json.dumps(spec))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = None
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    return tok


@pytest.fixture(scope="session")
def sample_texts() -> list[str]:
    return list(SAMPLE_TEXTS)


@pytest.fixture(scope="session")
def bytelevel_raw() -> Tokenizer:
    return _bytelevel()


@pytest.fixture(scope="session")
def llama_raw() -> Tokenizer:
    return _llama()


@pytest.fixture(scope="session")
def bytelevel_tokenizer(bytelevel_raw: Tokenizer) -> RouterTokenizer:
    return RouterTokenizer(Tokenizer.from_str(bytelevel_raw.to_str()), workers=2)


@pytest.fixture(scope="session")
def llama_tokenizer(llama_raw: Tokenizer) -> RouterTokenizer:
    return RouterTokenizer(Tokenizer.from_str(llama_raw.to_str()), workers=2)


@pytest.fixture(scope="session", params=["bytelevel", "llama"])
def any_tokenizer(
    request: pytest.FixtureRequest,
    bytelevel_tokenizer: RouterTokenizer,
    llama_tokenizer: RouterTokenizer,
) -> RouterTokenizer:
    return bytelevel_tokenizer if request.param == "bytelevel" else llama_tokenizer
