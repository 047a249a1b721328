"""Tokenizers for the guided-decoding tests: the embedded model's (GPT-2-style byte-level
BPE, as StarCoder, GPT-NeoX and Qwen2 have) and a Llama-style one (Metaspace ``▁`` with
byte-fallback ``<0xNN>`` tokens), trained here on a small corpus."""

from __future__ import annotations

import json
from functools import cache

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from tgis.embedded_model import MODEL_DIR

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    '{"name": "Ada", "age": 36, "tags": ["math", "code"], "ok": true}',
    "SELECT name FROM users WHERE age > 30;",
    "yes no maybe 0123456789 abc-42 hello world",
] * 20


def embedded_tokenizer_json() -> str:
    """The embedded model's tokenizer.json (byte-level BPE, 4096 entries, EOS 2)."""
    return (MODEL_DIR / "tokenizer.json").read_text(encoding="utf-8")


@cache
def llama_style_tokenizer_json() -> str:
    """A Llama-style tokenizer.json: BPE over ``▁``-prefixed words, every byte as a
    ``<0xNN>`` fallback token, ``<unk>`` 0, ``<s>`` 1, ``</s>`` 2."""
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tokenizer.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never")
    tokenizer.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    # The byte tokens are ordinary vocabulary entries (as in Llama's), after the trained ones.
    data = json.loads(tokenizer.to_str())
    vocab = data["model"]["vocab"]
    for token in byte_tokens:
        vocab.setdefault(token, len(vocab))
    return json.dumps(data)
