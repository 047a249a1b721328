"""Checks on the tiny model shipped in tgis/embedded_model/data/ (built by
scripts/build_tiny_model.py): size, config, tokenizer behaviour, and that it writes English."""

from __future__ import annotations

import importlib.util
import json
import re
from collections import Counter
from functools import cache
from pathlib import Path
from types import ModuleType

import pytest
import torch
from tokenizers import Tokenizer

from tgis.embedded_model import MODEL_DIR

REPO_ROOT = Path(__file__).resolve().parent.parent
BUILD_SCRIPT = REPO_ROOT / "scripts" / "build_tiny_model.py"
MAX_BYTES = 10 * 1024 * 1024
PROMPT = "Return the number of"
# A sentence in the style of the training corpus (stdlib docstrings).
ENGLISH = "Return a new list containing all items from the iterable in ascending order."


@cache
def build_script() -> ModuleType:
    """Import scripts/build_tiny_model.py (not a package) as a module."""
    spec = importlib.util.spec_from_file_location("build_tiny_model", BUILD_SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@cache
def english_words() -> frozenset[str]:
    """Lower-case words seen at least 3 times in the model's training corpus (the docstrings)."""
    counts = Counter(re.findall(r"[a-z]+", " ".join(build_script().collect_corpus()).lower()))
    return frozenset(word for word, count in counts.items() if count >= 3)


@cache
def config() -> dict[str, object]:
    return json.loads((MODEL_DIR / "config.json").read_text())


@cache
def tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))


@cache
def model() -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32).eval()


def test_expected_files_and_size() -> None:
    names = {p.name for p in MODEL_DIR.iterdir()}
    assert {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "chat_template.jinja",
    } <= names
    total = sum(p.stat().st_size for p in MODEL_DIR.rglob("*") if p.is_file())
    assert total <= MAX_BYTES, f"{MODEL_DIR} holds {total} bytes"


def test_config_is_llama_with_gqa() -> None:
    cfg = config()
    assert cfg["model_type"] == "llama"
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    assert isinstance(heads, int) and isinstance(kv_heads, int)
    assert kv_heads < heads and heads % kv_heads == 0
    assert cfg["vocab_size"] == tokenizer().get_vocab_size()
    generation = json.loads((MODEL_DIR / "generation_config.json").read_text())
    assert generation["bos_token_id"] == cfg["bos_token_id"]
    assert generation["eos_token_id"] == cfg["eos_token_id"]


def test_tokenizer_special_tokens() -> None:
    tok, cfg = tokenizer(), config()
    bos, eos = tok.token_to_id("<s>"), tok.token_to_id("</s>")
    assert cfg["bos_token_id"] == bos
    assert cfg["eos_token_id"] == eos
    assert bos in (0, 1)
    with_bos = tok.encode(PROMPT, add_special_tokens=True).ids
    without = tok.encode(PROMPT, add_special_tokens=False).ids
    assert with_bos[0] == bos
    assert with_bos[1:] == without
    assert bos not in without


@pytest.mark.parametrize("text", [ENGLISH, "naïve café — 東京", "  two  spaces\tand\nlines 🙂 "])
def test_tokenizer_round_trip(text: str) -> None:
    tok = tokenizer()
    assert tok.decode(tok.encode(text).ids, skip_special_tokens=True) == text
    assert tok.decode(tok.encode(text, add_special_tokens=False).ids) == text


def test_transformers_tokenizer_adds_bos() -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(MODEL_DIR)
    assert hf.bos_token_id == config()["bos_token_id"]
    assert hf.eos_token_id == config()["eos_token_id"]
    assert hf(PROMPT).input_ids == tokenizer().encode(PROMPT).ids


def test_model_knows_english() -> None:
    """Mean next-token loss on an English sentence is far below chance (ln 4096 ≈ 8.3)."""
    ids = torch.tensor([tokenizer().encode(ENGLISH).ids])
    with torch.no_grad():
        loss = model()(input_ids=ids, labels=ids).loss.item()
    assert loss < 5.0, loss  # the shipped model: about 3.5; random weights: about 8.3


def test_greedy_generation_is_english() -> None:
    """20 greedy tokens: mostly real words from the training corpus, and not one word repeated.

    A randomly initialised model of the same shape fails this: it repeats a single token, or
    emits fragments and symbols that are not words.
    """
    tok = tokenizer()
    ids = torch.tensor([tok.encode(PROMPT).ids])
    with torch.no_grad():
        out = model().generate(
            ids, max_new_tokens=20, min_new_tokens=20, do_sample=False, pad_token_id=0
        )
    assert out.shape[1] == ids.shape[1] + 20
    text = tok.decode(out[0, ids.shape[1] :].tolist(), skip_special_tokens=True)
    words = [w.strip(".,;:!?()[]{}\"'`").lower() for w in text.split()]
    vocabulary = english_words()
    english = [w for w in words if w.isascii() and w.isalpha() and w in vocabulary]
    assert len(words) >= 8, text
    assert len(english) >= 0.7 * len(words), text
    assert len(set(english)) >= 5, text


# Conversations as the OpenAI chat route hands them to the template (text contents).
CONVERSATIONS = [
    [{"role": "user", "content": "Say hello"}],
    [{"role": "system", "content": " Be brief. "}, {"role": "user", "content": "Hi"}],
    [
        {"role": "system", "content": "You answer in one line."},
        {"role": "user", "content": "What is a list?"},
        {"role": "assistant", "content": "A sequence."},
        {"role": "user", "content": "And a tuple?\n"},
    ],
    [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": ""},
        {"role": "tool", "content": '{"sunny": true}'},
    ],
    [{"role": "system", "content": "Only a system message"}],
    [{"role": "assistant", "content": "I start."}, {"role": "user", "content": "Go on"}],
    [
        {"role": "system", "content": "Sys"},
        {"role": "assistant", "content": "I start."},
        {"role": "user", "content": "Go on"},
    ],
]


def test_the_shipped_chat_template_is_the_build_scripts() -> None:
    """make tiny-model writes chat_template.jinja from CHAT_TEMPLATE."""
    shipped = (MODEL_DIR / "chat_template.jinja").read_text(encoding="utf-8")
    assert shipped == build_script().CHAT_TEMPLATE


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_the_chat_template_renders_as_transformers_renders_it(
    messages: list[dict[str, str]],
) -> None:
    """The router finds the template in the model directory and renders what transformers'
    apply_chat_template renders; the prompt is Llama 2's chat format, one BOS per user turn
    (the template writes them: the chat route adds none)."""
    from transformers import AutoTokenizer

    from tgis.router.intake.chat_template import load_chat_template

    template = load_chat_template(None, MODEL_DIR)
    assert template is not None
    assert template.origin == "chat_template.jinja in the model directory"
    hf = AutoTokenizer.from_pretrained(MODEL_DIR)
    for generation_prompt in (True, False):
        want = hf.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt
        )
        assert template.render(messages, add_generation_prompt=generation_prompt) == want
    prompt = template.render(messages)
    assert prompt.startswith("<s>") and prompt.endswith(("[/INST]", " </s>"))
    ids = tokenizer().encode(prompt, add_special_tokens=False).ids
    turns = messages[1:] if messages[0]["role"] == "system" else messages
    lead = not turns or turns[0]["role"] == "assistant"  # a BOS (and the system) of its own
    bos = sum(m["role"] != "assistant" for m in turns) + lead
    assert ids.count(config()["bos_token_id"]) == bos


def test_the_chat_template_layout() -> None:
    from tgis.router.intake.chat_template import load_chat_template

    template = load_chat_template(None, MODEL_DIR)
    assert template is not None
    assert template.render(CONVERSATIONS[2]) == (
        "<s>[INST] <<SYS>>\nYou answer in one line.\n<</SYS>>\n\nWhat is a list? [/INST]"
        " A sequence. </s><s>[INST] And a tuple? [/INST]"
    )
    assert template.render(CONVERSATIONS[4]) == (
        "<s>[INST] <<SYS>>\nOnly a system message\n<</SYS>>\n\n[/INST]"
    )
    assert template.render(CONVERSATIONS[5]) == "<s> I start. </s><s>[INST] Go on [/INST]"
    assert template.render(CONVERSATIONS[6]) == (
        "<s>[INST] <<SYS>>\nSys\n<</SYS>>\n\n[/INST] I start. </s><s>[INST] Go on [/INST]"
    )
