"""The shard's state for one sequence between steps."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tgis.shard.adapters.lora_layout import LoraWeights
from tgis.shard.step.guided import Guide
from tgis.shard_api.messages import DetailOptions, SamplingParams, TokenDetail


@dataclass
class Sequence:
    """Token ids so far, how many are in the KV cache, where, and how to sample.

    ``token_ids`` is the prompt followed by every sampled token; a prompt-tuning prefix's
    virtual tokens start the prompt as placeholder ids, their embeddings in ``prefix``
    (``prefix_rows.py``). The first
    ``num_computed`` of them have their keys/values in the cache; the rest (the rest of a
    chunked prompt, or the token sampled last step) are computed by later steps.
    """

    request_id: int
    token_ids: list[int]
    prompt_len: int
    sampling: SamplingParams
    details: DetailOptions
    seed: int  # the random stream of a sampled sequence (sampling.stream_key)
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0
    # The prefix's (decoder) embeddings [virtual tokens, hidden] (None: no prefix).
    prefix: torch.Tensor | None = None
    # Encoder-decoder models only: the prefix's encoder rows (None: none). The placeholder
    # ids then stand for these rows first, then ``prefix``'s (``fallback/seq2seq.py``).
    encoder_prefix: torch.Tensor | None = None
    # Its LoRA adapter, on the model's device (None: none; ``native/linear/lora_rows.py``).
    lora: LoraWeights | None = None
    # Its guided-decoding matcher (None: unconstrained; ``guided.py``). It has consumed
    # every generated token, so a preempted sequence resumes with it as it was.
    guide: Guide | None = None
    # Prompt-token details gathered chunk by chunk until the prompt completes.
    input_details: list[TokenDetail] = field(default_factory=list)
    # Leading positions whose keys and values are in the draft model's cache (speculative
    # decoding with a draft model, ``native/speculation/draft_model.py``).
    draft_computed: int = 0
    # An MLP speculator's input: the position before the last known token and the target's
    # final hidden row there (``native/speculation/mlp_drafter.py``; None: none yet).
    draft_hidden: tuple[int, torch.Tensor] | None = None
    # Greedy without penalties (at most EOS masked by min_new_tokens): the sampler's fast path.
    plain_greedy: bool = field(init=False)

    def __post_init__(self) -> None:
        p = self.sampling
        self.plain_greedy = (
            p.is_greedy and not p.needs_history and not p.logit_bias and p.length_penalty is None
        )

    @property
    def num_generated(self) -> int:
        """Tokens sampled so far."""
        return len(self.token_ids) - self.prompt_len

    def preempt(self) -> None:
        """Drop the block table and the computed count (the router gave the blocks away);
        token ids, counters and the seed stay, so a recompute resumes the sequence."""
        self.block_table = []
        self.num_computed = 0
        self.draft_computed = 0
        self.draft_hidden = None
        self.input_details = []
