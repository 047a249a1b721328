"""The router's scheduler giving back the KV blocks behind a sliding window, driving the
native runner of a tiny Mistral with a window of 8 keys (``families.py``): a generation
many times longer than the window, and than the router's whole pool, runs in a bounded
number of blocks, with a prefix-cache hit on blocks a finished request gave back, and its
tokens are transformers' greedy ones. The shard announces the window it reads
(``ShardInfo.kv_window``), 0 when a layer attends to everything."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tests.router.core.test_scheduler import make_state
from tests.shard.families import FAMILIES, prompt_of
from tests.shard.models import TinyModel
from tests.shard.native.models.test_families import make_runner
from tgis.router.core.batching import SchedulerLimits
from tgis.router.core.request_state import RequestState
from tgis.router.core.scheduler import Scheduler, new_scheduler
from tgis.router.core.steps import ScheduledStep
from tgis.router.core.stopping import StopChecker
from tgis.router.request_types import ResponseOptions
from tgis.shard.native.models.kv_window import kv_window
from tgis.shard.native.runtime.model_runner import ModelRunner
from tgis.shard.native.speculation.draft_model import DraftModel

PROMPT = prompt_of(40, 21)  # five windows, two and a half blocks of 16
OTHER = prompt_of(57, 22)
LOGPROBS: dict[int, list[float]] = {}
"""Each request's sampled tokens' logprobs, as the runner gave them."""
NEW = 150  # the sequence ends at 190 positions: 12 blocks without the window


@pytest.fixture(scope="module")
def mistral(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    path = tmp_path_factory.mktemp("mistral-window")
    return TinyModel(path, FAMILIES["mistral-window"].build(path))


def request(request_id: int, prompt: list[int], new_tokens: int) -> RequestState:
    """A request for ``prompt`` that never stops before ``new_tokens`` (no EOS), with
    its tokens' logprobs."""
    state = make_state(request_id, len(prompt), new_tokens)
    logprobs = ResponseOptions(generated_tokens=True, token_logprobs=True)
    params = replace(state.request.params, response=logprobs)
    state.request = replace(state.request, input_ids=tuple(prompt), params=params)
    state.stop_checker = StopChecker(state.request.stopping, ())
    return state


def assert_matches_hf(model: TinyModel, state: RequestState) -> None:
    """The request's greedy tokens are transformers', their logprobs within 1e-4."""
    expected, logits = model.greedy(state.request.input_ids, state.request.stopping.max_new_tokens)
    assert state.generated_ids == expected, f"request {state.request_id}"
    for step, (logprob, step_logits) in enumerate(
        zip(LOGPROBS.pop(state.request_id), logits, strict=True)
    ):
        ref = torch.log_softmax(step_logits, dim=-1)[expected[step]].item()
        assert abs(logprob - ref) < 1e-4, f"request {state.request_id}, token {step}"


def limits(total_tokens: int) -> SchedulerLimits:
    return SchedulerLimits(
        max_batch_size=4, max_batch_prefill_tokens=16, max_batch_total_tokens=total_tokens
    )


def run(
    scheduler: Scheduler,
    runner: ModelRunner,
    states: list[RequestState],
    newcomer: Callable[[int], RequestState] | None = None,
    depth: int = 1,
) -> int:
    """Drive ``states`` to the end with ``depth`` steps in flight (2: each planned on top of
    the one before it, as the engine overlaps them); returns the most blocks in use. With
    ``newcomer``, a step that gave blocks back is followed by a new request (its id the
    argument), whose first prompt chunk fills the block given back last."""
    for state in states:
        scheduler.add(state)
    most = 0
    in_flight: deque[ScheduledStep] = deque()
    for _ in range(1000):
        while len(in_flight) < depth:
            base = in_flight[-1].plan.step_id if in_flight else 0
            step = scheduler.schedule(0.0, base)
            if not step.plan.has_message:
                break
            in_flight.append(step)
        if not in_flight:
            assert not scheduler.has_work, "requests left but nothing to do: stuck"
            return most
        step = in_flight.popleft()
        released = scheduler.window_released
        output = runner.step(step.plan)
        for sampled in output.tokens:
            LOGPROBS.setdefault(sampled.request_id, []).append(sampled.token.logprob)
        scheduler.update(step, output, 0.0)
        most = max(most, scheduler.blocks.num_used)
        if newcomer is not None and scheduler.window_released > released:
            states.append(newcomer(len(states) + 1))
            scheduler.add(states[-1])
    pytest.fail("the generation did not end")


@pytest.mark.parametrize("depth", [1, 2])
def test_long_generations_run_in_the_window_s_blocks_and_match_hf(
    mistral: TinyModel, depth: int
) -> None:
    """Two sequences side by side in a pool of 10 blocks of 16 (160 tokens, less than one
    190-token sequence), one step in flight or two. Whenever blocks are given back a short
    request arrives, whose first chunk overwrites the last one given back as soon as it
    can: a block given back while a query still reads it would change the tokens."""
    runner = make_runner(mistral.path, max_sequence_length=256)
    assert runner.info.kv_window == 8 == kv_window(runner.model)
    scheduler = new_scheduler(limits(160), runner.info, prefix_caching=False)
    assert (scheduler.blocks.num_blocks, scheduler.kv_window) == (10, 8)
    states = [request(1, PROMPT, NEW), request(2, OTHER, NEW)]
    most = run(scheduler, runner, states, lambda rid: request(rid, prompt_of(16, rid), 2), depth)
    assert len(states) >= 12 and scheduler.preemption_count == 0
    for state in states:
        assert_matches_hf(mistral, state)
    assert most <= 10 and scheduler.window_released >= 18 and scheduler.blocks.num_used == 0


def test_a_prefix_cache_hit_on_blocks_given_back_matches_hf(mistral: TinyModel) -> None:
    """A request gives back its prompt's first blocks while it runs (idle, still cached);
    the next one with the same prompt starts from them."""
    runner = make_runner(mistral.path, prefix_caching=True, max_sequence_length=256)
    expected = mistral.greedy(PROMPT, 30)[0]
    scheduler = new_scheduler(limits(256), runner.info, prefix_caching=True)
    first = request(1, PROMPT, 30)
    run(scheduler, runner, [first])
    assert scheduler.window_released >= 2
    second = request(2, PROMPT, 20)
    scheduler.add(second)
    step = scheduler.schedule(0.0)
    assert step.cache_hits == 32  # blocks 0 and 1, given back by the first
    scheduler.update(step, runner.step(step.plan), 0.0)
    run(scheduler, runner, [])
    assert first.generated_ids == expected and second.generated_ids == expected[:20]


def test_a_model_with_a_global_layer_announces_no_window(tmp_path: Path) -> None:
    """Qwen2 with ``max_window_layers`` 1: layer 0 attends to every position."""
    FAMILIES["qwen2-window"].build(tmp_path)
    assert make_runner(tmp_path).info.kv_window == 0


def test_a_draft_model_turns_the_window_off(mistral: TinyModel) -> None:
    """The draft model's cache shares the block tables and catches up from any position,
    so with one no block may go early."""
    runner, helper = make_runner(mistral.path), make_runner(mistral.path)
    assert runner.info.kv_window == 8
    runner.attach_draft(DraftModel(helper.model, helper.kv_cache, runner.attention, runner.device))
    assert runner.info.kv_window == 0 and runner.info.draft_model
