"""Loading checkpoints (sharded, tied, other Llama variants) and start-up failures."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from transformers import MistralConfig, MistralForCausalLM

from tests.shard.driving import Router
from tests.shard.models import TinyModel, build_tiny_llama
from tgis.shard.cli import main
from tgis.shard.config import ShardConfig
from tgis.shard.loader import load_runner

PROMPT = [9, 30, 31, 200, 17, 4, 99, 100, 101, 5, 6, 7, 8, 250, 3, 3, 40, 41, 42, 43]
NEW_TOKENS = 6


def greedy_of(model_dir: Path, **config: object) -> list[int]:
    runner = load_runner(ShardConfig(model_name=str(model_dir), kv_cache_blocks=16, **config))  # type: ignore[arg-type]
    router = Router(runner)
    router.add(1, PROMPT)
    router.step({1: len(PROMPT)})
    for _ in range(NEW_TOKENS - 1):
        router.decode([1])
    return router.generated[1]


def test_sharded_checkpoint_with_index(tiny_model: TinyModel, tmp_path: Path) -> None:
    tiny_model.hf.save_pretrained(tmp_path, max_shard_size="60KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("model-*-of-*.safetensors"))) > 1
    assert greedy_of(tmp_path) == tiny_model.greedy(PROMPT, NEW_TOKENS)[0]


@pytest.mark.parametrize(
    "overrides",
    [
        {"tie_word_embeddings": True},
        {"attention_bias": True, "mlp_bias": True, "head_dim": 24},
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
                "rope_theta": 5000.0,
            }
        },
    ],
    ids=["tied", "biases-head-dim", "llama3-rope"],
)
def test_llama_variants_match_hf(overrides: dict[str, object], tmp_path: Path) -> None:
    hf = build_tiny_llama(tmp_path, seed=1, **overrides)
    if overrides.get("tie_word_embeddings"):
        from safetensors import safe_open

        with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
            assert "lm_head.weight" not in f.keys()  # noqa: SIM118
    assert greedy_of(tmp_path) == TinyModel(tmp_path, hf).greedy(PROMPT, NEW_TOKENS)[0]


def test_mistral_without_sliding_window_matches_hf(tmp_path: Path) -> None:
    torch.manual_seed(2)
    config = MistralConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        max_position_embeddings=512,
        sliding_window=None,
    )
    hf = MistralForCausalLM(config).eval()
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.15)
    hf.save_pretrained(tmp_path)
    hf.generation_config.eos_token_id = None
    assert greedy_of(tmp_path) == TinyModel(tmp_path, hf).greedy(PROMPT, NEW_TOKENS)[0]
    config_path = tmp_path / "config.json"
    raw = json.loads(config_path.read_text())
    raw["sliding_window"] = 128
    config_path.write_text(json.dumps(raw))
    # The native engine serves the window (tests/shard/native/models/test_sliding_window.py).
    runner = load_runner(ShardConfig(model_name=str(tmp_path)))
    assert runner.info.attention_backend != "hf_transformers"
    assert [layer.attn.window for layer in runner.model.layers] == [128, 128]  # type: ignore[attr-defined]


def test_bfloat16_runs_on_cpu(tiny_model: TinyModel) -> None:
    runner = load_runner(
        ShardConfig(model_name=str(tiny_model.path), dtype="bfloat16", kv_cache_blocks=8)
    )
    assert runner.info.dtype == "bfloat16"
    assert runner.kv_cache.k[0].dtype == torch.bfloat16
    router = Router(runner)
    router.add(1, PROMPT)
    router.step({1: len(PROMPT)})
    assert router.generated[1][0] == tiny_model.greedy(PROMPT, NEW_TOKENS)[0][0]


def test_default_cpu_kv_cache_size(tiny_model: TinyModel) -> None:
    runner = load_runner(
        ShardConfig(model_name=str(tiny_model.path), max_batch_size=3, max_sequence_length=100)
    )
    assert runner.info.num_blocks == 3 * 7  # ceil(100 / 16) blocks per sequence
    assert runner.kv_cache.k[0].shape == (21, 16, 2, 16)


def fail(args: list[str], tmp_path: Path, **env: str) -> str:
    """Run the CLI, expect a start-up failure, return the termination-log message."""
    log = tmp_path / "termination-log"
    result = CliRunner().invoke(
        main, ["serve", *args], env={"TGIS_TERMINATION_LOG": str(log), **env}
    )
    assert result.exit_code == 1, result.output
    message = log.read_text().strip()
    assert "\n" not in message
    return message


def test_startup_failures_are_one_line(tiny_model: TinyModel, tmp_path: Path) -> None:
    model = str(tiny_model.path)
    assert fail([model], tmp_path, WORLD_SIZE="2") == "WORLD_SIZE=2 needs --sharded"
    assert "MASTER_ADDR and MASTER_PORT must be set" in fail(
        [model, "--sharded"], tmp_path, WORLD_SIZE="2", MASTER_ADDR="", MASTER_PORT=""
    )
    assert "unsupported --dtype 'int4'" in fail([model, "--dtype", "int4"], tmp_path)
    assert fail([model, "--quantize", "gptq"], tmp_path) == (
        "--quantize gptq needs a gptq checkpoint, and this one is dense (no quantization_config "
        "in config.json, no quantize_config.json); int8 and fp8 quantize a dense checkpoint at "
        "load"
    )
    assert fail([model, "--quantize", "squeezellm"], tmp_path).startswith(
        "unknown quantize 'squeezellm': expected one of gptq, awq"
    )
    assert "not found" in fail(["no-such-org/no-such-model"], tmp_path)
    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    shutil.copy(tiny_model.path / "config.json", no_weights / "config.json")
    assert "no safetensors weights found" in fail([str(no_weights)], tmp_path)
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(
        json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": 50})
    )
    assert "unsupported model architecture 'GPT2LMHeadModel'" in fail(
        [str(gpt2)], tmp_path, TGIS_ENGINE="native"
    )


def test_a_soft_capped_model_gets_the_exact_backend_on_cuda() -> None:
    """Gemma 2 soft-caps its attention scores, which only the reference and cpu_paged do:
    on CUDA the reference is started unless a backend was forced; elsewhere nothing
    changes (cpu_paged, the CPU default, caps them)."""
    from tgis.shard.checkpoints.model_config import ModelConfig
    from tgis.shard.native.loading.loader import _attention_choice

    def config(raw: dict[str, object]) -> ModelConfig:
        return ModelConfig(
            model_dir=Path("."), model_type="gemma2", architecture="Gemma2ForCausalLM",
            vocab_size=8, max_position_embeddings=64, eos_token_ids=(1,), torch_dtype=None,
            raw=raw,
        )  # fmt: skip

    capped, plain = config({"attn_logit_softcapping": 50.0}), config({})
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert _attention_choice(None, capped, cuda) == "torch_paged"
    assert _attention_choice("sdpa_varlen", capped, cuda) == "sdpa_varlen"  # refused later
    assert _attention_choice(None, plain, cuda) is None
    assert _attention_choice(None, capped, cpu) is None


def test_a_model_with_attention_sinks_gets_a_backend_with_them_on_cuda() -> None:
    """gpt-oss's sinks are not in flash-attn (which FLASH_ATTENTION=true would start): on
    CUDA triton_paged is started unless a backend was forced; the CPU default has them."""
    from tgis.shard.checkpoints.model_config import ModelConfig
    from tgis.shard.native.loading.loader import _attention_choice

    config = ModelConfig(
        model_dir=Path("."), model_type="gpt_oss", architecture="GptOssForCausalLM",
        vocab_size=8, max_position_embeddings=64, eos_token_ids=(1,), torch_dtype=None, raw={},
    )  # fmt: skip
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert _attention_choice(None, config, cuda) == "triton_paged"
    assert _attention_choice("sdpa_varlen", config, cuda) == "sdpa_varlen"  # refused later
    assert _attention_choice(None, config, cpu) is None
