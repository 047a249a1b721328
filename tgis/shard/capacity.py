"""How many KV-cache blocks a shard gets: the capacity it reports in ``Info.num_blocks``.

The router admits work by this capacity (and ``--max-batch-total-tokens`` if it is smaller),
so it is measured once at start-up:

* **CPU** — a configured budget: ``--max-batch-total-tokens`` if given, else
  ``TGIS_KV_CACHE_BLOCKS``, else ``--max-batch-size`` sequences of ``max_sequence_length``
  when that flag is set, else (by capacity) ``CPU_KV_CACHE_BYTES`` of memory (1 GiB, or a
  quarter of the memory available if that is less), and always at least one sequence of
  ``max_sequence_length``.
* **GPU** — ``TGIS_KV_CACHE_BLOCKS`` if set (tests, benchmarks); otherwise measured:
  ``warm_up`` runs one prefill of ``--max-batch-prefill-tokens`` tokens (the largest step
  the router will send) with a temporary cache, recording the peak memory of its
  activations; then ``kv_budget_bytes`` takes the memory this process may still use (the
  device's free memory, and at most ``--cuda-process-memory-fraction`` of its total, already
  set as torch's per-process limit), holds back ``--batch-safety-margin`` percent of it,
  subtracts the activation peak, and divides by the bytes of one block. The result is
  capped by ``--max-batch-total-tokens`` when given. With tensor parallelism every rank
  measures and the smallest count wins (``loader``).

Either way one sequence of ``max_sequence_length`` tokens must fit, else start-up fails.
"""

from __future__ import annotations

import gc
import math
from dataclasses import dataclass, replace

import torch

from tgis.shard.attention import AttentionBackend
from tgis.shard.errors import StartupError
from tgis.shard.kv_cache import KVCache, KVCacheSpec
from tgis.shard.model_runner import ForwardFn, ModelRunner
from tgis.shard.models import CausalLM
from tgis.shard_api.messages import NewSequence, ScheduledSequence, ShardInfo, StepPlan


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold ``num_tokens`` KV entries."""
    return -(-num_tokens // block_size)


CPU_KV_CACHE_BYTES = 1 << 30
"""The CPU cache by capacity (no --max-batch-size, --max-batch-total-tokens or override)."""


def configured_blocks(
    block_size: int,
    *,
    max_batch_size: int | None,
    max_sequence_length: int,
    max_batch_total_tokens: int | None,
    override: int | None,
    bytes_per_block: int,
) -> int:
    """The CPU budget (see the module docstring)."""
    if max_batch_total_tokens is not None:
        return blocks_for(max_batch_total_tokens, block_size)
    if override is not None:
        return override
    per_sequence = math.ceil(max_sequence_length / block_size)
    if max_batch_size is not None:
        return max_batch_size * per_sequence
    budget = min(CPU_KV_CACHE_BYTES, available_memory() // 4)
    return max(budget // bytes_per_block, per_sequence)


def available_memory() -> int:
    """MemAvailable from /proc/meminfo in bytes (CPU_KV_CACHE_BYTES × 4 if unreadable)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 4 * CPU_KV_CACHE_BYTES


@dataclass(frozen=True)
class MemoryReading:
    """Device memory after the warm-up (bytes), with its temporary cache freed."""

    free: int  # the device's free memory (torch.cuda.mem_get_info)
    total: int  # the device's total memory
    reserved: int  # what this process's allocator holds now (weights, ...)
    allocated: int  # tensors alive now (weights, ...)
    peak: int  # torch.cuda.max_memory_allocated during the warm-up
    warmup_cache: int  # bytes of the temporary KV cache the warm-up used


def kv_budget_bytes(reading: MemoryReading, memory_fraction: float, safety_margin: int) -> int:
    """Bytes the KV cache may take (see the module docstring); never negative."""
    activations = max(reading.peak - reading.allocated - reading.warmup_cache, 0)
    process_left = int(reading.total * memory_fraction) - reading.reserved
    available = max(min(reading.free, process_left), 0)
    return max(available * (100 - safety_margin) // 100 - activations, 0)


def warmup_plan(
    max_prefill_tokens: int, max_sequence_length: int, block_size: int, vocab_size: int
) -> tuple[StepPlan, int]:
    """One step prefilling ``max_prefill_tokens`` tokens (in sequences no longer than a
    request's prompt can be) and the number of blocks it writes to."""
    per_sequence = max(1, min(max_prefill_tokens, max_sequence_length - 1))
    lengths = [per_sequence] * (max_prefill_tokens // per_sequence)
    if max_prefill_tokens % per_sequence:
        lengths.append(max_prefill_tokens % per_sequence)
    new: list[NewSequence] = []
    scheduled: list[ScheduledSequence] = []
    next_block = 0
    for rid, length in enumerate(lengths):
        ids = tuple(3 + (rid + p) % max(vocab_size - 3, 1) for p in range(length))
        count = blocks_for(length, block_size)
        new.append(NewSequence(rid, ids))
        scheduled.append(
            ScheduledSequence(rid, length, tuple(range(next_block, next_block + count)))
        )
        next_block += count
    return StepPlan(step_id=0, new_sequences=tuple(new), scheduled=tuple(scheduled)), next_block


def warm_up(
    model: CausalLM,
    spec: KVCacheSpec,
    attention: AttentionBackend,
    info: ShardInfo,
    device: torch.device,
    plan: StepPlan,
    num_blocks: int,
    forward: ForwardFn | None = None,
) -> None:
    """Run ``plan`` through a throw-away runner and cache of ``num_blocks`` blocks."""
    cache = KVCache(spec, num_blocks, device)
    runner = ModelRunner(
        model, cache, attention, replace(info, num_blocks=num_blocks), device, forward
    )
    runner.step(plan)
    del runner, cache
    gc.collect()


def measure_cuda_blocks(
    model: CausalLM,
    spec: KVCacheSpec,
    attention: AttentionBackend,
    info: ShardInfo,
    device: torch.device,
    *,
    max_prefill_tokens: int,
    max_sequence_length: int,
    memory_fraction: float,
    safety_margin: int,
    forward: ForwardFn | None = None,
) -> int:
    """The GPU measurement (see the module docstring)."""
    plan, warm_blocks = warmup_plan(
        max_prefill_tokens, max_sequence_length, spec.block_size, info.vocab_size
    )
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    try:
        warm_up(model, spec, attention, info, device, plan, warm_blocks, forward)
    except torch.cuda.OutOfMemoryError as e:
        raise StartupError(
            f"out of GPU memory in the warm-up prefill of --max-batch-prefill-tokens "
            f"{max_prefill_tokens} tokens: lower it ({' '.join(str(e).split())[:200]})"
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
        warmup_cache=warm_blocks * spec.bytes_per_block,
    )
    return kv_budget_bytes(reading, memory_fraction, safety_margin) // spec.bytes_per_block


def check_fits(num_blocks: int, block_size: int, max_sequence_length: int, where: str) -> None:
    """StartupError unless one sequence of ``max_sequence_length`` tokens fits."""
    needed = blocks_for(max_sequence_length, block_size)
    if num_blocks < needed:
        raise StartupError(
            f"not enough KV cache ({where}): {num_blocks} blocks of {block_size} tokens, one "
            f"sequence of --max-sequence-length {max_sequence_length} needs {needed}"
        )
