"""The compiled step equals the eager reference: every native family, on mixed prefill/decode
batches (prompts in chunks next to decodes) with a preemption and its recompute; greedy tokens
identical, logprobs within 1e-4, a seeded sampled sequence drawing the same tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.shard.driving import PROMPTS, Preemption, Router, drive
from tests.shard.families import FAMILIES
from tests.shard.models import TinyModel, build_tiny_llama
from tests.shard.tp_utils import Request, assert_same_outputs, make_plans, run_plans
from tgis.shard.config import EngineSettings, ShardConfig
from tgis.shard.loader import load_runner
from tgis.shard.native.graphs.compiled import CompiledForward
from tgis.shard.native.runtime.model_runner import ModelRunner
from tgis.shard_api.messages import DetailOptions, SamplingParams, StepOutput

DETAILS = DetailOptions(logprobs=True, generated_tokens=True)
SEEDED = {3: SamplingParams(temperature=0.8, top_k=20, seed=99)}


def runner_for(path: Path, compiled: bool, dtype: str | None = None) -> ModelRunner:
    config = ShardConfig(
        model_name=str(path),
        dtype=dtype,
        kv_cache_blocks=64,
        max_sequence_length=256,
        engine=EngineSettings(compile="1" if compiled else "0"),
    )
    runner = load_runner(config)
    assert isinstance(runner, ModelRunner)
    assert isinstance(runner.forward, CompiledForward) == compiled
    return runner


def details_by_request(router: Router) -> dict[int, list[tuple[int, float]]]:
    found: dict[int, list[tuple[int, float]]] = {rid: [] for rid in PROMPTS}
    for output in router.outputs:
        for sampled in output.tokens:
            found[sampled.request_id].append((sampled.token.token_id, sampled.token.logprob))
    return found


def assert_same(compiled: Router, eager: Router) -> None:
    assert compiled.generated == eager.generated
    for rid, expected in details_by_request(eager).items():
        got = details_by_request(compiled)[rid]
        assert [t for t, _ in got] == [t for t, _ in expected]
        for (_, lp_got), (_, lp_expected) in zip(got, expected, strict=True):
            assert abs(lp_got - lp_expected) < 1e-4, rid


# One variant of every model class (a compilation costs 10-40 s of the suite on two cores):
# Llama's with Granite's multipliers, each older family's, and the Llama variants' with a
# q/k norm (Qwen3) and with fused tensors and LongRoPE (Phi-3). The options these leave out
# (Qwen2's biases, OLMo 2's norms, Falcon's old layout) are the same operations in other
# places of the traced layer; the mixtures of experts and Gemma's soft-capped, windowed
# layers have tests of their own (below, and test_sliding_window.py). One decoder layer each:
# the traced layer is the family's own, the loop over layers (each its attention op's
# layer index) is DecoderLM's for every family, compiled with two or more layers by the
# tests below (the Llama, Qwen2-MoE, and test_sliding_window's Gemma 2); a second identical
# layer about doubled each compilation (Qwen3 from a cold cache on the loaded 2-core
# host: 82-117 s with two layers, 44-56 s with one).
VARIANTS = [
    "granite",
    "gpt-bigcode-mqa",
    "gpt-neox-parallel",
    "falcon-new-gqa",
    "qwen3",
    "phi3-longrope",
]


@pytest.mark.slow
@pytest.mark.parametrize("variant", VARIANTS)
def test_compiled_equals_eager(variant: str, tmp_path: Path) -> None:
    FAMILIES[variant].build(tmp_path, num_hidden_layers=1)
    preemption = Preemption(2, after_tokens=4, pause_steps=1, chunk=7)
    eager = drive(runner_for(tmp_path, False), SEEDED, preemption, DETAILS)
    compiled = drive(runner_for(tmp_path, True), SEEDED, preemption, DETAILS)
    assert_same(compiled, eager)


@pytest.mark.slow
def test_compiled_mixture_of_experts_equals_eager(tmp_path: Path) -> None:
    """Qwen2-MoE (routed experts, a gated shared expert, a dense layer): on the CPU the
    compiled step calls the grouped experts as one operator (``tgis::grouped_moe``). In
    float32: in bfloat16 the eager step multiplies the experts with oneDNN-packed weights,
    the compiled operator with plain ones, their logprobs differ by ~0.02 on this tiny
    model and its tokens part after a few."""
    FAMILIES["qwen2-moe"].build(tmp_path)
    preemption = Preemption(2, after_tokens=4, pause_steps=1, chunk=7)
    eager = drive(runner_for(tmp_path, False, "float32"), SEEDED, preemption, DETAILS)
    compiled = drive(runner_for(tmp_path, True, "float32"), SEEDED, preemption, DETAILS)
    assert_same(compiled, eager)


@pytest.mark.slow
@pytest.mark.gpu
def test_compiled_llama_equals_eager_and_transformers(tiny_model: TinyModel) -> None:
    """The plain Llama, also against transformers' own greedy generation."""
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    runner = runner_for(tiny_model.path, True)
    compiled = drive(runner, SEEDED, None, DETAILS)
    eager = drive(runner_for(tiny_model.path, False), SEEDED, None, DETAILS)
    assert_same(compiled, eager)
    for rid in (1, 2):
        expected = tiny_model.greedy(PROMPTS[rid], len(compiled.generated[rid]))[0]
        assert compiled.generated[rid] == expected
    # One graph serves every step size (one sequence decoding included) and every offset of
    # the step's inputs in their buffers: new step shapes compile nothing more. (One per CPU
    # thread count of the policy, each compiled at start-up: compile_step's warm-up.)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    threads = runner.threads
    assert graphs == before + (1 if threads is None else len({threads.small, threads.large}))
    runner.reset()
    drive(runner, {}, Preemption(1, after_tokens=2, pause_steps=0, chunk=3), DETAILS)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs


@pytest.mark.slow
def test_compiled_tensor_parallel_equals_eager(tmp_path: Path) -> None:
    """Two gloo ranks compile the step with the all-reduces inside its graph
    (``tgis::all_reduce``): the same tokens and logprobs as the eager step (one rank's: two
    eager ranks equal it, ``tests/shard/parallel/``), and one graph per rank serves prompts,
    chunks next to decodes and one sequence's decodes (start-up compiled it, nothing
    recompiled)."""
    build_tiny_llama(tmp_path, seed=3)
    prompt = (9, 30, 31, 200, 17, 4, 99, 100, 101, 5, 6, 7, 8, 250, 3, 3, 40, 41)
    details = DetailOptions(logprobs=True, top_n=2, input_tokens=True)
    plans = make_plans(
        [
            Request(1, prompt, 6, details=details, chunk=7),
            Request(2, prompt[:5], 3, SamplingParams(temperature=0.8, top_k=20, seed=7), arrives=1),
        ]
    )
    eager = run_plans(tmp_path, plans, 1, engine=EngineSettings(compile="0"))[0]
    ranks = run_plans(tmp_path, plans, 2, engine=EngineSettings(compile="1"))
    assert all(isinstance(output, StepOutput) for output in eager.outputs)
    assert_same_outputs(eager.outputs, ranks[0].outputs)
    assert [(r.forward, r.compiled_graphs, r.worker_error) for r in ranks] == [
        ("CompiledForward", 1, None)
    ] * 2
