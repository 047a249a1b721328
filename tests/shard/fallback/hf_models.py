"""Tiny random transformers models for the fallback engine's tests: causal families the
native engine lacks, T5 (relative decoder positions) and BART (absolute ones)."""

from __future__ import annotations

import random
from typing import Any

import torch
from transformers import (
    BartConfig,
    BartForConditionalGeneration,
    BloomConfig,
    BloomForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    OPTConfig,
    OPTForCausalLM,
    T5Config,
    T5ForConditionalGeneration,
)

VOCAB = 256
HIDDEN = 64


def prompt_of(length: int, seed: int) -> list[int]:
    """A random prompt avoiding the special ids 0-2."""
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(length)]


def causal_configs() -> dict[str, tuple[Any, Any]]:
    """Model class and config of each tiny causal family."""
    common: dict[str, Any] = dict(vocab_size=VOCAB, eos_token_id=2, bos_token_id=1)
    return {
        "gpt2": (
            GPT2LMHeadModel,
            GPT2Config(n_embd=HIDDEN, n_layer=2, n_head=4, n_positions=256, **common),
        ),
        "opt": (
            OPTForCausalLM,
            OPTConfig(
                hidden_size=HIDDEN,
                word_embed_proj_dim=HIDDEN,
                ffn_dim=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                max_position_embeddings=256,
                pad_token_id=0,
                **common,
            ),
        ),
        # BLOOM takes no position ids: ALiBi comes from the attention mask.
        "bloom": (BloomForCausalLM, BloomConfig(hidden_size=HIDDEN, n_layer=2, n_head=4, **common)),
    }


def randomize(model: Any, std: float) -> None:
    """Larger weights than the default init, so logits are far from uniform (no near-ties)."""
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, std)


def random_causal(family: str) -> Any:
    """A tiny random causal LM of ``family`` (``causal_configs``), weights randomized."""
    cls, config = causal_configs()[family]
    torch.manual_seed(0)
    model = cls(config)
    randomize(model, 0.15)
    return model


def random_seq2seq(family: str) -> Any:
    """A tiny random ``t5`` (pad 0 = decoder start, EOS 1) or ``bart`` (decoder start 2,
    absolute decoder positions), weights randomized."""
    torch.manual_seed(0)
    if family == "t5":
        model: Any = T5ForConditionalGeneration(
            T5Config(
                vocab_size=VOCAB,
                d_model=HIDDEN,
                d_kv=16,
                d_ff=128,
                num_layers=2,
                num_decoder_layers=2,
                num_heads=4,
                eos_token_id=1,
                pad_token_id=0,
                decoder_start_token_id=0,
            )
        )
    else:
        model = BartForConditionalGeneration(
            BartConfig(
                vocab_size=VOCAB,
                d_model=HIDDEN,
                encoder_layers=2,
                decoder_layers=2,
                encoder_attention_heads=4,
                decoder_attention_heads=4,
                encoder_ffn_dim=128,
                decoder_ffn_dim=128,
                max_position_embeddings=256,
                bos_token_id=0,
                pad_token_id=1,
                eos_token_id=2,
                decoder_start_token_id=2,
                forced_bos_token_id=None,
                forced_eos_token_id=None,
            )
        )
    randomize(model, 0.3)
    return model
