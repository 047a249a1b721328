"""The CPU thread policy (tgis/shard/cpu_threads.py): by the step's measured cost."""

from __future__ import annotations

import os

import pytest
import torch

from tests.shard.driving import Router
from tgis.shard.cpu_threads import (
    MIN_PARALLEL_SECONDS,
    ROUTER_SECONDS_PER_ROW,
    ROUTER_WORK_FACTOR,
    UNCALIBRATED_LARGE_FROM_TOKENS,
    CpuThreads,
    StepTiming,
    busy_host_seconds,
    cpu_threads,
)
from tgis.shard.native.runtime.model_runner import ModelRunner

# Step costs measured on a 2-core host (BENCHMARKS.md, "CPU thread policy"): the tiny
# 4 x 256 Llama and the ~90M 8 x 1024 one, float32, one thread.
TINY = StepTiming(one_token_s=1.9e-3, per_token_s=0.083e-3)
MID = StepTiming(one_token_s=21e-3, per_token_s=2.2e-3)


def test_timing_is_the_line_through_two_measured_steps() -> None:
    timing = StepTiming.from_two_steps(one_token_s=0.010, tokens=31, tokens_s=0.040)
    assert timing.per_token_s == pytest.approx(0.001)
    assert timing.estimate(1) == pytest.approx(0.010)
    assert timing.estimate(101) == pytest.approx(0.110)
    # A noisy measurement never makes more tokens cheaper.
    assert StepTiming.from_two_steps(0.010, 31, 0.009).per_token_s == 0.0


def test_a_preempted_measurement_counts_the_step_own_cpu_time() -> None:
    # Other processes held the core for most of an 8 ms wall: the step's cost is its 1 ms.
    assert busy_host_seconds(wall_s=0.008, cpu_s=0.001, threads=1) == pytest.approx(0.001)
    # Two threads, CPU time per thread over the wall time (spin-waits): the wall time.
    assert busy_host_seconds(wall_s=0.001, cpu_s=0.0024, threads=2) == pytest.approx(0.001)
    # Two threads, one preempted half the time: the CPU time per thread.
    assert busy_host_seconds(wall_s=0.004, cpu_s=0.005, threads=2) == pytest.approx(0.0025)


def test_small_model_decodes_keep_a_core_for_the_router() -> None:
    threads = CpuThreads(small=1, large=2, timing=TINY)
    for rows in (1, 8, 32, 64):
        assert threads.for_step(rows, rows) == 1
    # A long prompt is long enough for both cores.
    assert threads.for_step(128, 1) == 2
    assert threads.for_step(16, 0) == 1  # short chunk: under MIN_PARALLEL_SECONDS


def test_larger_model_steps_use_every_core() -> None:
    threads = CpuThreads(small=1, large=2, timing=MID)
    for rows in (1, 8, 32, 64, 256):
        assert threads.for_step(rows, rows) == 2


def test_the_router_work_bound() -> None:
    # A step of 10 ms, each sampled row costing the router ROUTER_SECONDS_PER_ROW.
    threads = CpuThreads(1, 2, StepTiming(one_token_s=0.010, per_token_s=0.0))
    limit = int(0.010 / (ROUTER_SECONDS_PER_ROW * ROUTER_WORK_FACTOR))
    assert threads.for_step(limit, limit) == 2
    assert threads.for_step(limit + 1, limit + 1) == 1
    fast = CpuThreads(1, 2, StepTiming(one_token_s=MIN_PARALLEL_SECONDS * 0.9, per_token_s=0))
    assert fast.for_step(1, 1) == 1


def test_before_calibration_and_with_one_choice() -> None:
    threads = CpuThreads(small=1, large=2)
    assert threads.for_step(UNCALIBRATED_LARGE_FROM_TOKENS - 1, 1) == 1
    assert threads.for_step(UNCALIBRATED_LARGE_FROM_TOKENS, 1) == 2
    assert CpuThreads(3, 3, TINY).for_step(1, 1) == 3


def test_thread_counts_from_cores_ranks_and_omp_num_threads() -> None:
    cores = len(os.sched_getaffinity(0))
    assert cpu_threads(1, {"OMP_NUM_THREADS": "3"}) == CpuThreads(3, 3)
    auto = cpu_threads(1, {"OMP_NUM_THREADS": ""})
    assert (auto.small, auto.large) == (max(1, cores - 1), cores)
    two_ranks = cpu_threads(2, {})
    assert two_ranks.large == max(1, cores // 2)


def test_the_runner_measures_its_model_and_switches_per_step(
    runner: ModelRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    runner.threads = CpuThreads(small=1, large=2)
    timing = runner.calibrate_cpu_threads()
    assert timing is not None and runner.threads.timing == timing
    assert 0 < timing.one_token_s < 1.0 and timing.per_token_s >= 0
    assert not runner.sequences  # the measuring steps are forgotten
    # Force a cost where the prompt step is long and decodes are short.
    runner.threads = CpuThreads(1, 2, StepTiming(one_token_s=0.001, per_token_s=0.001))
    seen: list[int] = []
    monkeypatch.setattr(torch, "set_num_threads", seen.append)
    monkeypatch.setattr(torch, "get_num_threads", lambda: seen[-1] if seen else 0)
    router = Router(runner)
    router.add(1, list(range(3, 40)))
    router.step({1: 37})  # estimated 37 ms: every core
    router.decode([1])  # 1 ms: one thread
    assert seen == [2, 1]
    runner.threads = CpuThreads(2, 2)
    assert runner.calibrate_cpu_threads() is None
