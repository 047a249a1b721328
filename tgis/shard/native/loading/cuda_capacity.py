"""How many KV-cache blocks fit on a GPU: the native engine's measured capacity.

Unless ``TGIS_KV_CACHE_BLOCKS`` fixes it (``tgis.shard.capacity``, which also holds the
configured budget of the CPU and the rule that one sequence must fit), the capacity is
measured once at start-up: ``warm_up`` runs the steps of ``warmup_plans`` with a temporary
cache, recording the peak memory of their activations: a prefill of
``--max-batch-prefill-tokens`` tokens whose every position asks for input-token details
(logits of the whole chunk), then the largest mixed step the router can send:
``--max-batch-size`` sequences producing a token (the prefilled ones decoding over their
long contexts, the rest one-token prompts) next to another full prefill chunk, every
sequence sampled with top-k, top-p, typical-p, a repetition penalty and top-n details (the
sampler's largest buffers). Then ``kv_budget_bytes`` takes the memory this process may
still use (the device's free memory, and at most ``--cuda-process-memory-fraction`` of its
total, already set as torch's per-process limit), holds back ``--batch-safety-margin``
percent of it, subtracts the activation peak, and divides by the bytes of one block. The
result is capped by ``--max-batch-total-tokens`` when given. With tensor parallelism every
rank measures and the smallest count wins (``loader``). A model with recurrent state
(Mamba layers) warms up on its state slots (allocated before, so not in the budget), its
mixed step no larger than the slots allow (``slotted``).
"""

from __future__ import annotations

import gc
from dataclasses import dataclass, replace
from typing import TypedDict, Unpack

import torch

from tgis.shard.capacity import blocks_for
from tgis.shard.errors import StartupError
from tgis.shard.native.attention.interface import AttentionBackend
from tgis.shard.native.attention.kv_cache import KVCache, KVCacheSpec
from tgis.shard.native.models import CausalLM, ForwardFn
from tgis.shard.native.models.recurrent_state import RecurrentStates
from tgis.shard.native.runtime.model_runner import ModelRunner
from tgis.shard_api.messages import (
    DetailOptions,
    NewSequence,
    SamplingParams,
    ScheduledSequence,
    ShardInfo,
    StepOutput,
    StepPlan,
)


@dataclass(frozen=True)
class MemoryReading:
    """Device memory after the warm-up (bytes), with its temporary cache freed."""

    free: int  # the device's free memory (torch.cuda.mem_get_info)
    total: int  # the device's total memory
    reserved: int  # what this process's allocator holds now (weights, ...)
    allocated: int  # tensors alive now (weights, ...)
    peak: int  # torch.cuda.max_memory_allocated during the warm-up
    warmup_cache: int  # bytes of the temporary KV cache the warm-up used


def kv_budget_bytes(
    reading: MemoryReading, memory_fraction: float, safety_margin: int, held_back: int = 0
) -> int:
    """Bytes the KV cache may take (see the module docstring); never negative.
    ``held_back``: memory kept for something else, the prompt-prefix cache
    (``PROMPT_CACHE_SIZE_MB``, as TGIS subtracts it)."""
    activations = max(reading.peak - reading.allocated - reading.warmup_cache, 0)
    process_left = int(reading.total * memory_fraction) - reading.reserved
    available = max(min(reading.free, process_left), 0)
    return max(available * (100 - safety_margin) // 100 - activations - held_back, 0)


WARMUP_SAMPLING = SamplingParams(
    temperature=0.7, top_k=50, top_p=0.9, typical_p=0.95, seed=0, repetition_penalty=1.1
)
"""Every warm-up sequence samples with every processor on (the sampler's largest path)."""
WARMUP_DETAILS = DetailOptions(
    logprobs=True, ranks=True, top_n=10, input_tokens=True, generated_tokens=True
)


@dataclass(frozen=True)
class WarmUpPlan:
    """The steps the warm-up runs, in order, and the blocks of the cache they need."""

    steps: tuple[StepPlan, ...]
    num_blocks: int


class PlanBuilder:
    """Hands out request ids, prompts and consecutive block ids for the warm-up steps (this
    module's, and the CPU shard's, ``cpu_warmup.py``)."""

    def __init__(self, block_size: int, vocab_size: int, max_prompt: int) -> None:
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.max_prompt = max_prompt
        self.next_block = 0
        self.next_id = 0
        self.lengths: dict[int, int] = {}

    def blocks(self, count: int) -> tuple[int, ...]:
        ids = tuple(range(self.next_block, self.next_block + count))
        self.next_block += count
        return ids

    def prompts(
        self, num_tokens: int, *, max_length: int
    ) -> tuple[list[NewSequence], list[ScheduledSequence]]:
        """Fresh sequences of at most ``max_length`` tokens, ``num_tokens`` in all."""
        new: list[NewSequence] = []
        scheduled: list[ScheduledSequence] = []
        while num_tokens > 0:
            length = min(num_tokens, max_length)
            rid, self.next_id = self.next_id, self.next_id + 1
            span = max(self.vocab_size - 3, 1)
            ids = tuple(3 + (rid + p) % span for p in range(length))
            new.append(NewSequence(rid, ids, WARMUP_SAMPLING, WARMUP_DETAILS))
            blocks = self.blocks(blocks_for(length, self.block_size))
            scheduled.append(ScheduledSequence(rid, length, blocks))
            self.lengths[rid] = length
            num_tokens -= length
        return new, scheduled

    def decode(self, rid: int) -> ScheduledSequence:
        """One more token for a sequence prefilled before (a block if it needs one)."""
        length = self.lengths[rid]
        grows = blocks_for(length + 1, self.block_size) - blocks_for(length, self.block_size)
        self.lengths[rid] = length + 1
        return ScheduledSequence(rid, 1, self.blocks(grows))


def warmup_plans(
    max_prefill_tokens: int,
    max_sequence_length: int,
    max_batch_size: int,
    block_size: int,
    vocab_size: int,
) -> WarmUpPlan:
    """The warm-up steps (see the module docstring): prompts no longer than a request's can
    be (``max_sequence_length - 1``), and a second step of ``max_batch_size`` sampling
    sequences next to a fresh prefill chunk of ``max_prefill_tokens``."""
    build = PlanBuilder(block_size, vocab_size, max(1, max_sequence_length - 1))
    longest = build.max_prompt
    new, scheduled = build.prompts(max_prefill_tokens, max_length=longest)
    prefill = StepPlan(step_id=1, new_sequences=tuple(new), scheduled=tuple(scheduled))
    decodes = [build.decode(s.request_id) for s in scheduled[:max_batch_size]]
    new_ones, one_token = build.prompts(max(max_batch_size - len(decodes), 0), max_length=1)
    new_chunk, chunk = build.prompts(max_prefill_tokens, max_length=longest)
    mixed = StepPlan(
        step_id=2,
        new_sequences=tuple(new_ones + new_chunk),
        scheduled=tuple(decodes + one_token + chunk),
        base_step_id=1,
    )
    return WarmUpPlan((prefill, mixed), build.next_block)


def warm_up(
    model: CausalLM,
    spec: KVCacheSpec,
    attention: AttentionBackend,
    info: ShardInfo,
    device: torch.device,
    plan: WarmUpPlan,
    forward: ForwardFn | None = None,
    states: RecurrentStates | None = None,
) -> list[StepOutput]:
    """Run ``plan``'s steps through a throw-away runner and cache (on ``states``' slots,
    for a model with recurrent state); their outputs."""
    cache = KVCache(spec, plan.num_blocks, device)
    info = replace(info, num_blocks=plan.num_blocks)
    runner = ModelRunner(model, cache, attention, info, device, forward, states=states)
    steps = plan.steps if states is None else slotted(plan.steps, states.num_slots)
    outputs = []
    for step in steps:
        output = runner.step(step)
        if output.errors:
            raise RuntimeError(f"warm-up step {step.step_id} failed: {output.errors[0].message}")
        outputs.append(output)
    del runner, cache
    gc.collect()
    return outputs


def slotted(steps: tuple[StepPlan, ...], num_slots: int) -> tuple[StepPlan, ...]:
    """``steps`` with a state slot for each sequence, taken at its first step and kept
    (the warm-up's sequences never end); ValueError if they need more than ``num_slots``."""
    slot_of: dict[int, int] = {}
    result = []
    for step in steps:
        scheduled = []
        for s in step.scheduled:
            slot = slot_of.setdefault(s.request_id, len(slot_of))
            if slot >= num_slots:
                raise ValueError(f"the warm-up needs more than {num_slots} state slots")
            scheduled.append(replace(s, state_slot=slot))
        result.append(replace(step, scheduled=tuple(scheduled)))
    return tuple(result)


class MeasureSettings(TypedDict):
    """The flags the GPU measurement follows (``measure_cuda_blocks``'s keywords)."""

    max_prefill_tokens: int  # --max-batch-prefill-tokens: each warm-up prefill chunk
    max_sequence_length: int  # the longest warm-up prompt is one token shorter
    max_batch_size: int  # sequences of the warm-up's mixed step
    memory_fraction: float  # --cuda-process-memory-fraction
    safety_margin: int  # --batch-safety-margin, percent


def measure_cuda_blocks(
    model: CausalLM,
    spec: KVCacheSpec,
    attention: AttentionBackend,
    info: ShardInfo,
    device: torch.device,
    *,
    forward: ForwardFn | None = None,
    held_back: int = 0,
    states: RecurrentStates | None = None,
    **settings: Unpack[MeasureSettings],
) -> int:
    """The GPU measurement (see the module docstring); ``held_back`` bytes are left for the
    prompt-prefix cache; ``states``: a model's recurrent-state slots."""
    max_prefill_tokens, max_batch_size = settings["max_prefill_tokens"], settings["max_batch_size"]
    if states is not None:  # the router runs no more sequences than slots: nor does this
        chunk = blocks_for(max_prefill_tokens, max(1, settings["max_sequence_length"] - 1))
        max_batch_size = max(1, min(max_batch_size, states.num_slots - chunk))
    plan = warmup_plans(
        max_prefill_tokens,
        settings["max_sequence_length"],
        max_batch_size,
        spec.block_size,
        info.vocab_size,
    )
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    try:
        warm_up(model, spec, attention, info, device, plan, forward, states)
    except torch.cuda.OutOfMemoryError as e:
        raise StartupError(
            f"out of GPU memory in the warm-up (a prefill of --max-batch-prefill-tokens "
            f"{max_prefill_tokens} tokens, then {max_batch_size} sequences of "
            f"--max-batch-size next to another): lower them "
            f"({' '.join(str(e).split())[:200]})"
        ) from None
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    reading = MemoryReading(
        free=free,
        total=total,
        reserved=torch.cuda.memory_reserved(device),
        allocated=torch.cuda.memory_allocated(device),
        peak=peak,
        warmup_cache=plan.num_blocks * spec.bytes_per_block,
    )
    budget = kv_budget_bytes(
        reading, settings["memory_fraction"], settings["safety_margin"], held_back
    )
    return budget // spec.bytes_per_block
