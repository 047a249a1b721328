"""``--load-format dummy``: random weights from config.json alone, shaped as real ones.

For each native family (and the variants that change its layout) a tiny model is saved by
transformers; its checkpoint layout must be what the family's ``checkpoint_shapes`` says,
and a model created with dummy weights from a copy of its config.json alone must hold the
same tensors (names, shapes, dtypes) as the model loaded from the checkpoint, on one rank
and on each of two tensor-parallel ranks.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from safetensors import safe_open

from tests.shard.driving import Router
from tests.shard.tp_utils import Request, make_plans, run_plans
from tgis.shard.checkpoints.dummy_weights import DummyWeights, parameter_count
from tgis.shard.checkpoints.model_config import ModelConfig
from tgis.shard.checkpoints.weights import Weights
from tgis.shard.config import EngineSettings, ShardConfig
from tgis.shard.errors import StartupError
from tgis.shard.loader import load_runner
from tgis.shard.native.attention.kv_cache import BLOCK_SIZE
from tgis.shard.native.attention.selection import select_attention_backend
from tgis.shard.native.models import model_class
from tgis.shard.native.runtime.model_runner import ModelRunner
from tgis.shard.parallel.group import TensorParallel

MAX_SEQUENCE_LENGTH = 128
_COMMON: dict[str, Any] = dict(vocab_size=256, bos_token_id=1, eos_token_id=2)
_LLAMA: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
_FALCON: dict[str, Any] = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4)

# name → (transformers config class, model class, config parameters)
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", _LLAMA),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(_LLAMA, sliding_window=None)),
    "granite-tied": (
        "GraniteConfig",
        "GraniteForCausalLM",
        dict(_LLAMA, tie_word_embeddings=True, embedding_multiplier=12.0, logits_scaling=16.0),
    ),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(_LLAMA, tie_word_embeddings=False)),
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(_LLAMA, num_local_experts=4, num_experts_per_tok=2),
    ),
    "qwen2-moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        dict(
            _LLAMA,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            num_experts=4,
            num_experts_per_tok=2,
            mlp_only_layers=[1],
        ),
    ),
    "granite-moe": (
        "GraniteMoeConfig",
        "GraniteMoeForCausalLM",
        dict(_LLAMA, num_local_experts=4, num_experts_per_tok=2),
    ),
    "qwen3-moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(
            _LLAMA,
            head_dim=32,
            moe_intermediate_size=32,
            num_experts=4,
            num_experts_per_tok=2,
            mlp_only_layers=[0],
        ),
    ),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(_LLAMA, head_dim=32, attention_bias=True)),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", _LLAMA),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(_LLAMA, pad_token_id=0)),
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", dict(_LLAMA, sliding_window=64)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(_LLAMA, head_dim=16, sliding_window=8)),
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(_LLAMA, head_dim=16, sliding_window=8),
    ),
    "gpt-bigcode-mqa": (
        "GPTBigCodeConfig",
        "GPTBigCodeForCausalLM",
        dict(n_embd=64, n_layer=2, n_head=4, n_positions=256, multi_query=True),
    ),
    "gpt-neox": (
        "GPTNeoXConfig",
        "GPTNeoXForCausalLM",
        dict(
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=256,
            rotary_pct=0.25,
        ),
    ),
    "falcon-new-gqa": (
        "FalconConfig",
        "FalconForCausalLM",
        dict(_FALCON, num_kv_heads=2, new_decoder_architecture=True, tie_word_embeddings=False),
    ),
    "falcon-old-mqa": (
        "FalconConfig",
        "FalconForCausalLM",
        dict(_FALCON, new_decoder_architecture=False, multi_query=True, parallel_attn=True),
    ),
    "falcon-old-sequential-bias": (
        "FalconConfig",
        "FalconForCausalLM",
        dict(
            _FALCON,
            new_decoder_architecture=False,
            multi_query=False,
            parallel_attn=False,
            bias=True,
        ),
    ),
}


def save_family(name: str, path: Path) -> Path:
    """Save a random tiny model of family ``name`` (transformers) to ``path``."""
    config_class, model_class_name, params = FAMILIES[name]
    config = getattr(transformers, config_class)(**_COMMON, **params)
    torch.manual_seed(0)
    getattr(transformers, model_class_name)(config).save_pretrained(path)
    return path


def config_only(model_dir: Path, path: Path) -> Path:
    """A directory holding only ``model_dir``'s config.json."""
    path.mkdir()
    shutil.copy(model_dir / "config.json", path / "config.json")
    return path


def tensors_of(obj: Any, path: str = "") -> dict[str, torch.Tensor]:
    """Every tensor a native model holds, by attribute path (``layers.0.attn.qkv.weight``)."""
    if isinstance(obj, torch.Tensor):
        return {path: obj}
    found: dict[str, torch.Tensor] = {}
    if isinstance(obj, list | tuple):
        for i, item in enumerate(obj):
            found |= tensors_of(item, f"{path}.{i}")
    elif type(obj).__module__.startswith(
        (
            "tgis.shard.native.models",
            "tgis.shard.native.linear.sharded",
            "tgis.shard.native.linear.moe",
        )
    ):
        for key, value in vars(obj).items():
            found |= tensors_of(value, f"{path}.{key}" if path else key)
    return found


def layout(model: Any) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    return {name: (tuple(t.shape), t.dtype) for name, t in tensors_of(model).items()}


def checkpoint_layout(model_dir: Path) -> dict[str, tuple[int, ...]]:
    """Name → shape of every tensor in the directory's safetensors files."""
    shapes = {}
    for path in model_dir.glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """(saved checkpoint directory, directory with only its config.json)."""
    root = tmp_path_factory.mktemp(request.param)
    real = save_family(request.param, root / "real")
    return real, config_only(real, root / "dummy")


def make_runner(model_dir: Path, **kwargs: Any) -> ModelRunner:
    kwargs.setdefault("kv_cache_blocks", 16)
    runner = load_runner(
        ShardConfig(model_name=str(model_dir), max_sequence_length=MAX_SEQUENCE_LENGTH, **kwargs)
    )
    assert isinstance(runner, ModelRunner)
    return runner


def test_checkpoint_shapes_are_the_checkpoint_layout(family: tuple[Path, Path]) -> None:
    real, _ = family
    config = ModelConfig.from_dir(real)
    shapes = model_class(config).checkpoint_shapes(config, MAX_SEQUENCE_LENGTH)
    assert shapes == checkpoint_layout(real)


def test_dummy_model_has_the_loaded_models_tensors(family: tuple[Path, Path]) -> None:
    real, dummy = family
    loaded = make_runner(real)
    created = make_runner(dummy, load_format="dummy")
    tensors = layout(loaded.model)
    assert len(tensors) >= 2 * 6 and "embed.weight" in tensors  # every layer's, and more
    assert layout(created.model) == tensors
    assert created.kv_cache.k[0].shape == loaded.kv_cache.k[0].shape
    # ... and it generates: a prompt prefilled, then decodes, every id in the vocabulary.
    router = Router(created)
    router.add(1, [5, 6, 7, 8, 9])
    router.step({1: 5})
    for _ in range(3):
        router.decode([1])
    assert len(router.generated[1]) == 4
    assert all(0 <= t < 256 for t in router.generated[1])


@pytest.mark.parametrize("rank", [0, 1])
def test_each_tensor_parallel_rank_creates_its_own_slice(
    family: tuple[Path, Path], rank: int
) -> None:
    real, dummy = family
    tp = TensorParallel(rank=rank, world_size=2)  # building a model needs no collective
    config = ModelConfig.from_dir(dummy)
    factory = model_class(config)
    attention = select_attention_backend(torch.device("cpu"), BLOCK_SIZE)
    cpu, dtype = torch.device("cpu"), torch.float32
    loaded = factory(config, Weights(real, cpu, dtype, tp=tp), attention, MAX_SEQUENCE_LENGTH)
    shapes = factory.checkpoint_shapes(config, MAX_SEQUENCE_LENGTH)
    weights = DummyWeights(shapes, cpu, dtype, tp=tp)
    created = factory(config, weights, attention, MAX_SEQUENCE_LENGTH)
    assert layout(created) == layout(loaded)
    # this rank created its share only: less than the whole model, more than half of it
    # (norms, biases and replicated KV heads are on both ranks)
    assert parameter_count(shapes) / 2 <= weights.created < parameter_count(shapes)


def test_values_are_deterministic_and_replicas_agree() -> None:
    shapes = {"w.weight": (8, 6), "v.weight": (8, 6), "n.weight": (6,), "b.bias": (8,)}

    def weights(rank: int = 0) -> DummyWeights:
        tp = TensorParallel(rank, 2)
        return DummyWeights(shapes, torch.device("cpu"), torch.bfloat16, tp=tp)

    first = weights()
    w = first.get("w.weight")
    assert w.dtype == torch.bfloat16 and w.shape == (8, 6)
    assert torch.equal(w, weights().get("w.weight"))  # the same at every start
    assert not torch.equal(w, first.get("v.weight"))
    assert 0.01 < w.float().std() < 0.04
    assert torch.equal(first.get("n.weight"), torch.ones(6, dtype=torch.bfloat16))
    assert torch.equal(first.get("b.bias"), torch.zeros(8, dtype=torch.bfloat16))
    assert first.created == 48 + 48 + 6 + 8
    # the same slice on two ranks (a replicated KV head) holds the same values; the two
    # halves of a sharded tensor differ
    assert torch.equal(first.get_rows("w.weight", 0, 4), weights(1).get_rows("w.weight", 0, 4))
    assert not torch.equal(first.get_sharded("w.weight", 0), weights(1).get_sharded("w.weight", 0))
    assert weights(1).get_sharded("w.weight", 1).shape == (8, 3)
    assert first.get_row_ranges("w.weight", [(0, 2), (4, 5)]).shape == (3, 6)
    assert "w.weight" in first and "missing.weight" not in first
    with pytest.raises(StartupError, match="not in the model's checkpoint layout"):
        first.get("missing.weight")


def test_parameter_count() -> None:
    assert parameter_count({"a.weight": (2, 3), "a.bias": (4,)}) == 10


def test_fallback_only_models_fail_in_one_line(tmp_path: Path) -> None:
    gpt2 = transformers.GPT2Config(
        n_embd=32, n_layer=1, n_head=2, architectures=["GPT2LMHeadModel"], **_COMMON
    )
    gpt2.save_pretrained(tmp_path)
    with pytest.raises(StartupError) as error:
        make_runner(tmp_path, load_format="dummy")
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith(
        "--load-format dummy needs the native engine, but GPT2LMHeadModel is served by the "
        "transformers fallback: unsupported model architecture 'GPT2LMHeadModel'"
    )


def test_native_model_forced_to_the_fallback_fails(tmp_path: Path) -> None:
    transformers.LlamaConfig(**_COMMON, **_LLAMA).save_pretrained(tmp_path)
    with pytest.raises(StartupError, match=r"transformers fallback: TGIS_ENGINE=hf$"):
        make_runner(tmp_path, load_format="dummy", engine=EngineSettings(engine="hf"))


def test_unknown_load_format_is_refused() -> None:
    with pytest.raises(StartupError, match="unknown --load-format 'npz'"):
        ShardConfig(load_format="npz").validate()


@pytest.mark.slow  # starts tensor-parallel rank processes
def test_two_ranks_serve_dummy_weights_in_lock_step(tmp_path: Path) -> None:
    """Two real gloo ranks on dummy weights from config.json alone: nothing is read, and the
    replicas agree at every Step (the lock-step check stops both ranks on any difference)."""
    transformers.LlamaConfig(**_COMMON, **_LLAMA).save_pretrained(tmp_path)
    plans = make_plans([Request(1, (5, 6, 7, 8, 9), max_new_tokens=4)])
    reports = run_plans(tmp_path, plans, world_size=2, load_format="dummy")
    assert [r.reads for r in reports] == [{}, {}]
    outputs = reports[0].outputs
    assert all(not isinstance(output, str) for output in outputs), outputs
    assert sum(len(output.tokens) for output in outputs if not isinstance(output, str)) == 4
    assert [r.kv_shape[-2] for r in reports] == [1, 1]  # one of the two KV heads each
