"""KV capacity: the configured CPU budget, the GPU warm-up measurement and its arithmetic."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from conftest import TinyModel

from tgis.shard import capacity
from tgis.shard.capacity import (
    CPU_KV_CACHE_BYTES,
    MemoryReading,
    available_memory,
    configured_blocks,
    kv_budget_bytes,
    measure_cuda_blocks,
    warm_up,
    warmup_plan,
)
from tgis.shard.config import ShardConfig
from tgis.shard.errors import StartupError
from tgis.shard.loader import load_runner
from tgis.shard.model_runner import ModelRunner

GIB = 1 << 30


def test_configured_budget_order() -> None:
    kwargs: dict[str, int | None] = dict(
        max_batch_size=4, max_sequence_length=100, bytes_per_block=1024
    )
    assert configured_blocks(16, max_batch_total_tokens=None, override=None, **kwargs) == 4 * 7  # type: ignore[arg-type]
    assert configured_blocks(16, max_batch_total_tokens=None, override=9, **kwargs) == 9  # type: ignore[arg-type]
    assert configured_blocks(16, max_batch_total_tokens=200, override=9, **kwargs) == 13  # type: ignore[arg-type]
    # By capacity: 1 GiB (or a quarter of the available memory), at least one sequence.
    kwargs["max_batch_size"] = None
    by_capacity = configured_blocks(16, max_batch_total_tokens=None, override=None, **kwargs)  # type: ignore[arg-type]
    assert by_capacity == min(CPU_KV_CACHE_BYTES, available_memory() // 4) // 1024
    kwargs["bytes_per_block"] = 1 << 40
    assert configured_blocks(16, max_batch_total_tokens=None, override=None, **kwargs) == 7  # type: ignore[arg-type]


def test_kv_budget_arithmetic() -> None:
    reading = MemoryReading(
        free=60 * GIB, total=80 * GIB, reserved=16 * GIB, allocated=16 * GIB,
        peak=16 * GIB + 1 * GIB + 3 * GIB, warmup_cache=1 * GIB,
    )  # fmt: skip
    # Free memory limits: 60 GiB less 20 % held back, less 3 GiB of activations.
    assert kv_budget_bytes(reading, 1.0, 20) == 48 * GIB - 3 * GIB
    # The process fraction limits: 0.5 × 80 − 16 = 24 GiB, less 10 %, less 3 GiB.
    assert kv_budget_bytes(reading, 0.5, 10) == int(24 * GIB * 0.9) - 3 * GIB
    assert kv_budget_bytes(reading, 0.2, 0) == 0  # the weights alone exceed the fraction
    assert kv_budget_bytes(reading, 1.0, 99) == 0  # never negative


def test_warmup_plan_covers_the_prefill_budget() -> None:
    plan, blocks = warmup_plan(1000, 300, 16, 256)
    lengths = [s.num_tokens for s in plan.scheduled]
    assert sum(lengths) == 1000 and max(lengths) == 299
    assert blocks == sum(-(-n // 16) for n in lengths)
    ids = {b for s in plan.scheduled for b in s.new_block_ids}
    assert ids == set(range(blocks))
    assert all(0 < t < 256 for ns in plan.new_sequences for t in ns.prompt_token_ids)


def test_cpu_budget_from_max_batch_total_tokens(tiny_model: TinyModel) -> None:
    runner = load_runner(
        ShardConfig(
            model_name=str(tiny_model.path),
            max_sequence_length=256,
            max_batch_total_tokens=640,
            kv_cache_blocks=3,
        )
    )
    assert runner.info.num_blocks == 40
    with pytest.raises(StartupError, match="must be at least --max-sequence-length"):
        ShardConfig(max_sequence_length=256, max_batch_total_tokens=255).validate()
    with pytest.raises(StartupError, match="--max-batch-prefill-tokens"):
        ShardConfig(max_batch_prefill_tokens=0).validate()


def _fake_cuda(monkeypatch: pytest.MonkeyPatch, free: int, total: int, allocated: int) -> None:
    """torch.cuda's memory queries on a CPU run: the warm-up really runs (on the CPU); its
    peak is the weights plus 5 GiB (warm-up cache and activations)."""
    for name, fn in {
        "synchronize": lambda device=None: None,
        "empty_cache": lambda: None,
        "reset_peak_memory_stats": lambda device=None: None,
        "max_memory_allocated": lambda device=None: allocated + 5 * GIB,
        "mem_get_info": lambda device=None: (free, total),
        "memory_reserved": lambda device=None: allocated,
        "memory_allocated": lambda device=None: allocated,
    }.items():
        monkeypatch.setattr(torch.cuda, name, fn)


def test_gpu_measurement_runs_the_warm_up(
    make_runner: Callable[..., ModelRunner], monkeypatch: pytest.MonkeyPatch
) -> None:
    runner = make_runner()
    spec, info = runner.kv_cache.spec, runner.info
    ran: list[int] = []

    def counting_warm_up(*args: object) -> None:
        ran.append(1)
        warm_up(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(capacity, "warm_up", counting_warm_up)
    _fake_cuda(monkeypatch, free=40 * GIB, total=80 * GIB, allocated=10 * GIB)
    blocks = measure_cuda_blocks(
        runner.model, spec, runner.attention, info, torch.device("cpu"),
        max_prefill_tokens=300, max_sequence_length=128, memory_fraction=1.0, safety_margin=20,
    )  # fmt: skip
    _, warm_blocks = warmup_plan(300, 128, spec.block_size, info.vocab_size)
    activations = 5 * GIB - warm_blocks * spec.bytes_per_block
    assert ran == [1]
    assert blocks == (40 * GIB * 80 // 100 - activations) // spec.bytes_per_block


def test_warm_up_out_of_memory_is_a_one_line_startup_error(
    make_runner: Callable[..., ModelRunner], monkeypatch: pytest.MonkeyPatch
) -> None:
    runner = make_runner()

    def oom(*args: object) -> None:
        raise torch.cuda.OutOfMemoryError("CUDA out of memory.\nTried to allocate 2 GiB")

    monkeypatch.setattr(capacity, "warm_up", oom)
    _fake_cuda(monkeypatch, free=GIB, total=GIB, allocated=0)
    with pytest.raises(StartupError, match="lower it") as info:
        measure_cuda_blocks(
            runner.model, runner.kv_cache.spec, runner.attention, runner.info,
            torch.device("cpu"), max_prefill_tokens=64, max_sequence_length=64,
            memory_fraction=1.0, safety_margin=0,
        )  # fmt: skip
    assert "\n" not in str(info.value)
