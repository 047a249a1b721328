"""The mixture-of-experts families beyond the oracle every family passes
(``test_families.py``: greedy tokens and logprobs equal to transformers', chunked prefill
joining a decode): the routing the oracle checks is the one that matters (another top-k or
normalisation changes the tokens), two tensor-parallel ranks equal one, and quantized
checkpoints are refused at start."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import pytest

from tests.shard.families import FAMILIES, PROMPTS, assert_matches_hf
from tests.shard.models import TinyModel
from tests.shard.native.models.test_families import (
    MAX_SEQUENCE_LENGTH,
    TP_DETAILS,
    generate_batch,
    make_runner,
)
from tgis.shard.checkpoints.model_config import ModelConfig
from tgis.shard.config import EngineSettings
from tgis.shard.errors import StartupError
from tgis.shard.native.linear.moe import Routing, SparseMoE
from tgis.shard.native.models import check_config

MOE_FAMILIES = ["granite-moe", "mixtral", "qwen2-moe", "qwen3-moe"]


def _with_routing(monkeypatch: pytest.MonkeyPatch, change: dict[str, object]) -> None:
    """Every ``SparseMoE`` built from now on routes with ``change`` applied."""
    original = SparseMoE.__init__

    def init(self: SparseMoE, router, routing: Routing, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        original(self, router, dataclasses.replace(routing, **change), *args, **kwargs)

    monkeypatch.setattr(SparseMoE, "__init__", init)


@pytest.mark.parametrize("name", MOE_FAMILIES)
@pytest.mark.parametrize("change", [{"top_k": 1}, {"renormalize": None}], ids=["top1", "norm"])
def test_other_routing_changes_the_tokens(
    name: str, change: dict[str, object], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tiny models' routing matters: with one expert per token, or the other
    normalisation, the greedy tokens are not transformers' (so the oracle checks them)."""
    model = TinyModel(tmp_path, FAMILIES[name].build(tmp_path))
    if "renormalize" in change:
        renormalize = name != "qwen2-moe"  # the family's own; flip it
        change = {"renormalize": not renormalize}
    _with_routing(monkeypatch, change)
    router = generate_batch(tmp_path, PROMPTS)
    differ = [r for r, p in PROMPTS.items() if router.generated[r] != model.greedy(p, 10)[0]]
    assert differ, f"{name}: {change} gives transformers' tokens"


def test_qwen2_moe_has_dense_and_sparse_layers(tmp_path: Path) -> None:
    FAMILIES["qwen2-moe"].build(tmp_path)
    layers = make_runner(tmp_path).model.layers  # type: ignore[attr-defined]
    assert isinstance(layers[0].mlp, SparseMoE) and layers[0].mlp.shared is not None
    assert not isinstance(layers[1].mlp, SparseMoE)  # mlp_only_layers=[1]


def _edit_config(path: Path, **values: object) -> None:
    config = json.loads((path / "config.json").read_text())
    config.update(values)
    (path / "config.json").write_text(json.dumps(config))


def test_quantized_checkpoints_are_refused_at_start(tmp_path: Path) -> None:
    FAMILIES["mixtral"].build(tmp_path)
    with pytest.raises(StartupError, match="quantized mixture-of-experts"):
        make_runner(tmp_path, quantize="fp8", engine=EngineSettings(engine="native"))
    _edit_config(tmp_path, quantization_config={"quant_method": "gptq", "bits": 4})
    with pytest.raises(StartupError, match="quantized mixture-of-experts"):
        check_config(ModelConfig.from_dir(tmp_path), MAX_SEQUENCE_LENGTH)


def test_mixtral_with_a_sliding_window_matches_hf(tmp_path: Path) -> None:
    """Mixtral's window (null in the released checkpoints) is Mistral's: every layer attends
    to its last ``sliding_window`` keys, here 8, fewer than two of the prompts have."""
    params = dict(FAMILIES["mixtral"].params, sliding_window=8)
    hf = dataclasses.replace(FAMILIES["mixtral"], params=params).build(tmp_path)
    model = TinyModel(tmp_path, hf)
    assert_matches_hf(generate_batch(tmp_path, PROMPTS), model, PROMPTS)
    _edit_config(tmp_path, sliding_window=None)  # the window matters
    router = generate_batch(tmp_path, PROMPTS)
    assert any(router.generated[r] != model.greedy(p, 10)[0] for r, p in PROMPTS.items())


TP_FAMILIES = ("granite-moe", "mixtral", "qwen3-moe")


def _tp_plans() -> list[Any]:
    from tests.shard.tp_utils import Request, make_plans

    return make_plans(
        [
            Request(1, tuple(PROMPTS[3]), 5, details=TP_DETAILS, chunk=12),
            Request(2, tuple(PROMPTS[2]), 4, details=TP_DETAILS, arrives=1),
        ]
    )


@pytest.fixture(scope="module")
def two_rank_reports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    """Each TP family's model directory and its reports on two ranks, all from one pair of
    rank processes (`run_plans_on_each`: their start is most of a two-rank run's time)."""
    from tests.shard.tp_utils import run_plans_on_each

    paths = {name: tmp_path_factory.mktemp(f"tp-{name}") for name in TP_FAMILIES}
    for name, path in paths.items():
        FAMILIES[name].build(path)
    jobs = [(path, _tp_plans()) for path in paths.values()]
    each = run_plans_on_each(jobs, 2, max_sequence_length=MAX_SEQUENCE_LENGTH)
    return {
        name: (path, reports) for (name, path), reports in zip(paths.items(), each, strict=True)
    }


@pytest.mark.slow  # starts tensor-parallel rank processes
@pytest.mark.parametrize("name", TP_FAMILIES)
def test_two_ranks_match_one(name: str, two_rank_reports: dict[str, tuple[Path, Any]]) -> None:
    from tests.shard.tp_utils import assert_same_outputs, run_plans

    tmp_path, reports = two_rank_reports[name]
    (single,) = run_plans(tmp_path, _tp_plans(), 1, max_sequence_length=MAX_SEQUENCE_LENGTH)
    assert not any(isinstance(o, str) for o in single.outputs), single.outputs
    assert sum(len(o.tokens) for o in reports[0].outputs if not isinstance(o, str)) == 9
    assert_same_outputs(single.outputs, reports[0].outputs)
    assert reports[1].worker_error is None
    # every expert matrix is split: each rank reads half of it
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        names = [n for n in f.keys() if "expert" in n or "_linear" in n]  # noqa: SIM118
        experts = {n: f.get_slice(n).get_shape() for n in names}
    assert experts
    for expert, shape in experts.items():
        half = math.prod(shape) // 2
        assert [report.reads.get(expert) for report in reports] == [half, half], expert
