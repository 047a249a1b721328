"""Granite 4.0 hybrid (Mamba-2 and attention layers, experts) beyond the shared family
checks of ``test_families.py`` (transformers' greedy tokens and logprobs, batched, chunked
prefill joining a decode, a prompt-tuning prefix): the recurrent state across steps, under
any split of a prompt, mixed batches, preemption, a failed step, the plan's slots, dummy
weights."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.shard.driving import NEW_TOKENS, PROMPTS, Preemption, Router, drive
from tests.shard.families import FAMILIES, LOGPROBS, assert_matches_hf
from tests.shard.families import NEW_TOKENS as HF_TOKENS
from tests.shard.families import PROMPTS as PROMPTS_HF
from tests.shard.models import TinyModel
from tgis.shard.checkpoints.dummy_weights import parameter_count
from tgis.shard.checkpoints.model_config import ModelConfig
from tgis.shard.config import ShardConfig
from tgis.shard.errors import InvalidStepError, StartupError
from tgis.shard.loader import load_runner
from tgis.shard.native.models import model_class
from tgis.shard.native.models.recurrent_state import StateStep
from tgis.shard.native.runtime.model_runner import ModelRunner
from tgis.shard_api.messages import NewSequence, ScheduledSequence, StepPlan

FAMILY = FAMILIES["granite-hybrid"]
BENCHMARK_MODELS = Path(__file__).parents[4] / "benchmarks" / "models"
FEW = 5  # tokens the shorter checks generate


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    path = tmp_path_factory.mktemp("granite-hybrid")
    return TinyModel(path, FAMILY.build(path))


def make_runner(path: Path, **kwargs: Any) -> ModelRunner:
    kwargs.setdefault("kv_cache_blocks", 64)
    runner = load_runner(ShardConfig(model_name=str(path), max_sequence_length=256, **kwargs))
    assert isinstance(runner, ModelRunner)
    return runner


@pytest.fixture(scope="module")
def reference(model: TinyModel) -> dict[int, list[int]]:
    """Each of ``driving.PROMPTS`` prefilled whole, alone, then decoded: this engine's
    tokens (equal to transformers', which ``test_families`` checks)."""
    tokens = {}
    runner = make_runner(model.path, max_batch_size=4)
    for rid, prompt in PROMPTS.items():
        router = Router(runner)
        router.add(rid, prompt)
        router.step({rid: len(prompt)})
        for _ in range(NEW_TOKENS - 1):
            router.decode([rid])
        tokens[rid] = router.generated[rid]
        router.finish(rid)
        router.step({})
    assert tokens[2] == model.greedy(PROMPTS[2], NEW_TOKENS)[0]
    return tokens


def test_no_position_embedding_and_the_older_layer_names_match_hf(tmp_path: Path) -> None:
    """Granite 4.0's published configs: no rotary embedding (``position_embedding_type``
    "nope"), the layer kinds by their older names ("mamba", "attention"); transformers'
    greedy tokens and logprobs, and the tokens differ from the same weights with RoPE."""
    params = dict(FAMILY.params, position_embedding_type="nope")
    hf = replace(FAMILY, params=params).build(tmp_path / "nope")
    raw = json.loads((tmp_path / "nope" / "config.json").read_text())
    older = {"linear_attention": "mamba", "full_attention": "attention"}
    raw["layer_types"] = [older[kind] for kind in raw["layer_types"]]
    (tmp_path / "nope" / "config.json").write_text(json.dumps(raw))
    prompts = {3: PROMPTS_HF[3]}
    router = Router(make_runner(tmp_path / "nope", max_batch_size=2))
    router.add(3, prompts[3], details=LOGPROBS)
    router.step({3: len(prompts[3])})
    for _ in range(HF_TOKENS - 1):
        router.decode([3])
    nope = TinyModel(tmp_path / "nope", hf)
    assert_matches_hf(router, nope, prompts)
    raw["position_embedding_type"] = "rope"
    (tmp_path / "nope" / "config.json").write_text(json.dumps(raw))
    rope = Router(make_runner(tmp_path / "nope", max_batch_size=2))
    rope.add(3, prompts[3])
    rope.step({3: len(prompts[3])})
    for _ in range(HF_TOKENS - 1):
        rope.decode([3])
    assert rope.generated[3] != router.generated[3]


def test_info_announces_slots_and_turns_off_prefix_caching_and_speculation(
    model: TinyModel,
) -> None:
    runner = make_runner(model.path, max_batch_size=3, prefix_caching=True)
    info = runner.info
    assert (info.state_slots, info.prefix_caching, info.speculation) == (3, False, False)
    assert runner.kv_cache.spec.num_layers == 1  # the one attention layer


def test_mixed_batches_chunks_and_a_preemption_give_the_lone_tokens(
    model: TinyModel, reference: dict[int, list[int]]
) -> None:
    """Prompts in chunks of 8 beside other sequences' decodes, one sequence preempted after
    3 tokens and recomputed in chunks of 5 into a slot holding a stale state while the
    others decode: every sequence's tokens are its lone run's."""
    runner = make_runner(model.path, max_batch_size=4)
    router = drive(runner, {}, Preemption(request_id=2, after_tokens=3, pause_steps=2, chunk=5))
    assert router.generated == reference


def test_a_prompt_split_anywhere_gives_the_whole_prefill_s_tokens(
    model: TinyModel, reference: dict[int, list[int]]
) -> None:
    runner = make_runner(model.path, max_batch_size=4)
    router = Router(runner)
    prompt = PROMPTS[2]  # 23 tokens: chunks of 1, 6 and 16 (the scan's chunks are 8)
    router.add(2, prompt)
    for chunk in (1, 6, 16):
        router.step({2: chunk})
    for _ in range(FEW - 1):
        router.decode([2])
    assert router.generated[2] == reference[2][:FEW]


def test_the_tokens_depend_on_the_state_carried_between_steps(
    model: TinyModel, reference: dict[int, list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The oracle sees the recurrent state: a shard that dropped it after each step (every
    decode from a zero state) would not give the lone run's tokens."""
    monkeypatch.setattr(StateStep, "commit", lambda self: None)
    router = Router(make_runner(model.path, max_batch_size=4))
    router.add(2, PROMPTS[2])
    router.step({2: len(PROMPTS[2])})
    for _ in range(FEW - 1):
        router.decode([2])
    assert router.generated[2][0] == reference[2][0]  # the prompt's pass needs no state
    assert router.generated[2] != reference[2][:FEW]


def test_a_failed_step_leaves_the_states_as_they_were(
    model: TinyModel, reference: dict[int, list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    runner = make_runner(model.path, max_batch_size=4)
    router = Router(runner)
    router.add(3, PROMPTS[3])
    router.step({3: len(PROMPTS[3])})
    real = runner.model.compute_logits
    monkeypatch.setattr(runner.model, "compute_logits", _raising)
    slot = router.slots[3]
    plan = StepPlan(router.step_id + 1, (), (ScheduledSequence(3, 1, state_slot=slot),))
    with pytest.raises(RuntimeError, match="sampling failed"):
        runner.step(plan)  # the forward ran (and staged new states), sampling failed
    monkeypatch.setattr(runner.model, "compute_logits", real)
    for _ in range(FEW - 1):
        router.decode([3])
    assert router.generated[3] == reference[3][:FEW]


def test_the_triton_scan_gives_the_same_tokens(
    model: TinyModel, reference: dict[int, list[int]]
) -> None:
    """The Mamba layers' Triton path (CUDA's; here in Triton's interpreter): a prompt in
    two chunks beside another sequence's whole prompt, then its decode."""
    runner = make_runner(model.path, max_batch_size=4)
    for layer in runner.model.layers:  # type: ignore[attr-defined]
        if layer.mamba is not None:
            layer.mamba.triton_scan = True
    router = Router(runner)
    router.add(1, PROMPTS[1])
    router.add(3, PROMPTS[3])
    router.step({1: len(PROMPTS[1]), 3: 4})
    router.step({1: 1, 3: len(PROMPTS[3]) - 4})
    assert router.generated[1] == reference[1][:2]
    assert router.generated[3] == reference[3][:1]


def test_the_gpu_warm_up_runs_on_the_state_slots(
    model: TinyModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``measure_cuda_blocks`` (its memory queries faked, the steps run on the CPU) with 5
    slots: its mixed step holds 4 sequences beside the prefill chunk, each with a slot."""
    from tests.shard.test_capacity import GIB, _fake_cuda
    from tgis.shard.native.loading import cuda_capacity

    runner = make_runner(model.path, max_batch_size=5)
    assert runner.states is not None and runner.states.num_slots == 5
    ran: list[tuple[StepPlan, ...]] = []
    real_warm_up = cuda_capacity.warm_up

    def recording(*args: Any) -> list[Any]:
        ran.append(cuda_capacity.slotted(args[5].steps, 5))
        return real_warm_up(*args)

    monkeypatch.setattr(cuda_capacity, "warm_up", recording)
    _fake_cuda(monkeypatch, free=40 * GIB, total=80 * GIB, allocated=GIB)
    blocks = cuda_capacity.measure_cuda_blocks(
        runner.model,
        runner.kv_cache.spec,
        runner.attention,
        runner.info,
        torch.device("cpu"),
        max_prefill_tokens=40,
        max_sequence_length=64,
        max_batch_size=16,
        memory_fraction=1.0,
        safety_margin=20,
        states=runner.states,
    )
    assert blocks > 0
    mixed = ran[0][1].scheduled
    assert len(mixed) == 5 and sorted(s.state_slot for s in mixed) == [0, 1, 2, 3, 4]


def _raising(hidden: torch.Tensor) -> torch.Tensor:
    raise RuntimeError("sampling failed")


@pytest.mark.parametrize(
    ("slots", "message"),
    [
        ((None,), "no state_slot"),
        ((4,), "state_slot 4 out of range"),
        ((1, 1), "state_slot 1 used twice"),
    ],
)
def test_plans_must_give_each_sequence_its_own_slot(
    model: TinyModel, slots: tuple[int | None, ...], message: str
) -> None:
    runner = make_runner(model.path, max_batch_size=4)
    new = tuple(NewSequence(rid, (5, 6, 7)) for rid in range(1, len(slots) + 1))
    scheduled = tuple(
        ScheduledSequence(rid, 3, (rid,), state_slot=slot)
        for rid, slot in enumerate(slots, start=1)
    )
    with pytest.raises(InvalidStepError, match=message):
        runner.step(StepPlan(1, new, scheduled))


def test_checkpoint_shapes_and_dummy_weights(model: TinyModel, tmp_path: Path) -> None:
    from safetensors import safe_open

    config = ModelConfig.from_dir(model.path)
    shapes = model_class(config).checkpoint_shapes(config, 256)
    with safe_open(str(model.path / "model.safetensors"), framework="pt") as f:
        real = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118
    assert shapes == real
    (tmp_path / "config.json").write_text((model.path / "config.json").read_text())
    router = Router(make_runner(tmp_path, load_format="dummy", max_batch_size=2))
    router.add(1, [5, 6, 7, 8, 9])
    router.step({1: 5})
    router.decode([1])
    assert len(router.generated[1]) == 2


def test_granite_4_h_tiny_shapes() -> None:
    """The benchmark configuration of granite-4.0-h-tiny (``benchmarks/models``): its
    checkpoint layout has about 6.9B parameters, 4 attention and 36 Mamba layers."""
    config = ModelConfig.from_dir(BENCHMARK_MODELS / "granite-4.0-h-tiny")
    shapes = model_class(config).checkpoint_shapes(config, 4096)
    assert 6.5e9 < parameter_count(shapes) < 7.2e9
    assert sum(name.endswith("mamba.A_log") for name in shapes) == 36


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"layer_types": ["mamba", "mamba", "mamba"]}, "without attention layers"),
        ({"layer_types": ["mamba", "cross_attention", "mamba"]}, "cross_attention"),
        ({"mamba_n_groups": 3}, "mamba_n_groups 3 does not divide mamba_n_heads 8"),
    ],
)
def test_unsupported_configs_are_refused(
    model: TinyModel, tmp_path: Path, edit: dict[str, Any], message: str
) -> None:
    raw = json.loads((model.path / "config.json").read_text()) | edit
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(StartupError, match=message):
        model_class(ModelConfig.from_dir(tmp_path)).check_config(
            ModelConfig.from_dir(tmp_path), 256
        )


def _tp_plans() -> tuple[Any, ...]:
    from tests.shard.native.models.test_families import TP_DETAILS
    from tests.shard.tp_utils import Request, make_plans
    from tgis.shard.native.loading.cuda_capacity import slotted

    requests = [
        Request(1, tuple(PROMPTS_HF[3]), 5, details=TP_DETAILS, chunk=12),
        Request(2, tuple(PROMPTS_HF[2]), 4, details=TP_DETAILS, arrives=1),
    ]
    return slotted(tuple(make_plans(requests)), 2)


@pytest.fixture(scope="module")
def two_rank_reports(tmp_path_factory: pytest.TempPathFactory) -> dict[int, tuple[Path, Any]]:
    """The model with 2 and with 1 group of B/C, and each one's reports on two ranks, both
    from one pair of rank processes (`run_plans_on_each`: their start is most of the time)."""
    from tests.shard.tp_utils import run_plans_on_each

    paths = {groups: tmp_path_factory.mktemp(f"tp-groups-{groups}") for groups in (2, 1)}
    for groups, path in paths.items():
        replace(FAMILY, params=dict(FAMILY.params, mamba_n_groups=groups)).build(path)
    jobs = [(path, _tp_plans()) for path in paths.values()]
    each = run_plans_on_each(jobs, 2, max_sequence_length=256)
    return {
        groups: (path, reports) for (groups, path), reports in zip(paths.items(), each, strict=True)
    }


@pytest.mark.slow  # starts tensor-parallel rank processes
@pytest.mark.parametrize("groups", [2, 1])
def test_two_ranks_match_one(groups: int, two_rank_reports: dict[int, tuple[Path, Any]]) -> None:
    """Each rank holds half of every Mamba layer's heads (and of B/C's groups when there
    are 2; with one group both ranks hold it and sum the gated norm's statistics), half
    of the attention heads and of every expert: the tokens and details of one rank."""
    from tests.shard.tp_utils import assert_same_outputs, run_plans

    path, reports = two_rank_reports[groups]
    (single,) = run_plans(path, _tp_plans(), 1, max_sequence_length=256)
    assert not any(isinstance(o, str) for o in single.outputs), single.outputs
    assert sum(len(o.tokens) for o in reports[0].outputs if not isinstance(o, str)) == 9
    assert_same_outputs(single.outputs, reports[0].outputs)
    assert reports[1].worker_error is None


def test_a_lora_adapter_on_attention_and_mamba_projections_matches_peft(
    model: TinyModel, tmp_path: Path
) -> None:
    """A LoRA adapter on q/o and the Mamba layers' in_proj/out_proj: PEFT's greedy tokens
    and logprobs, beside a request without it."""
    from tests.lora_oracle import lora_greedy, save_random_lora

    targets = ["q_proj", "o_proj", "in_proj", "out_proj"]
    save_random_lora(model.path, tmp_path / "adapters" / "a", seed=1, targets=targets)
    runner = make_runner(model.path, adapter_cache=str(tmp_path / "adapters"))
    runner.lookup_adapter("a")
    router = Router(runner)
    router.add(1, PROMPTS_HF[2], details=LOGPROBS, adapter_id="a")
    router.add(2, PROMPTS_HF[3], details=LOGPROBS)
    router.step({1: len(PROMPTS_HF[2]), 2: len(PROMPTS_HF[3])})
    for _ in range(FEW - 1):
        router.decode([1, 2])
    cases = ((1, tmp_path / "adapters" / "a", PROMPTS_HF[2]), (2, None, PROMPTS_HF[3]))
    for rid, adapter, prompt in cases:
        tokens, logits = lora_greedy(model.path, adapter, prompt, FEW)
        assert router.generated[rid] == tokens, rid
        details = [t.token for o in router.outputs for t in o.tokens if t.request_id == rid]
        for detail, step_logits in zip(details, logits, strict=True):
            expected = torch.log_softmax(step_logits, dim=-1)[detail.token_id].item()
            assert abs(detail.logprob - expected) < 1e-4, rid
    assert router.generated[1] != lora_greedy(model.path, None, PROMPTS_HF[2], FEW)[0]
