"""The CPU shard's warm-up before its first request: a prefill step of the size a burst of
requests brings, so that its first-time costs are not paid by the first users.

The first prefill step of a few hundred tokens on a fresh CPU shard takes about three
times as long as the next ones: oneDNN builds a primitive per weight shape, row bucket and
thread count (``linear/cpu_gemm.py``), and the attention, the allocator and the sampler
meet their first large shapes. On the 8 x 1024 model (bfloat16) the first 512-token step
took 269 ms and the next ones 88-94 ms; after this warm-up the first took 75 ms. So the
runner computes one step of ``WARM_UP_TOKENS`` prompt tokens (at most the prefill budget,
in prompts of ``WARM_UP_PROMPT`` tokens, at the thread count the thread policy gives such
a step) and forgets it, then builds the GEMM primitives of the buckets just above it,
which the budget's steps reach with the decodes that run beside their prompts.

The router's prefill budget on a CPU shard is 512 tokens unless configured
(``--max-batch-prefill-tokens``); a larger configured budget is warmed up to 512 only.
Models with recurrent state (their slots are few) and GPU shards (``cuda_capacity.py``
runs their warm-up) are skipped.
"""

from __future__ import annotations

import logging
import time

import torch

from tgis.shard.capacity import blocks_for
from tgis.shard.native.linear.cpu_gemm import build_primitives, padded_rows
from tgis.shard.native.linear.sharded import RowLinear
from tgis.shard.native.loading.cuda_capacity import PlanBuilder
from tgis.shard.native.models.decoder import DecoderLM
from tgis.shard.native.runtime.model_runner import ModelRunner
from tgis.shard_api.messages import StepPlan

log = logging.getLogger(__name__)

WARM_UP_TOKENS = 512
"""Prompt tokens of the warm-up step: the router's default prefill budget on a CPU shard."""
WARM_UP_PROMPT = 128
"""Tokens of each warm-up prompt."""
DECODES_BESIDE = 64
"""Decode rows a budget-sized step may carry, whose row buckets are built too."""


def warm_up_cpu(runner: ModelRunner, max_prefill_tokens: int, max_sequence_length: int) -> None:
    """Run the warm-up (module docstring) on a CPU runner; a no-op elsewhere."""
    if runner.device.type != "cpu" or runner.states is not None:
        return
    wanted = min(max_prefill_tokens, WARM_UP_TOKENS)
    prompt = min(WARM_UP_PROMPT, max_sequence_length - 1, wanted)
    if prompt < 1:
        return
    block_size = runner.kv_cache.block_size
    count = min(wanted // prompt, runner.kv_cache.num_blocks // blocks_for(prompt, block_size))
    if count < 1:
        return
    started = time.monotonic()
    build = PlanBuilder(block_size, runner.info.vocab_size, prompt)
    new, scheduled = build.prompts(count * prompt, max_length=prompt)
    try:
        runner.step(StepPlan(1, tuple(new), tuple(scheduled)))
    finally:
        runner.reset()
    tokens = count * prompt
    built = 0
    if isinstance(runner.model, DecoderLM):
        model = runner.model
        # A row-parallel layer adds its bias after the reduce: its GEMM has none.
        linears = [
            (lin.weight, None if isinstance(lin, RowLinear) else lin.bias)
            for lin in model.linear_layers()
            if isinstance(lin.weight, torch.Tensor)
        ]
        linears.append((model.lm_head.weight, None))
        rows = range(tokens + 1, tokens + DECODES_BESIDE + 1)
        saved = torch.get_num_threads()
        if runner.threads is not None:  # the count such a step runs at
            torch.set_num_threads(runner.threads.for_step(tokens + DECODES_BESIDE, DECODES_BESIDE))
        try:
            built = build_primitives(linears, rows)
        finally:
            torch.set_num_threads(saved)
    log.info(
        "Warmed up with a %d-token prefill step (%d prompts) and %d GEMM shapes up to %d rows "
        "in %.2f s",
        tokens,
        count,
        built,
        padded_rows(tokens + DECODES_BESIDE),
        time.monotonic() - started,
    )
