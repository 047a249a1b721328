"""Every supported model family against its transformers implementation.

For each family (and the config variants that change its code path) a tiny random model is
built from its transformers config class and saved; the shard's loader and runner then
generate greedily for a batch of prompts of different lengths (prefilled together, decoded
together, and with chunked prefill joining a running decode) and must match
``generate(do_sample=False)`` token for token, with logprobs within 1e-4.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.prefix_oracle import prefixed_greedy
from tests.shard.driving import Router
from tests.shard.families import FAMILIES, LOGPROBS, NEW_TOKENS, PROMPTS, assert_matches_hf
from tests.shard.models import TinyModel
from tgis.shard.checkpoints.model_config import ModelConfig
from tgis.shard.config import EngineSettings, ShardConfig
from tgis.shard.errors import StartupError
from tgis.shard.loader import load_runner
from tgis.shard.native.models import check_config
from tgis.shard.native.runtime.model_runner import ModelRunner
from tgis.shard_api.messages import DetailOptions

MAX_SEQUENCE_LENGTH = 256


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """One saved tiny model per family variant, with its HF reference."""
    path = tmp_path_factory.mktemp(request.param)
    return TinyModel(path, FAMILIES[request.param].build(path))


def make_runner(path: Path, **kwargs: Any) -> ModelRunner:
    """A fresh ModelRunner for the model directory ``path``."""
    kwargs.setdefault("kv_cache_blocks", 64)
    kwargs.setdefault("max_sequence_length", MAX_SEQUENCE_LENGTH)
    return load_runner(ShardConfig(model_name=str(path), **kwargs))


def generate_batch(path: Path, prompts: dict[int, list[int]]) -> Router:
    """Prefill ``prompts`` in one step, then decode them together (with logprobs)."""
    router = Router(make_runner(path))
    for rid, prompt in prompts.items():
        router.add(rid, prompt, details=LOGPROBS)
    router.step({rid: len(p) for rid, p in prompts.items()})
    for _ in range(NEW_TOKENS - 1):
        router.decode(prompts)
    return router


def test_batched_greedy_matches_hf(family_model: TinyModel) -> None:
    router = generate_batch(family_model.path, PROMPTS)
    assert_matches_hf(router, family_model, PROMPTS)


def test_chunked_prefill_joining_a_decode_matches_hf(family_model: TinyModel) -> None:
    router = Router(make_runner(family_model.path), seed=1)
    router.add(2, PROMPTS[2])
    router.step({2: len(PROMPTS[2])})
    router.add(3, PROMPTS[3])
    for chunk in (10, 10, 9):  # prompt 3 in chunks while 2 decodes
        router.step({2: 1, 3: chunk})
    for _ in range(NEW_TOKENS - 1):
        router.decode([2, 3])
    assert router.generated[3] == family_model.greedy(PROMPTS[3], NEW_TOKENS)[0]
    assert router.generated[2] == family_model.greedy(PROMPTS[2], NEW_TOKENS + 3)[0]


def test_prompt_prefix_matches_hf_inputs_embeds(family_model: TinyModel, tmp_path: Path) -> None:
    """A prompt-tuning prefix replaces the word embeddings of its positions; each family's
    own scaling (Granite's multiplier) and position embeddings (GPTBigCode's) apply on top,
    as transformers applies them to ``inputs_embeds``."""
    hf: Any = family_model.hf
    width = hf.get_input_embeddings().weight.shape[1]
    prefix = torch.randn(4, width, generator=torch.Generator().manual_seed(5)) * 0.5
    (tmp_path / "store" / "p").mkdir(parents=True)
    torch.save(prefix, tmp_path / "store" / "p" / "decoder.pt")
    runner = make_runner(family_model.path, prefix_store_path=str(tmp_path / "store"))
    router = Router(runner)
    prompt = PROMPTS[2]
    router.add(1, prompt, prefix_id="p", prefix_length=runner.lookup_prefix("p").length)
    router.step({1: 4 + len(prompt)})
    for _ in range(NEW_TOKENS - 1):
        router.decode([1])
    assert router.generated[1] == prefixed_greedy(hf, prefix, prompt, NEW_TOKENS)[0]


def test_kv_cache_spec_reports_kv_heads(tmp_path: Path) -> None:
    expected = {"gpt-bigcode-mqa": 1, "falcon-new-gqa": 2, "falcon-old-mqa": 1, "qwen2-tied": 1}
    for name, kv_heads in expected.items():
        FAMILIES[name].build(tmp_path / name)
        spec = make_runner(tmp_path / name).model.kv_cache_spec  # type: ignore[attr-defined]
        assert (spec.num_layers, spec.num_kv_heads) == (2, kv_heads), name


def _rewrite_config(src: Path, dst: Path, edit: Callable[[dict[str, Any]], None]) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    edit(config)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def _refinedweb(model_type: str) -> Callable[[dict[str, Any]], None]:
    """Falcon's original remote-code config.json names for the same weights."""

    def edit(config: dict[str, Any]) -> None:
        config.update(architectures=["RWForCausalLM"], model_type=model_type)
        config["n_head"] = config.pop("num_attention_heads")
        config["n_layer"] = config.pop("num_hidden_layers")
        kv_heads = config.pop("num_kv_heads")
        if config.pop("new_decoder_architecture"):
            config["n_head_kv"] = kv_heads

    return edit


def _neox_v4(config: dict[str, Any]) -> None:
    """transformers v4's GPT-NeoX rotary settings (Pythia's config.json)."""
    rope = config.pop("rope_parameters")
    config.update(rotary_pct=rope["partial_rotary_factor"], rotary_emb_base=rope["rope_theta"])
    del config["attention_bias"]


def _phi3_su(config: dict[str, Any]) -> None:
    """Phi-3's first config.json: LongRoPE named ``su`` in ``rope_scaling``."""
    rope = config.pop("rope_parameters")
    config.update(rope_theta=rope["rope_theta"])
    config["rope_scaling"] = dict(
        type="su", short_factor=rope["short_factor"], long_factor=rope["long_factor"]
    )


@pytest.mark.parametrize(
    ("name", "edit"),
    [
        ("falcon-new-gqa", _refinedweb("RefinedWeb")),
        ("falcon-old-mqa", _refinedweb("RefinedWebModel")),
        ("gpt-neox-parallel", _neox_v4),
        ("gpt-neox-sequential", _neox_v4),
        ("phi3-longrope", _phi3_su),
    ],
    ids=[
        "refinedweb-40b",
        "refinedwebmodel-7b",
        "gpt-neox-v4-base",
        "gpt-neox-v4-pct",
        "phi3-su",
    ],
)
def test_older_config_names_match_hf(
    name: str, edit: Callable[[dict[str, Any]], None], tmp_path: Path
) -> None:
    hf = FAMILIES[name].build(tmp_path / "model")
    path = _rewrite_config(tmp_path / "model", tmp_path / "older", edit)
    prompts = {3: PROMPTS[3]}
    assert_matches_hf(generate_batch(path, prompts), TinyModel(path, hf), prompts)


@pytest.mark.parametrize(
    ("name", "edit", "kwargs", "message"),
    [
        (
            "falcon-old-mqa",
            lambda c: c.update(alibi=True),
            {},
            "FalconForCausalLM: ALiBi position biases",
        ),
        (
            "gpt-bigcode-mqa",
            lambda c: None,
            {"max_sequence_length": 1024},
            "--max-sequence-length 1024 exceeds the model's 512 learned positions",
        ),
        (
            "mistral-window",
            lambda c: c.update(sliding_window=0),
            {},
            "sliding_window 0 is not a positive number of tokens",
        ),
        (
            "gpt-neox-parallel",
            lambda c: c.update(hidden_act="gelu_python_bogus"),
            {},
            "GPTNeoXForCausalLM: unsupported activation 'gelu_python_bogus'",
        ),
        (
            "phi3-longrope",
            lambda c: None,
            {"max_sequence_length": 512},
            r"Phi3ForCausalLM: longrope switches to its long factors past "
            r"original_max_position_embeddings \(256\).*--max-sequence-length <= 256",
        ),
    ],
    ids=[
        "falcon-alibi",
        "bigcode-positions",
        "mistral-window-zero",
        "neox-activation",
        "phi3-longrope-past-original",
    ],
)
def test_unsupported_configs_are_refused_at_start_up(
    tmp_path: Path,
    name: str,
    edit: Callable[[dict[str, Any]], None],
    kwargs: dict[str, Any],
    message: str,
) -> None:
    # The native engine refuses these; under the default TGIS_ENGINE=auto they would be
    # served by the transformers fallback instead (tests/shard/fallback/test_runner.py).
    FAMILIES[name].build(tmp_path / "model")
    path = _rewrite_config(tmp_path / "model", tmp_path / "edited", edit)
    with pytest.raises(StartupError, match=message):
        make_runner(path, engine=EngineSettings(engine="native"), **kwargs)
    (path / "model.safetensors").unlink()  # the check alone reads no weights
    max_sequence_length = kwargs.get("max_sequence_length", MAX_SEQUENCE_LENGTH)
    with pytest.raises(StartupError, match=message):
        check_config(ModelConfig.from_dir(path), max_sequence_length)


def test_supported_configs_pass_the_check(family_model: TinyModel) -> None:
    check_config(ModelConfig.from_dir(family_model.path), MAX_SEQUENCE_LENGTH)


# ---- tensor parallelism: 2 ranks (gloo, CPU) against 1 ----------------------------------

# Variant → KV heads each of 2 ranks caches (a single KV head is replicated).
TP_VARIANTS = {
    "granite": 1,
    "qwen2-biases": 1,
    "gpt-bigcode-mqa": 1,
    "gpt-neox-parallel": 2,
    "falcon-new-gqa": 1,
    "falcon-old-mqa": 1,
    "qwen3": 1,
    "olmo2": 1,
    "phi3-longrope": 1,
    "starcoder2-window": 1,
    "gemma2": 1,
    "gemma3": 1,
}
TP_DETAILS = DetailOptions(logprobs=True, ranks=True, top_n=2, generated_tokens=True)


@pytest.fixture(scope="module")
def two_rank_reports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    """Every TP variant's model directory and its reports on two ranks: one pair of rank
    processes runs the variants one after the other (`run_plans_on_each`), where a pair per
    variant spent ~3 s of its ~4 s starting Python and torch."""
    from tests.shard.tp_utils import run_plans_on_each

    paths = {}
    for name in sorted(TP_VARIANTS):
        paths[name] = tmp_path_factory.mktemp(f"tp-{name}")
        FAMILIES[name].build(paths[name])
    jobs = [(path, _tp_plans()) for path in paths.values()]
    each = run_plans_on_each(jobs, 2, max_sequence_length=MAX_SEQUENCE_LENGTH)
    return {
        name: (path, reports) for (name, path), reports in zip(paths.items(), each, strict=True)
    }


def _tp_plans() -> list[Any]:
    from tests.shard.tp_utils import Request, make_plans

    return make_plans(
        [
            Request(1, tuple(PROMPTS[3]), 5, details=TP_DETAILS, chunk=12),
            Request(2, tuple(PROMPTS[2]), 4, details=TP_DETAILS, arrives=1),
        ]
    )


@pytest.mark.slow  # starts tensor-parallel rank processes
@pytest.mark.parametrize("name", sorted(TP_VARIANTS))
def test_two_ranks_match_one(name: str, two_rank_reports: dict[str, tuple[Path, Any]]) -> None:
    from tests.shard.tp_utils import assert_same_outputs, run_plans

    path, reports = two_rank_reports[name]
    (single,) = run_plans(path, _tp_plans(), 1, max_sequence_length=MAX_SEQUENCE_LENGTH)
    assert not any(isinstance(o, str) for o in single.outputs), single.outputs
    assert sum(len(o.tokens) for o in reports[0].outputs if not isinstance(o, str)) == 9
    assert_same_outputs(single.outputs, reports[0].outputs)
    assert reports[1].worker_error is None
    for report in reports:
        assert report.kv_shape[2] == TP_VARIANTS[name], f"rank {report.rank} KV heads"
    _check_matrices_are_split(path, reports)


def _check_matrices_are_split(path: Path, reports: list[Any]) -> None:
    """Each rank reads only part of every matrix, and the ranks together all of it."""
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), "pt") as f:
        shapes = {name: f.get_slice(name).get_shape() for name in f.keys()}  # noqa: SIM118
    for name, shape in shapes.items():
        if len(shape) == 2:
            per_rank = [report.reads.get(name, 0) for report in reports]
            numel = shape[0] * shape[1]
            assert all(0 < n < numel for n in per_rank), f"{name}: {per_rank} of {numel}"
            assert sum(per_rank) >= numel, f"{name}: {per_rank} of {numel}"


# ---- LoRA adapters on the newer families' projections ------------------------------------


@pytest.mark.parametrize(
    ("name", "targets"),
    [
        ("phi3-longrope", ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]),
        ("olmo2", None),
        ("qwen3", None),
    ],
)
def test_lora_adapters_match_peft(name: str, targets: list[str] | None, tmp_path: Path) -> None:
    """A LoRA adapter on every projection (Phi-3's fused qkv_proj and gate_up_proj too):
    PEFT's greedy tokens and logprobs, beside a request without the adapter."""
    from tests.lora_oracle import lora_greedy, save_random_lora

    FAMILIES[name].build(tmp_path / "base")
    save_random_lora(tmp_path / "base", tmp_path / "adapters" / "a", seed=1, targets=targets)
    runner = make_runner(tmp_path / "base", adapter_cache=str(tmp_path / "adapters"))
    runner.lookup_adapter("a")
    router = Router(runner)
    router.add(1, PROMPTS[2], details=LOGPROBS, adapter_id="a")
    router.add(2, PROMPTS[3], details=LOGPROBS)
    router.step({1: len(PROMPTS[2]), 2: len(PROMPTS[3])})
    for _ in range(5):
        router.decode([1, 2])
    for rid, adapter, prompt in (
        (1, tmp_path / "adapters" / "a", PROMPTS[2]),
        (2, None, PROMPTS[3]),
    ):
        tokens, logits = lora_greedy(tmp_path / "base", adapter, prompt, 6)
        assert router.generated[rid] == tokens, rid
        details = [t.token for o in router.outputs for t in o.tokens if t.request_id == rid]
        for detail, step_logits in zip(details, logits, strict=True):
            expected = torch.log_softmax(step_logits, dim=-1)[detail.token_id].item()
            assert abs(detail.logprob - expected) < 1e-4, rid
    assert router.generated[1] != lora_greedy(tmp_path / "base", None, PROMPTS[2], 6)[0]
