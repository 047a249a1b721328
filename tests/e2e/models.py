"""Tiny random models for end-to-end tests, saved with the embedded model's tokenizer."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tgis.embedded_model import MODEL_DIR as EMBEDDED_MODEL_DIR

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
PAD_TOKEN_ID = 3


def save_tiny_llama(path: Path) -> LlamaForCausalLM:
    """A random float32 Llama (GQA: 4 query heads, 2 KV heads, hidden size 64) with the
    embedded tokenizer, saved to ``path``; its transformers twin, which never stops early."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=4096,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=PAD_TOKEN_ID,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # peaked logits: no near-ties between summation orders
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.15)
    model.save_pretrained(path)
    for name in TOKENIZER_FILES:
        shutil.copy(EMBEDDED_MODEL_DIR / name, path / name)
    model.generation_config.eos_token_id = None
    return model


def greedy_new_tokens(model: Any, ids: list[int], new_tokens: int, **options: Any) -> list[int]:
    """The oracle of the e2e tests: the ids of transformers' greedy ``generate`` of exactly
    ``new_tokens`` tokens after ``ids``; ``options`` go to ``generate`` (EOS and pad ids,
    transformers' own speculative decoding)."""
    with torch.no_grad():
        out = model.generate(
            input_ids=torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            **options,
        )
    return list(out[0, len(ids) :].tolist())
