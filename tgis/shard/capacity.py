"""How many KV-cache blocks a shard gets: the capacity it reports in ``Info.num_blocks``.

The router admits work by this capacity (and ``--max-batch-total-tokens`` if it is smaller),
so it is decided once at start-up, by rules both engines share:

* **configured** — on the CPU and in the transformers fallback: ``--max-batch-total-tokens``
  if given, else ``TGIS_KV_CACHE_BLOCKS``, else ``--max-batch-size`` sequences of
  ``max_sequence_length`` when that flag is set, else (by capacity) ``CPU_KV_CACHE_BYTES``
  of memory (1 GiB, or a quarter of the memory available if that is less), and always at
  least one sequence of ``max_sequence_length``; on a GPU, ``TGIS_KV_CACHE_BLOCKS`` when
  set (tests, benchmarks);
* **measured** — the native engine on a GPU otherwise (``native/loading/cuda_capacity.py``).

Either way one sequence of ``max_sequence_length`` tokens must fit, else start-up fails.
A model with recurrent state (Mamba layers) also gets its state slots here
(``configured_state_slots``).
"""

from __future__ import annotations

import math

from tgis.shard.errors import StartupError


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
    """The configured budget (see the module docstring)."""
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


def check_fits(num_blocks: int, block_size: int, max_sequence_length: int, where: str) -> None:
    """StartupError unless one sequence of ``max_sequence_length`` tokens fits."""
    needed = blocks_for(max_sequence_length, block_size)
    if num_blocks < needed:
        raise StartupError(
            f"not enough KV cache ({where}): {num_blocks} blocks of {block_size} tokens, one "
            f"sequence of --max-sequence-length {max_sequence_length} needs {needed}"
        )


DEFAULT_STATE_SLOTS = 256
"""Recurrent-state slots when --max-batch-size is unset (the router's default batch
ceiling, ``shard_api.messages.DEFAULT_MAX_BATCH_SIZE``)."""


def configured_state_slots(max_batch_size: int | None, bytes_per_slot: int, memory: int) -> int:
    """Recurrent-state slots of a model with Mamba layers: one per sequence of
    ``--max-batch-size`` (else ``DEFAULT_STATE_SLOTS``), as many as fit in a quarter of
    ``memory`` counting each twice (a step stages its sequences' new states beside their
    slots), at least one. The router runs at most this many sequences at once."""
    wanted = max_batch_size or DEFAULT_STATE_SLOTS
    fitting = memory // 4 // max(2 * bytes_per_slot, 1)
    return max(1, min(wanted, fitting))


def device_memory(device: object) -> int:
    """Memory free for the state slots: on CUDA the device's free memory now, elsewhere
    ``available_memory()``."""
    import torch

    if isinstance(device, torch.device) and device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    return available_memory()
