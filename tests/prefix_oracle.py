"""The oracle for prompt-tuning prefixes: transformers' greedy continuation of
``inputs_embeds = concat(prefix, embed(ids))``, which is what TGIS computes for a
``prefix_id``."""

from __future__ import annotations

from typing import Any

import torch


def prefixed_greedy(
    hf: Any, prefix: torch.Tensor | None, ids: list[int], new_tokens: int
) -> tuple[list[int], list[torch.Tensor]]:
    """The greedy token ids after ``prefix`` (None: none) and ``ids``, and the raw logits
    of each step (float32)."""
    with torch.no_grad():
        embeds = hf.get_input_embeddings()(torch.tensor([ids]))
        if prefix is not None:
            embeds = torch.cat([prefix.unsqueeze(0).to(embeds.dtype), embeds], dim=1)
        out = hf.generate(
            inputs_embeds=embeds,
            attention_mask=torch.ones(embeds.shape[:2], dtype=torch.long),
            do_sample=False,
            max_new_tokens=new_tokens,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    tokens = out.sequences[0, -new_tokens:].tolist()
    return tokens, [step[0].float() for step in out.logits]
