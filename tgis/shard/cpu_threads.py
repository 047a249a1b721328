"""How many intra-op threads a CPU shard gives each step, decided from the step's cost.

The router works while the shard computes (steps overlap), and on a small machine the two
share the cores. A step gets every core of its rank when it is long enough that the
router's share of the step's time is small: then a second thread roughly halves the
matrix multiplications, and the router's brief preemptions of it cost little. A step that
is short next to the router's work for it (the decodes of a small model, where the router
detokenizes and streams one token per row) keeps one core free for the router instead: a
second thread that the router keeps preempting holds back every GEMM of the step.

The step's length is not guessed from token counts: ``StepTiming`` is measured at start-up
on the loaded model, dtype and machine (``ModelRunner.calibrate_cpu_threads``: a one-token
decode and a prompt, on the reduced thread count), and a step is estimated as the
one-token time plus the per-token time for every further token. A measured step counts
its CPU time per thread when that is less than its wall time (``busy_host_seconds``): a
shard that starts while other processes keep the cores busy would otherwise take its
decodes for long steps and give them every core, which on a busy host is what slows
them most. ``OMP_NUM_THREADS`` fixes
the count for every step. Tensor-parallel ranks on the CPU split the cores between them,
each rank deciding for itself.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

# The router's CPU time per sampled row of a step (detokenize, stop checks, one streamed
# message), measured by benchmarks/router_only.py (BENCHMARKS.md: 51-60 µs per token).
ROUTER_SECONDS_PER_ROW = 60e-6
# A step uses every core once its estimated single-thread time is at least this many times
# the router's work for it ...
ROUTER_WORK_FACTOR = 4.0
# ... and at least this long: below it, thread wake-ups and the router's scheduling noise
# cost more than a second thread gains.
MIN_PARALLEL_SECONDS = 4e-3
# Before the start-up measurement: steps of this many tokens or more use every core.
UNCALIBRATED_LARGE_FROM_TOKENS = 512


@dataclass(frozen=True)
class StepTiming:
    """A step's measured single-thread time on this model: ``one_token_s`` for a step of
    one token (weights read once, fixed overheads), plus ``per_token_s`` for each further
    token computed in the same step."""

    one_token_s: float
    per_token_s: float

    @classmethod
    def from_two_steps(cls, one_token_s: float, tokens: int, tokens_s: float) -> StepTiming:
        """The line through a one-token step and a step of ``tokens`` tokens."""
        per_token = (tokens_s - one_token_s) / max(tokens - 1, 1)
        return cls(one_token_s=one_token_s, per_token_s=max(per_token, 0.0))

    def estimate(self, tokens: int) -> float:
        """Seconds of a step of ``tokens`` tokens on the reduced thread count."""
        return self.one_token_s + self.per_token_s * max(tokens - 1, 0)


def busy_host_seconds(wall_s: float, cpu_s: float, threads: int) -> float:
    """A measured step's time on ``threads`` threads: its wall time, or its process CPU
    time per thread when less (the step was preempted: time other processes held the
    cores is not the step's cost)."""
    return min(wall_s, cpu_s / max(threads, 1))


@dataclass(frozen=True)
class CpuThreads:
    """Intra-op threads of a CPU shard: ``small`` leaves the router a core, ``large`` is
    every core of this rank; ``timing`` (None until measured) is the model's step cost."""

    small: int
    large: int
    timing: StepTiming | None = None

    def calibrated(self, timing: StepTiming) -> CpuThreads:
        return CpuThreads(self.small, self.large, timing)

    def for_step(self, tokens: int, sampled_rows: int) -> int:
        """Threads for a step computing ``tokens`` tokens and sampling ``sampled_rows``."""
        if self.small == self.large:
            return self.large
        if self.timing is None:
            return self.large if tokens >= UNCALIBRATED_LARGE_FROM_TOKENS else self.small
        seconds = self.timing.estimate(tokens)
        router = sampled_rows * ROUTER_SECONDS_PER_ROW * ROUTER_WORK_FACTOR
        return self.large if seconds >= max(MIN_PARALLEL_SECONDS, router) else self.small


def cpu_threads(world_size: int, env: Mapping[str, str] | None = None) -> CpuThreads:
    """The thread counts of one of ``world_size`` ranks (``OMP_NUM_THREADS`` fixes both)."""
    environ = os.environ if env is None else env
    configured = environ.get("OMP_NUM_THREADS", "").strip()
    if configured.isdigit() and int(configured) > 0:
        return CpuThreads(int(configured), int(configured))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    ranks = max(world_size, 1)
    return CpuThreads(
        small=max(1, ((cores or 1) - 1) // ranks),
        large=max(1, (cores or 1) // ranks),
    )
