"""The compiled step with LoRA rows equals the eager step (itself tested against PEFT in
``tests/shard/adapters/test_lora.py``) and compiles once for every mix of adapters and
rows: the deltas are the opaque ``tgis::lora_add`` (``graphs/compiled_lora.py``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.lora_oracle import save_random_lora
from tests.shard.driving import Router
from tests.shard.models import TinyModel
from tgis.shard.config import EngineSettings, ShardConfig
from tgis.shard.loader import load_runner
from tgis.shard.native.graphs.compiled import CompiledForward
from tgis.shard.native.runtime.model_runner import ModelRunner
from tgis.shard_api.messages import DetailOptions

LOGPROBS = DetailOptions(logprobs=True, generated_tokens=True)
PROMPTS = {
    1: [5, 17, 33, 9, 81, 40, 7],
    2: [12, 99, 4, 150, 61],
    3: [201, 3, 77, 18, 52, 11, 140, 6, 23],
    4: [44, 8, 120, 66, 2, 90],
}


@pytest.fixture(scope="module")
def cache(tiny_model: TinyModel, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two LoRA adapters of different targets and ranks, and a third loaded only after
    the compiled runner served the first two."""
    root = tmp_path_factory.mktemp("adapters")
    save_random_lora(tiny_model.path, root / "all", seed=1, r=8, alpha=16)
    save_random_lora(tiny_model.path, root / "qv", seed=2, r=4, targets=["q_proj", "v_proj"])
    save_random_lora(tiny_model.path, root / "mlp", seed=3, r=2, targets=["up_proj", "down_proj"])
    return root


def runner_for(model: TinyModel, cache: Path, compiled: bool) -> ModelRunner:
    config = ShardConfig(
        model_name=str(model.path),
        adapter_cache=str(cache),
        kv_cache_blocks=64,
        engine=EngineSettings(compile="1" if compiled else "0"),
    )
    runner = load_runner(config)
    assert isinstance(runner, ModelRunner)
    assert isinstance(runner.forward, CompiledForward) == compiled
    return runner


def serve(runner: ModelRunner, adapters: dict[int, str]) -> Router:
    """Requests for ``adapters[rid]`` ('' : none) prefilled together (one in two chunks),
    then decoded together with one leaving early (the rows of each adapter change)."""
    router = Router(runner, seed=7)
    for rid, adapter_id in adapters.items():
        if adapter_id:
            runner.lookup_adapter(adapter_id)
        router.add(rid, PROMPTS[rid], details=LOGPROBS, adapter_id=adapter_id)
    first, *rest = adapters
    router.step({first: 3, **{rid: len(PROMPTS[rid]) for rid in rest}})
    router.step({first: len(PROMPTS[first]) - 3, **dict.fromkeys(rest, 1)})
    running = list(adapters)
    for step in range(5):
        router.decode(running)
        if step == 1:  # the last one's rows leave the step
            router.finish(running.pop())
    return router


def count_lora_graph_calls(runner: ModelRunner) -> list[int]:
    """A count, kept up to date, of the steps that run the compiled LoRA graph."""
    forward = runner.forward
    assert isinstance(forward, CompiledForward)
    graph = forward._compiled_lora
    count = [0]

    def counted(*args: Any) -> Any:
        count[0] += 1
        return graph(*args)

    forward._compiled_lora = counted
    return count


def logprobs(router: Router) -> dict[int, list[tuple[int, float]]]:
    found: dict[int, list[tuple[int, float]]] = {}
    for output in router.outputs:
        for sampled in output.tokens:
            found.setdefault(sampled.request_id, []).append(
                (sampled.token.token_id, sampled.token.logprob)
            )
    return found


@pytest.mark.slow
def test_compiled_lora_steps_equal_eager_and_compile_once(tiny_model: TinyModel, cache: Path):
    """Base rows and two adapters in one step, prefill and decode; then other mixes, one
    with an adapter loaded after start-up: the same tokens and logprobs (within 1e-4) as
    the eager step, and not one graph more than those compiled at start-up."""
    graphs = torch._dynamo.utils.counters["stats"]
    before = graphs["unique_graphs"]
    compiled = runner_for(tiny_model, cache, compiled=True)
    # The plain and the LoRA graph, at start-up, for each CPU thread count of the policy.
    threads = compiled.threads
    counts = 1 if threads is None else len({threads.small, threads.large})
    compiled_at_start = before + 2 * counts
    assert graphs["unique_graphs"] == compiled_at_start
    eager = runner_for(tiny_model, cache, compiled=False)
    lora_steps = count_lora_graph_calls(compiled)
    mixes = [
        {1: "all", 2: "", 3: "qv", 4: "all"},
        {3: "", 4: "mlp", 1: "qv"},  # "mlp" is loaded now, after start-up
        {2: "mlp", 4: "mlp"},  # one adapter for every row
    ]
    first: dict[int, list[int]] = {}
    for mix in mixes:
        got, expected = serve(compiled, mix), serve(eager, mix)
        assert got.generated == expected.generated, mix
        for rid, tokens in logprobs(expected).items():
            for (token, lp), (token_got, lp_got) in zip(tokens, logprobs(got)[rid], strict=True):
                assert token_got == token and abs(lp_got - lp) < 1e-4, (mix, rid)
        first = first or got.generated
        compiled.reset()
        eager.reset()
    assert graphs["unique_graphs"] == compiled_at_start
    assert lora_steps == [7 * len(mixes)]  # every step of every mix has LoRA rows
    # The adapters change the text (else equal outputs would prove nothing).
    plain = serve(eager, dict.fromkeys(mixes[0], "")).generated
    assert [first[rid] != plain[rid] for rid in mixes[0]] == [True, False, True, True]
