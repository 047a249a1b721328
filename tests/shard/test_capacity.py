"""KV capacity: the configured CPU budget, the GPU warm-up measurement and its arithmetic."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from tests.shard.models import TinyModel
from tgis.shard.capacity import CPU_KV_CACHE_BYTES, available_memory, configured_blocks
from tgis.shard.config import ShardConfig
from tgis.shard.errors import StartupError
from tgis.shard.loader import load_runner
from tgis.shard.native.loading import cuda_capacity as capacity
from tgis.shard.native.loading.cuda_capacity import (
    MemoryReading,
    kv_budget_bytes,
    measure_cuda_blocks,
    warm_up,
    warmup_plans,
)
from tgis.shard.native.runtime.model_runner import ModelRunner

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
    # The prompt-prefix cache's memory is held back from the KV cache (TGIS).
    assert kv_budget_bytes(reading, 1.0, 20, held_back=GIB // 2) == 48 * GIB - 3 * GIB - GIB // 2
    assert kv_budget_bytes(reading, 1.0, 99, held_back=GIB) == 0


def test_warmup_plans_cover_the_prefill_budget_and_a_full_batch_next_to_it() -> None:
    plan = warmup_plans(1000, 300, 8, 16, 256)
    prefill, mixed = plan.steps
    lengths = [s.num_tokens for s in prefill.scheduled]
    assert sum(lengths) == 1000 and max(lengths) == 299
    assert all(n.details.input_tokens for n in prefill.new_sequences)
    # The mixed step: the 4 prefilled sequences decode, 4 one-token prompts fill the batch of
    # 8, and a fresh 1000-token chunk runs next to them.
    prefilled = {s.request_id for s in prefill.scheduled}
    decodes = [s for s in mixed.scheduled if s.request_id in prefilled]
    fresh = [s for s in mixed.scheduled if s.request_id not in prefilled]
    assert [s.num_tokens for s in decodes] == [1] * 4
    assert sorted(s.num_tokens for s in fresh) == [1, 1, 1, 1, 103, 299, 299, 299]
    assert {n.request_id for n in mixed.new_sequences} == {s.request_id for s in fresh}
    # Every block id is handed out once, and a decode gets a block only when it crosses one.
    ids = [b for step in plan.steps for s in step.scheduled for b in s.new_block_ids]
    assert sorted(ids) == list(range(plan.num_blocks))
    grown = {s.request_id: len(s.new_block_ids) for s in decodes}
    assert grown == {s.request_id: int(s.num_tokens % 16 == 0) for s in prefill.scheduled}
    tokens = [t for step in plan.steps for n in step.new_sequences for t in n.prompt_token_ids]
    assert all(2 < t < 256 for t in tokens)
    assert all(n.sampling.top_k and n.details.top_n for n in mixed.new_sequences)


def test_warmup_plans_with_a_batch_smaller_than_the_prefilled_sequences() -> None:
    plan = warmup_plans(63, 8, 3, 4, 100)
    prefill, mixed = plan.steps
    assert len(prefill.scheduled) == 9  # 63 tokens in prompts of at most 7
    assert sum(1 for s in mixed.scheduled if s.num_tokens == 1) == 3
    assert sum(s.num_tokens for s in mixed.scheduled) == 3 + 63
    ids = [b for step in plan.steps for s in step.scheduled for b in s.new_block_ids]
    assert sorted(ids) == list(range(plan.num_blocks))  # no block handed out unused


def test_warm_up_runs_every_step_on_the_model(
    make_runner: Callable[..., ModelRunner],
) -> None:
    runner = make_runner()
    plan = warmup_plans(40, 32, 6, runner.kv_cache.block_size, runner.info.vocab_size)
    prefill, mixed = warm_up(
        runner.model, runner.kv_cache.spec, runner.attention, runner.info,
        torch.device("cpu"), plan,
    )  # fmt: skip
    # Every sequence whose prompt completed sampled a token, with the details asked for.
    assert len(prefill.tokens) == len(plan.steps[0].scheduled) == 2  # prompts of 31 and 9
    assert len(mixed.tokens) == 2 + 4 + 2  # the decodes, 4 one-token prompts, the chunk
    assert all(len(t.token.top_tokens) == 10 for t in mixed.tokens)
    assert [len(d.tokens) for d in prefill.input_tokens] == [31, 9]


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
        max_prefill_tokens=300, max_sequence_length=128, max_batch_size=16,
        memory_fraction=1.0, safety_margin=20,
    )  # fmt: skip
    warm_blocks = warmup_plans(300, 128, 16, spec.block_size, info.vocab_size).num_blocks
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
    with pytest.raises(
        StartupError, match=r"--max-batch-size next to another\): lower them"
    ) as info:
        measure_cuda_blocks(
            runner.model, runner.kv_cache.spec, runner.attention, runner.info,
            torch.device("cpu"), max_prefill_tokens=64, max_sequence_length=64,
            max_batch_size=8, memory_fraction=1.0, safety_margin=0,
        )  # fmt: skip
    assert "\n" not in str(info.value)
