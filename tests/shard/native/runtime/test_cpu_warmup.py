"""The CPU shard's warm-up before its first request (tgis/shard/native/loading/cpu_warmup.py)."""

from __future__ import annotations

import logging

import pytest
import torch

from tests.shard.models import TinyModel
from tgis.shard.config import ShardConfig
from tgis.shard.loader import load_runner
from tgis.shard.native.loading import cpu_warmup
from tgis.shard.native.runtime.model_runner import ModelRunner
from tgis.shard_api.messages import NewSequence, ScheduledSequence, StepPlan


def _greedy(runner: ModelRunner, prompt: tuple[int, ...], steps: int) -> list[int]:
    blocks = tuple(range(4))
    out = runner.step(
        StepPlan(1, (NewSequence(7, prompt),), (ScheduledSequence(7, len(prompt), blocks),))
    )
    tokens = [out.tokens[0].token.token_id]
    for step in range(2, steps + 1):
        out = runner.step(StepPlan(step, (), (ScheduledSequence(7, 1),)))
        tokens.append(out.tokens[0].token.token_id)
    runner.reset()
    return tokens


def test_the_cpu_loader_warms_up_with_a_budget_sized_step_and_forgets_it(
    tiny_model: TinyModel, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    steps: list[StepPlan] = []
    original = ModelRunner.step

    def recording_step(self: ModelRunner, plan: StepPlan):  # type: ignore[no-untyped-def]
        steps.append(plan)
        return original(self, plan)

    monkeypatch.setattr(ModelRunner, "step", recording_step)
    config = ShardConfig(
        model_name=str(tiny_model.path), kv_cache_blocks=64, max_batch_prefill_tokens=300
    )
    with caplog.at_level(logging.INFO, logger=cpu_warmup.__name__):
        runner = load_runner(config)
    assert isinstance(runner, ModelRunner)
    warm = steps[-1]  # the loader's last step
    # Prompts of 128 tokens up to the budget (300): two of them, in one step.
    assert [len(s.prompt_token_ids) for s in warm.new_sequences] == [128, 128]
    assert sum(s.num_tokens for s in warm.scheduled) == 256
    assert "Warmed up with a 256-token prefill step (2 prompts)" in caplog.text
    assert not runner.sequences  # forgotten: every block is free again
    # The warmed-up runner computes what a runner that never warmed up computes.
    monkeypatch.setattr(cpu_warmup, "WARM_UP_TOKENS", 0)
    cold = load_runner(config)
    prompt = tuple(range(5, 30))
    assert _greedy(runner, prompt, 6) == _greedy(cold, prompt, 6)  # type: ignore[arg-type]


def test_the_warm_up_fits_a_small_cache(tiny_model: TinyModel) -> None:
    # 16-token blocks: 8 blocks hold one 128-token prompt.
    runner = load_runner(ShardConfig(model_name=str(tiny_model.path), kv_cache_blocks=8))
    assert isinstance(runner, ModelRunner) and not runner.sequences
    assert runner.device == torch.device("cpu")
