"""--lora-adapters (TGI's flag): the adapters it names are loaded while the shard starts, so
no request waits for them; one that cannot be used stops the start with the reason."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

from tests.shard.adapters.test_lora_store import HEADS, INTER, KV_HEADS, LAYERS, H, llama_sites
from tgis.settings.features import adapter_ids
from tgis.shard.adapters.startup import build_adapters
from tgis.shard.config import ShardConfig
from tgis.shard.errors import StartupError

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=100,
        hidden_size=H,
        intermediate_size=INTER,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config).eval()


def save(model: LlamaForCausalLM, directory: Path) -> None:
    config = LoraConfig(target_modules=["q_proj", "v_proj"], r=4, lora_alpha=8)
    peft: Any = get_peft_model(copy.deepcopy(model), config)
    peft.save_pretrained(directory)


@pytest.fixture
def root(tmp_path: Path, model: LlamaForCausalLM) -> Path:
    directory = tmp_path / "adapters"
    for adapter_id in ("org/lora-a", "lora-b", "lora-c"):
        save(model, directory / adapter_id)
    return directory


def adapters(root: Path, lora_adapters: str, max_loras: int = 8, sites: Any = None) -> Any:
    config = ShardConfig(adapter_cache=str(root), lora_adapters=lora_adapters, max_loras=max_loras)
    sites = llama_sites() if sites is None else sites
    return build_adapters(config, sites, None, CPU, torch.float32)


def test_the_named_adapters_are_loaded_at_start(root: Path) -> None:
    built = adapters(root, " org/lora-a, lora-b,")
    assert built.cache.cached_ids() == ["org/lora-a", "lora-b"]  # before any request
    assert adapters(root, "").cache.cached_ids() == []  # none named: loaded on first use


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("lora-b,missing", "--lora-adapters: can't retrieve adapter with id 'missing': "
         "directory does not exist"),
        ("org/lora-a,../x", "--lora-adapters: Invalid adapter id '../x', must contain only "
         "alphanumeric, _ and - and /"),
    ],
)  # fmt: skip
def test_an_adapter_that_cannot_be_used_stops_the_start(
    root: Path, value: str, message: str
) -> None:
    with pytest.raises(StartupError) as caught:
        adapters(root, value)
    assert str(caught.value) == message


def test_more_lora_adapters_than_stay_loaded_stop_the_start(root: Path) -> None:
    assert adapters(root, "org/lora-a,lora-b", max_loras=2).cache.cached_ids() == [
        "org/lora-a",
        "lora-b",
    ]
    with pytest.raises(StartupError, match=r"more LoRA adapters than --max-loras \(2\)"):
        adapters(root, "org/lora-a,lora-b,lora-c", max_loras=2)


def test_a_model_without_lora_refuses_them_at_start(root: Path) -> None:
    """The transformers fallback runs no LoRA adapter: named at start, it stops the start."""
    with pytest.raises(StartupError, match="adapter type LORA is not currently supported"):
        adapters(root, "lora-b", sites=[])


def test_lora_adapters_need_an_adapter_cache() -> None:
    with pytest.raises(StartupError, match=r"--lora-adapters needs --adapter-cache"):
        ShardConfig(lora_adapters="a").validate()
    ShardConfig(lora_adapters=" , ").validate()  # no id: nothing needed


def test_adapter_ids() -> None:
    assert adapter_ids(None) == adapter_ids(" , ,") == ()
    assert adapter_ids(" a ,b/c,, a") == ("a", "b/c")  # each once, in order
