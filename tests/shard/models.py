"""The tiny random Llama most shard tests run, and its Hugging Face oracle (``TinyModel``).

The fixtures that build it once per session and load runners on it are in ``conftest.py``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB = 256
EOS = 2
NUM_BLOCKS = 64  # the KV blocks of the runners the fixtures load


def build_tiny_llama(path: Path, seed: int = 0, **overrides: Any) -> LlamaForCausalLM:
    """A random float32 Llama with GQA (4 query heads, 2 KV heads), saved to ``path``."""
    params: dict[str, Any] = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rope_theta=5000.0,
        tie_word_embeddings=False,
        eos_token_id=EOS,
        bos_token_id=1,
    )
    params.update(overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**params)).eval()
    # Larger weights than the default init, so logits are far from uniform (no near-ties).
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.15)
    model.save_pretrained(path)
    model.generation_config.eos_token_id = None  # the reference never stops early
    return model


@dataclass
class TinyModel:
    """A saved tiny model and its Hugging Face reference."""

    path: Path
    hf: LlamaForCausalLM
    _cache: dict[tuple[int, ...], tuple[list[int], list[torch.Tensor]]] = field(
        default_factory=dict
    )

    def greedy(
        self, prompt: Iterable[int], max_new_tokens: int
    ) -> tuple[list[int], list[torch.Tensor]]:
        """HF's greedy continuation of ``prompt`` alone and the raw logits of each step."""
        key = (*prompt, -max_new_tokens)
        if key not in self._cache:
            ids = torch.tensor([list(prompt)])
            with torch.no_grad():
                out: Any = self.hf.generate(  # type: ignore[misc]
                    ids,
                    attention_mask=torch.ones_like(ids),
                    do_sample=False,
                    max_new_tokens=max_new_tokens,
                    output_logits=True,
                    return_dict_in_generate=True,
                    pad_token_id=0,
                )
            tokens = out.sequences[0, ids.shape[1] :].tolist()
            assert len(tokens) == max_new_tokens
            self._cache[key] = (tokens, [step[0].float() for step in out.logits])
        return self._cache[key]

    def prompt_logits(self, prompt: Iterable[int]) -> torch.Tensor:
        """HF's logits at every position of ``prompt`` [len, vocab]."""
        with torch.no_grad():
            return self.hf(torch.tensor([list(prompt)])).logits[0].float()
