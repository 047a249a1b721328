"""Fixtures for the shard tests: tiny random Llama checkpoints and a router stand-in."""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterable, Mapping
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tgis.shard.config import ShardConfig
from tgis.shard.loader import load_runner
from tgis.shard.native.runtime.model_runner import ModelRunner
from tgis.shard_api.messages import (
    DetailOptions,
    NewSequence,
    SamplingParams,
    ScheduledSequence,
    StepOutput,
    StepPlan,
)

VOCAB = 256
EOS = 2
NUM_BLOCKS = 64


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


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    """One tiny random Llama for the whole session."""
    path = tmp_path_factory.mktemp("tiny-llama")
    return TinyModel(path, build_tiny_llama(path))


@pytest.fixture
def make_runner(tiny_model: TinyModel) -> Callable[..., ModelRunner]:
    """A fresh ModelRunner on the tiny model (other ShardConfig fields as keywords)."""

    def make(**kwargs: object) -> ModelRunner:
        kwargs.setdefault("kv_cache_blocks", NUM_BLOCKS)
        return load_runner(ShardConfig(model_name=str(tiny_model.path), **kwargs))  # type: ignore[arg-type]

    return make


@pytest.fixture
def runner(make_runner: Callable[..., ModelRunner]) -> ModelRunner:
    """A fresh ModelRunner on the tiny model."""
    return make_runner()


class Router:
    """What the real router does for the shard: block allocation and Step plans.

    Blocks come from a shuffled free list, so block tables are never contiguous and freed
    blocks (with stale keys/values) are reused.
    """

    def __init__(self, runner: ModelRunner, seed: int = 0) -> None:
        self.runner = runner
        self.block_size = runner.info.block_size
        self.free = list(range(runner.info.num_blocks))
        random.Random(seed).shuffle(self.free)
        self.tables: dict[int, list[int]] = {}
        self.computed: dict[int, int] = {}
        self.pending: list[NewSequence] = []
        self.generated: dict[int, list[int]] = {}
        self.outputs: list[StepOutput] = []
        self.step_id = 0
        self._finished: list[int] = []
        self._preempted: list[int] = []
        # Leading blocks borrowed from another sequence (a prefix-cache hit), by request.
        self.shared: dict[int, int] = {}
        self._cached: dict[int, int] = {}

    def add(
        self,
        request_id: int,
        prompt: Iterable[int],
        sampling: SamplingParams | None = None,
        details: DetailOptions | None = None,
        prefix_id: str = "",
        prefix_length: int = 0,
        adapter_id: str = "",
    ) -> None:
        """Announce a sequence with the next step (with a prompt-tuning prefix or adapter,
        the schedule's counts include its ``prefix_length`` virtual tokens)."""
        self.pending.append(
            NewSequence(
                request_id,
                tuple(prompt),
                sampling or SamplingParams(),
                details or DetailOptions(),
                prefix_id=prefix_id,
                prefix_length=prefix_length,
                adapter_id=adapter_id,
            )
        )
        self.tables[request_id] = []
        self.computed[request_id] = 0
        self.generated[request_id] = []

    def share(self, request_id: int, source_id: int, num_blocks: int) -> None:
        """Give a sequence not yet computed ``source_id``'s first ``num_blocks`` blocks as
        a prefix-cache hit: its next step starts after them (``cached_tokens``)."""
        assert self.computed[request_id] == 0 and not self.tables[request_id]
        self.tables[request_id] = self.tables[source_id][:num_blocks]
        self.shared[request_id] = num_blocks
        self.computed[request_id] = self._cached[request_id] = num_blocks * self.block_size

    def finish(self, request_id: int) -> None:
        """Free the sequence's blocks (not borrowed ones); the shard forgets it with the
        next step."""
        self.free.extend(self.tables.pop(request_id)[self.shared.pop(request_id, 0) :])
        self._finished.append(request_id)

    def preempt(self, request_id: int) -> None:
        """Take the sequence's blocks back; the shard drops its block table with the next
        step, and it is resumed by scheduling all its known tokens again from position 0."""
        self.free.extend(self.tables[request_id][self.shared.pop(request_id, 0) :])
        self.tables[request_id] = []
        self.computed[request_id] = 0
        self._preempted.append(request_id)

    def step(self, schedule: Mapping[int, int]) -> StepOutput:
        """Run one Step computing ``schedule[rid]`` tokens of each listed sequence."""
        scheduled = []
        for rid, n in schedule.items():
            need = math.ceil((self.computed[rid] + n) / self.block_size) - len(self.tables[rid])
            blocks = [self.free.pop() for _ in range(max(need, 0))]
            self.tables[rid].extend(blocks)
            self.computed[rid] += n
            cached = self._cached.pop(rid, 0)
            if cached:  # the first step after a hit sends the whole table
                blocks = list(self.tables[rid])
            scheduled.append(ScheduledSequence(rid, n, tuple(blocks), cached))
        self.step_id += 1
        plan = StepPlan(
            step_id=self.step_id,
            new_sequences=tuple(self.pending),
            scheduled=tuple(scheduled),
            finished_request_ids=tuple(self._finished),
            preempted_request_ids=tuple(self._preempted),
        )
        self.pending, self._finished, self._preempted = [], [], []
        output = self.runner.step(plan)
        for sampled in output.tokens:
            self.generated[sampled.request_id].append(sampled.token.token_id)
        self.outputs.append(output)
        return output

    def decode(self, request_ids: Iterable[int]) -> StepOutput:
        """One decode step of each listed sequence."""
        return self.step({rid: 1 for rid in request_ids})

    def speculate(self, drafts: Mapping[int, SequenceOf[int] | int]) -> StepOutput:
        """One decode step of each listed sequence with its drafted tokens (none: a plain
        decode), or with a number of tokens for the shard's draft model to draft; blocks are
        reserved for them all, and each sequence's computed count then advances by the
        tokens it got."""
        scheduled = []
        for rid, drafted in drafts.items():
            spec = drafted if isinstance(drafted, int) else 0
            ids = () if isinstance(drafted, int) else tuple(drafted)
            n = 1 + len(ids)
            need = math.ceil((self.computed[rid] + n + spec) / self.block_size)
            blocks = [self.free.pop() for _ in range(max(need - len(self.tables[rid]), 0))]
            self.tables[rid].extend(blocks)
            scheduled.append(ScheduledSequence(rid, n, tuple(blocks), 0, ids, spec))
        self.step_id += 1
        plan = StepPlan(step_id=self.step_id, new_sequences=(), scheduled=tuple(scheduled))
        output = self.runner.step(plan)
        for sampled in output.tokens:
            self.generated[sampled.request_id].append(sampled.token.token_id)
            self.computed[sampled.request_id] += 1
        self.outputs.append(output)
        return output


@pytest.fixture
def router(runner: ModelRunner) -> Router:
    """A router stand-in driving a fresh runner."""
    return Router(runner)
