"""Write a synthetic fast tokenizer for a model directory that has only its config.json.

With ``--load-format dummy`` the shard needs nothing but ``config.json``; the router still
needs a tokenizer whose vocabulary matches the model's (a random model samples any id below
``vocab_size``, and every one must detokenize). This writes ``tokenizer.json`` and
``tokenizer_config.json`` into the directory: a byte-level BPE (GPT-2 / Llama 3 style: any
text round-trips) whose vocabulary has exactly the config's ``vocab_size`` tokens:

* the config's BOS and EOS ids hold special tokens (never split, skipped when decoding);
* every other id holds, in order, the 256 byte-level symbols, then merged tokens generated
  from a fixed alphabet (space and a-z): every pair of symbols, then every pair of those
  pairs, ... until the vocabulary is full. Text tokenizes to a few characters per token.
* BOS is put in front of every input when the config has a BOS id that is not also an EOS
  id (Llama 3), not otherwise (Granite, whose BOS and EOS are one token); ``--add-bos`` /
  ``--no-add-bos`` decide instead.

Deterministic and fast (about a second for a 128k vocabulary). Usage::

    .venv/bin/python benchmarks/make_synthetic_tokenizer.py benchmarks/models/llama-3.1-8b
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers, processors
from tokenizers.models import BPE

ALPHABET = ["Ġ", *"abcdefghijklmnopqrstuvwxyz"]  # "Ġ" is the byte-level symbol of a space
BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"


def special_tokens(bos_id: int | None, eos_ids: Sequence[int]) -> dict[int, str]:
    """Special token text by id: the EOS ids (the first one ``EOS_TOKEN``), and BOS unless
    it shares an EOS id."""
    specials = {
        eos: EOS_TOKEN if i == 0 else f"<|end_of_text_{i}|>" for i, eos in enumerate(eos_ids)
    }
    if bos_id is not None and bos_id not in specials:
        specials[bos_id] = BOS_TOKEN
    return specials


def _merges() -> Iterator[tuple[str, str]]:
    """Merge rules in rank order: every pair of ALPHABET symbols, then every pair of those
    pairs, and so on (each level doubles the length of its tokens)."""
    level = list(ALPHABET)
    while True:
        merged = []
        for a, b in itertools.product(level, repeat=2):
            merged.append(a + b)
            yield a, b
        level = merged


def build_tokenizer(
    vocab_size: int, bos_id: int | None, eos_ids: Sequence[int], add_bos: bool
) -> Tokenizer:
    """The synthetic byte-level BPE tokenizer with exactly ``vocab_size`` tokens."""
    specials = special_tokens(bos_id, eos_ids)
    bad = [i for i in specials if not 0 <= i < vocab_size]
    if bad:
        raise ValueError(f"special token ids {bad} are outside the vocabulary ({vocab_size})")
    regular_ids = (i for i in range(vocab_size) if i not in specials)
    byte_symbols = sorted(pre_tokenizers.ByteLevel.alphabet())
    regular_count = vocab_size - len(specials)
    if regular_count < len(byte_symbols):
        raise ValueError(f"vocab_size {vocab_size} is too small for a byte-level vocabulary")
    merges = list(itertools.islice(_merges(), regular_count - len(byte_symbols)))
    tokens = byte_symbols + [a + b for a, b in merges]
    vocab = dict(zip(tokens, regular_ids, strict=False))
    vocab.update({text: i for i, text in specials.items()})

    tokenizer = Tokenizer(BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(
        [AddedToken(specials[i], special=True, normalized=False) for i in sorted(specials)]
    )
    if add_bos and bos_id is not None:
        bos = specials[bos_id]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
        )
    else:
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    return tokenizer


def _ids(value: Any) -> list[int]:
    """A config's ``eos_token_id``: absent, one id or a list."""
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def write_tokenizer(model_dir: Path, add_bos: bool | None = None) -> Tokenizer:
    """Write tokenizer.json and tokenizer_config.json for ``model_dir/config.json``;
    ``add_bos`` None: BOS when the config has one distinct from its EOS ids."""
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    vocab_size = int(config["vocab_size"])
    bos_id = config.get("bos_token_id")
    eos_ids = _ids(config.get("eos_token_id"))
    if add_bos is None:
        add_bos = bos_id is not None and bos_id not in eos_ids
    tokenizer = build_tokenizer(vocab_size, bos_id, eos_ids, add_bos)
    specials = special_tokens(bos_id, eos_ids)
    tokenizer.save(str(model_dir / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": specials.get(bos_id) if bos_id is not None else None,
        "eos_token": specials[eos_ids[0]] if eos_ids else None,
        "add_bos_token": add_bos,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(config.get("max_position_embeddings", 2048)),
    }
    (model_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    return tokenizer


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir", type=Path, help="directory holding the config.json")
    parser.add_argument(
        "--add-bos",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="put BOS in front of every input (default: when BOS is not an EOS id)",
    )
    args = parser.parse_args(argv)
    if not (args.model_dir / "config.json").is_file():
        print(f"error: no config.json in {args.model_dir}", file=sys.stderr)
        return 1
    tokenizer = write_tokenizer(args.model_dir, args.add_bos)
    print(
        f"Wrote {args.model_dir}/tokenizer.json ({tokenizer.get_vocab_size()} tokens) and "
        "tokenizer_config.json"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
