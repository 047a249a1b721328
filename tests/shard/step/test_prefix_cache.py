"""The shard's half of prefix caching: a sequence that starts after ``cached_tokens``
(blocks another sequence wrote) computes exactly what it computes from position 0, reads
those blocks without writing them, and a plan that misuses ``cached_tokens`` is refused
with the state unchanged. Oracle: the same sequences without the hit."""

from __future__ import annotations

import random
import re
from collections.abc import Callable

import pytest
import torch

from tests.shard.driving import Router
from tgis.shard.config import EngineSettings
from tgis.shard.errors import InvalidStepError
from tgis.shard.native.runtime.model_runner import ModelRunner
from tgis.shard.step.plan import PlanLimits, resolve_plan
from tgis.shard_api.messages import (
    DetailOptions,
    NewSequence,
    SamplingParams,
    ScheduledSequence,
    StepPlan,
)

DETAILS = DetailOptions(logprobs=True, ranks=True, top_n=2, generated_tokens=True)
SEEDED = SamplingParams(temperature=0.9, top_k=30, seed=77, repetition_penalty=1.2)


def ids(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 256) for _ in range(length)]


def run(
    runner: ModelRunner, shared_blocks: int, chunk: int, sampling: SamplingParams
) -> tuple[Router, list[object]]:
    """Sequence 1 computes a prompt and decodes; sequence 2, whose prompt shares its first
    ``2 * block_size + 5`` tokens, starts after ``shared_blocks`` of 1's blocks and
    computes the rest in chunks of ``chunk``; both then decode side by side."""
    router = Router(runner)
    size = router.block_size
    common = ids(2 * size + 5, 1)
    first, second = common + ids(6, 2), common + ids(9, 3)
    router.add(1, first, sampling, DETAILS)
    router.step({1: len(first)})
    router.decode([1])
    router.add(2, second, sampling, DETAILS)
    if shared_blocks:
        router.share(2, 1, shared_blocks)
    while (left := len(second) - router.computed[2]) > 0:
        router.step({1: 1, 2: min(chunk, left)})
    for _ in range(8):
        router.decode([1, 2])
    details = [t.token for out in router.outputs for t in out.tokens if t.request_id == 2]
    return router, details


@pytest.mark.parametrize("shared_blocks", [1, 2])
@pytest.mark.parametrize("chunk", [4, 64])
@pytest.mark.parametrize("mode", ["greedy", "seeded"])
def test_starting_after_cached_blocks_equals_computing_them(
    runner: ModelRunner, shared_blocks: int, chunk: int, mode: str
) -> None:
    sampling = SamplingParams() if mode == "greedy" else SEEDED
    cold, cold_details = run(runner, 0, chunk, sampling)
    runner.reset()
    warm, warm_details = run(runner, shared_blocks, chunk, sampling)
    # 1 decoded once per chunk of 2 (fewer after a hit): its blocks were not written.
    common = min(len(warm.generated[1]), len(cold.generated[1]))
    assert warm.generated[1][:common] == cold.generated[1][:common]
    assert warm.generated[2] == cold.generated[2]
    assert [d.token_id for d in warm_details] == [d.token_id for d in cold_details]  # type: ignore[attr-defined]
    for w, c in zip(warm_details, cold_details, strict=True):
        assert w.logprob == pytest.approx(c.logprob, abs=1e-4)  # type: ignore[attr-defined]
        assert w.rank == c.rank  # type: ignore[attr-defined]


@pytest.mark.parametrize("backend", ["cpu_paged", "torch_paged", "triton_paged"])
def test_every_attention_backend_reads_cached_blocks(
    make_runner: Callable[..., ModelRunner], monkeypatch: pytest.MonkeyPatch, backend: str
) -> None:
    """The same hit on each attention backend (Triton's kernels interpreted on the CPU):
    starting after two cached blocks computes what computing them does."""
    if backend == "triton_paged" and not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    runner = make_runner(engine=EngineSettings(attention_backend=backend))
    assert runner.info.attention_backend == backend
    cold, cold_details = run(runner, 0, 4, SamplingParams())
    runner.reset()
    warm, warm_details = run(runner, 2, 4, SamplingParams())
    assert warm.generated[2] == cold.generated[2]
    for w, c in zip(warm_details, cold_details, strict=True):
        assert w.logprob == pytest.approx(c.logprob, abs=1e-4)  # type: ignore[attr-defined]


def plan_with(runner: ModelRunner, scheduled: ScheduledSequence, **new: object) -> StepPlan:
    ns = NewSequence(9, tuple(ids(40, 4)), **new)  # type: ignore[arg-type]
    return StepPlan(step_id=1, new_sequences=(ns,), scheduled=(scheduled,))


@pytest.mark.parametrize(
    ("cached", "num_tokens", "details", "message"),
    [
        (5, 35, DetailOptions(), "cached_tokens 5: not a whole number of blocks"),
        (48, 1, DetailOptions(), "cached_tokens 48: the sequence has only 40 known token(s)"),
        (
            16,
            24,
            DetailOptions(input_tokens=True),
            "cached_tokens 16: the sequence asked for input-token details",
        ),
    ],
)
def test_misused_cached_tokens_are_refused(
    runner: ModelRunner, cached: int, num_tokens: int, details: DetailOptions, message: str
) -> None:
    assert runner.info.prefix_caching and runner.info.block_size == 16
    plan = plan_with(runner, ScheduledSequence(9, num_tokens, (0, 1, 2), cached), details=details)
    with pytest.raises(InvalidStepError, match=re.escape(f"request 9: {message}")):
        runner.step(plan)
    assert 9 not in runner.sequences


def test_cached_tokens_only_from_position_0(router: Router, runner: ModelRunner) -> None:
    router.add(1, ids(20, 5))
    router.step({1: 20})
    running = StepPlan(step_id=2, scheduled=(ScheduledSequence(1, 1, (7,), 16),), base_step_id=1)
    with pytest.raises(InvalidStepError, match="cached_tokens 16: the sequence has 20 computed"):
        runner.step(running)
    limits = PlanLimits(vocab_size=256, num_blocks=8, block_size=16, device=runner.device)
    fresh = plan_with(runner, ScheduledSequence(9, 24, (0, 1, 2), 16))
    with pytest.raises(InvalidStepError, match="this engine has no prefix cache"):
        resolve_plan(fresh, {}, limits)
