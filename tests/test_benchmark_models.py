"""The model configs shipped for benchmarks (benchmarks/models/) and the synthetic tokenizer
(benchmarks/make_synthetic_tokenizer.py) that lets the router serve them with dummy weights.

Nothing here allocates a big model: parameter counts come from the checkpoint layouts, and
the tensor-parallel split of the 70B model is built on the meta device (shapes only).
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import time
from functools import cache
from pathlib import Path
from types import ModuleType

import pytest
import torch
from tokenizers import Tokenizer

from tgis.launcher.model_config import model_max_sequence_length
from tgis.router.intake.tokenization import RouterTokenizer
from tgis.shard.checkpoints.dummy_weights import DummyWeights, parameter_count
from tgis.shard.checkpoints.model_config import ModelConfig
from tgis.shard.native.attention.kv_cache import BLOCK_SIZE
from tgis.shard.native.attention.selection import select_attention_backend
from tgis.shard.native.models import check_config, model_class
from tgis.shard.native.models.llama import LlamaArgs
from tgis.shard.parallel.group import TensorParallel

REPO_ROOT = Path(__file__).resolve().parent.parent
MODELS = REPO_ROOT / "benchmarks" / "models"
SCRIPT = REPO_ROOT / "benchmarks" / "make_synthetic_tokenizer.py"
TEXT = "Return the number of items.\n\tÜnïcødé, 你好 and emoji 🙂 round-trip!  Two  spaces."

# name → (parameters, max_position_embeddings, BOS id added in front of inputs, EOS ids)
SHIPPED = {
    "llama-3.1-8b": (8_030_261_248, 131072, 128000, (128001, 128008, 128009)),
    "llama-3.1-70b": (70_553_706_496, 131072, 128000, (128001, 128008, 128009)),
    "granite-3-8b": (8_170_848_256, 4096, None, (0,)),
    "llama-3.2-1b": (1_235_814_400, 131072, 128000, (128001, 128008, 128009)),
}


@cache
def script() -> ModuleType:
    """benchmarks/make_synthetic_tokenizer.py (not a package) as a module."""
    spec = importlib.util.spec_from_file_location("make_synthetic_tokenizer", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def shipped(name: str) -> ModelConfig:
    return ModelConfig.from_dir(MODELS / name)


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_config_parses_with_the_published_parameter_count(name: str) -> None:
    parameters, positions, _, eos = SHIPPED[name]
    config = shipped(name)
    assert config.torch_dtype == "bfloat16"
    assert config.eos_token_ids == eos
    assert config.max_position_embeddings == positions
    assert model_max_sequence_length(config.raw) == positions  # the launcher's default
    check_config(config, positions)
    shapes = model_class(config).checkpoint_shapes(config, positions)
    assert parameter_count(shapes) == parameters
    billions = {
        "llama-3.1-8b": 8.0,
        "llama-3.1-70b": 70.6,
        "granite-3-8b": 8.2,
        "llama-3.2-1b": 1.2,
    }[name]
    assert round(parameters / 1e9, 1) == billions


def test_llama_31_rope_and_granite_multipliers_are_read() -> None:
    llama = LlamaArgs.from_config(shipped("llama-3.1-8b"), 8192)
    assert llama.rope["rope_type"] == "llama3"
    assert (llama.rope["factor"], llama.rope["rope_theta"]) == (8.0, 500000.0)
    assert (llama.num_heads, llama.num_kv_heads, llama.head_dim) == (32, 8, 128)
    assert not llama.tie_word_embeddings
    granite = LlamaArgs.from_config(shipped("granite-3-8b"), 4096)
    assert granite.embedding_multiplier == 12.0
    assert granite.residual_multiplier == 0.22
    assert granite.attention_scale == 0.0078125
    assert granite.logits_scaling == 16.0
    assert granite.tie_word_embeddings
    assert granite.rope["rope_type"] == "default"


@pytest.mark.parametrize("rank", [0, 7])
def test_70b_split_over_8_ranks(rank: int) -> None:
    """Each of 8 ranks holds 1/8 of the heads (one KV head) and of the MLP; shapes only."""
    config = shipped("llama-3.1-70b")
    factory = model_class(config)
    shapes = factory.checkpoint_shapes(config, 8192)
    weights = DummyWeights(
        shapes, torch.device("meta"), torch.bfloat16, tp=TensorParallel(rank, world_size=8)
    )
    attention = select_attention_backend(torch.device("cpu"), BLOCK_SIZE)
    model = factory(config, weights, attention, 8192)
    layer = model.layers[0]
    assert layer.attn.qkv.weight.is_meta
    assert tuple(layer.attn.qkv.weight.shape) == ((8 + 2) * 128, 8192)
    assert tuple(layer.mlp.down.weight.shape) == (8192, 28672 // 8)
    assert model.kv_cache_spec.num_kv_heads == 1
    assert 70.55e9 / 8 < weights.created < 70.57e9 / 8  # its eighth, plus the norms


@pytest.fixture(scope="module", params=sorted(SHIPPED))
def tokenizer_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """A copy of a shipped config with its synthetic tokenizer written next to it."""
    directory = tmp_path_factory.mktemp(request.param)
    shutil.copy(MODELS / request.param / "config.json", directory / "config.json")
    started = time.monotonic()
    assert script().main([str(directory)]) == 0
    assert time.monotonic() - started < 10.0  # about a second for 128k tokens
    return request.param, directory


def test_tokenizer_has_exactly_the_vocabulary_size(tokenizer_dir: tuple[str, Path]) -> None:
    name, directory = tokenizer_dir
    vocab_size = shipped(name).vocab_size
    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    assert tokenizer.get_vocab_size(with_added_tokens=True) == vocab_size
    assert sorted(tokenizer.get_vocab(with_added_tokens=True).values()) == list(range(vocab_size))
    _, _, bos, eos = SHIPPED[name]
    specials = {t.content: i for i, t in tokenizer.get_added_tokens_decoder().items()}
    assert sorted(specials.values()) == sorted({*eos, *([bos] if bos is not None else [])})
    assert specials["<|end_of_text|>"] == eos[0]
    settings = json.loads((directory / "tokenizer_config.json").read_text())
    assert settings["eos_token"] == "<|end_of_text|>"


def test_tokenizer_round_trips_text_for_the_router(tokenizer_dir: tuple[str, Path]) -> None:
    name, directory = tokenizer_dir
    _, _, bos, eos = SHIPPED[name]
    router = RouterTokenizer.from_file(directory / "tokenizer.json")
    assert router.bos_token_id == bos  # Llama 3 puts BOS in front; Granite does not
    ids = router.encode(TEXT)
    assert ids[: 1 if bos is not None else 0] == ([bos] if bos is not None else [])
    assert 10 < len(ids) < len(TEXT.encode())
    assert router.decode(ids) == TEXT
    assert router.decode_output([*ids[1:], eos[0]], eos_token_ids=eos).strip()
    # what a random model samples: any id decodes (special ones to nothing)
    vocab_size = shipped(name).vocab_size
    sampled = [*range(0, vocab_size, 997), vocab_size - 1, *eos]
    assert isinstance(router.decode(sampled), str)
    assert router.decode(list(eos)) == ""


def test_tokenizer_is_deterministic(tmp_path: Path) -> None:
    one = script().build_tokenizer(1000, 1, [2], add_bos=True).to_str()
    assert one == script().build_tokenizer(1000, 1, [2], add_bos=True).to_str()
    tokenizer = Tokenizer.from_str(one)
    assert tokenizer.get_vocab_size() == 1000
    assert tokenizer.encode("abc").ids[0] == 1


def test_script_refuses_a_directory_without_config(tmp_path: Path) -> None:
    assert script().main([str(tmp_path)]) == 1
    with pytest.raises(ValueError, match="outside the vocabulary"):
        script().build_tokenizer(300, 0, [300], add_bos=False)
    with pytest.raises(ValueError, match="too small"):
        script().build_tokenizer(200, 0, [1], add_bos=False)
