"""Resolution rules: max_sequence_length, shard count, HF cache, dtype, framework, tokenizer."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from tgis.launcher.config import ConfigError, LauncherConfig
from tgis.launcher.environment import resolve_hf_hub_cache, resolve_num_shard
from tgis.launcher.model_config import read_model_config, resolve_max_sequence_length
from tgis.launcher.resolution import resolve
from tgis.launcher.tokenizer import prepare_tokenizer
from tgis.launcher.validation import normalize_deployment_framework, resolve_dtype

from .helpers import write_model

LOG = logging.getLogger("test-launcher")


# -- max_sequence_length ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("config", "expected", "source"),
    [
        ({"max_position_embeddings": 4096, "n_positions": 512}, 4096, "model"),
        ({"n_positions": 512, "max_seq_len": 100}, 512, "model"),  # T5-style
        ({"max_seq_len": 100, "seq_length": 200}, 100, "model"),
        ({"seq_length": 200}, 200, "model"),
        ({"max_sequence_length": 300}, 300, "model"),
        ({"max_seq_length": 400}, 400, "model"),
        ({"seq_len": 500}, 500, "model"),
        ({"max_position_embeddings": "4096", "seq_len": 500}, 500, "model"),  # not an integer
        ({"max_position_embeddings": True, "seq_len": 64}, 64, "model"),  # bool is not a length
        ({"text_config": {"max_position_embeddings": 8192}}, 8192, "model"),  # Gemma 3 4B+
        ({"text_config": {"model_type": "gemma3_text"}}, 131_072, "model"),  # its default
        ({"hidden_size": 64}, 2048, "default"),
        ({}, 2048, "default"),
    ],
)
def test_max_sequence_length_from_config_json(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, config: dict, expected: int, source: str
) -> None:
    write_model(tmp_path, config)
    with caplog.at_level(logging.INFO, logger=LOG.name):
        value = resolve_max_sequence_length(None, read_model_config(tmp_path), LOG)
    assert value == expected
    assert f"Using {source} max_sequence_length: {expected}" in caplog.messages


def test_user_max_sequence_length_wins_with_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    write_model(tmp_path, {"max_position_embeddings": 256})
    with caplog.at_level(logging.INFO, logger=LOG.name):
        assert resolve_max_sequence_length(1000, read_model_config(tmp_path), LOG) == 1000
        assert resolve_max_sequence_length(100, read_model_config(tmp_path), LOG) == 100
    assert "Using user-defined max_sequence_length: 1000" in caplog.messages
    assert "max_sequence_length (1000) is larger than the model's (256)" in caplog.messages
    assert "Using user-defined max_sequence_length: 100" in caplog.messages
    assert "max_sequence_length (100) is larger" not in " ".join(caplog.messages)


LONGROPE = {
    "model_type": "phi3",
    "max_position_embeddings": 131_072,
    "original_max_position_embeddings": 4096,
    "rope_parameters": {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [4.0]},
}


@pytest.mark.parametrize(
    ("config", "engine", "expected"),
    [
        (LONGROPE, "auto", 4096),
        (LONGROPE, "native", 4096),
        (LONGROPE, " HF ", 131_072),  # the transformers fallback serves the long factors
        (dict(LONGROPE, rope_parameters=None, rope_scaling={"type": "su"}), "auto", 4096),
        (dict(LONGROPE, rope_parameters={"type": "yarn"}), "auto", 4096),  # Phi-3's yarn
        (dict(LONGROPE, model_type="qwen2", rope_parameters={"type": "yarn"}), "auto", 131_072),
        (  # in rope_parameters only (transformers 5 writes both)
            dict(
                LONGROPE,
                original_max_position_embeddings=None,
                rope_parameters={"rope_type": "longrope", "original_max_position_embeddings": 512},
            ),
            "auto",
            512,
        ),
        (dict(LONGROPE, max_position_embeddings=4096), "auto", 4096),
        (dict(LONGROPE, rope_parameters={"rope_type": "default"}), "auto", 131_072),
    ],
)
def test_default_max_sequence_length_within_longropes_short_factors(
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    config: dict,
    engine: str,
    expected: int,
) -> None:
    """A LongRoPE model (Phi-3 128k) starts natively with no flags: the default stops at
    original_max_position_embeddings, which the shard refuses to exceed, with a log line."""
    write_model(tmp_path, config)
    with caplog.at_level(logging.INFO, logger=LOG.name):
        value = resolve_max_sequence_length(None, read_model_config(tmp_path), LOG, engine)
    assert value == expected
    assert f"Using model max_sequence_length: {expected}" in caplog.messages
    capped = expected < 131_072 and config["max_position_embeddings"] > expected
    assert ("not its max_position_embeddings (131072)" in caplog.text) == capped
    assert resolve_max_sequence_length(8000, read_model_config(tmp_path), LOG, engine) == 8000


def test_unreadable_config_json(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="cannot read model config"):
        read_model_config(tmp_path)


# -- number of shards ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("num_shard", "env", "expected"),
    [
        (None, {}, 1),
        (3, {}, 3),
        (None, {"NUM_GPUS": "2"}, 2),
        (2, {"NUM_GPUS": "2"}, 2),
        (None, {"NUM_GPUS": " "}, 1),  # blank: unset
        (None, {"CUDA_VISIBLE_DEVICES": "0,1,2"}, 3),
        (None, {"CUDA_VISIBLE_DEVICES": ""}, 1),  # TGIS: empty counts as 1
        (None, {"NVIDIA_VISIBLE_DEVICES": "0,1"}, 2),
        (None, {"CUDA_VISIBLE_DEVICES": "3", "NVIDIA_VISIBLE_DEVICES": "0,1"}, 1),
        (None, {"NUM_GPUS": "4", "CUDA_VISIBLE_DEVICES": "0"}, 4),
        (2, {"CUDA_VISIBLE_DEVICES": "0,1,2,3"}, 2),
    ],
)
def test_num_shard(num_shard: int | None, env: dict[str, str], expected: int) -> None:
    assert resolve_num_shard(num_shard, env) == expected


@pytest.mark.parametrize(
    ("num_shard", "env", "message"),
    [
        (None, {"NUM_GPUS": "x"}, "NUM_GPUS must be a positive integer"),
        (None, {"NUM_GPUS": "1.5"}, "NUM_GPUS must be a positive integer"),
        (2, {"NUM_GPUS": "1"}, "NUM_GPUS and num_shard are set to different values (1 and 2)"),
        (0, {}, "`num_shard` / NUM_GPUS cannot be < 1"),
        (None, {"NUM_GPUS": "0"}, "`num_shard` / NUM_GPUS cannot be < 1"),
    ],
)
def test_num_shard_errors(num_shard: int | None, env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError) as e:
        resolve_num_shard(num_shard, env)
    assert str(e.value) == message


# -- HF cache -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"HF_HUB_CACHE": "/c"}, "/c"),
        ({"TRANSFORMERS_CACHE": "/c"}, "/c"),
        ({"HUGGINGFACE_HUB_CACHE": "/c", "TRANSFORMERS_CACHE": "/c"}, "/c"),
        ({"HF_HUB_CACHE": "/c", "TRANSFORMERS_CACHE": "/c", "HF_HOME": "/h"}, "/c"),
        ({"HF_HOME": "/h"}, "/h/hub"),
        ({"HOME": "/home/u"}, "/home/u/.cache/huggingface/hub"),
    ],
)
def test_hf_hub_cache(env: dict[str, str], expected: str) -> None:
    assert resolve_hf_hub_cache(env, LOG) == Path(expected)


def test_deprecated_cache_var_warns(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger=LOG.name):
        resolve_hf_hub_cache({"TRANSFORMERS_CACHE": "/c"}, LOG)
    assert "TRANSFORMERS_CACHE is deprecated, use HF_HUB_CACHE instead" in caplog.messages


def test_model_found_in_hf_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "hub"
    repo = cache / "models--acme--tiny"
    write_model(repo / "snapshots" / "abc123", {"n_positions": 77})
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    for var in ("HUGGINGFACE_HUB_CACHE", "TRANSFORMERS_CACHE", "NUM_GPUS"):
        monkeypatch.delenv(var, raising=False)
    cfg = resolve(
        LauncherConfig(model_name="acme/tiny", shard_uds_path=str(tmp_path / "s")),
        {"HF_HUB_CACHE": str(cache)},
        LOG,
    )
    assert cfg.model_dir == repo / "snapshots" / "abc123"
    assert cfg.max_sequence_length == 77
    assert cfg.served_model_name == "acme/tiny"
    assert cfg.hf_hub_cache == cache


# -- dtype and framework ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dtype", "dtype_str", "expected"),
    [
        (None, None, None),
        ("fp16", None, "float16"),
        ("half", None, "float16"),
        (None, "BF16", "bfloat16"),
        ("float", "fp32", "float32"),
        ("float16", "half", "float16"),
    ],
)
def test_dtype(dtype: str | None, dtype_str: str | None, expected: str | None) -> None:
    assert resolve_dtype(dtype, dtype_str) == expected


def test_deployment_frameworks(caplog: pytest.LogCaptureFixture) -> None:
    for name in ("hf_transformers", "tgis_native", "hf_accelerate", "hf_optimum_ort",
                 "hf_optimum_bt", "ibm_fms"):  # fmt: skip
        assert normalize_deployment_framework(name, LOG) == name
    with caplog.at_level(logging.WARNING, logger=LOG.name):
        assert normalize_deployment_framework("hf_custom_tp", LOG) == "tgis_native"
    assert any("hf_custom_tp is deprecated" in m for m in caplog.messages)
    with pytest.raises(ConfigError, match="unknown deployment_framework 'x'"):
        normalize_deployment_framework("x", LOG)


# -- tokenizer ----------------------------------------------------------------------------------


def test_existing_tokenizer_json_is_used(model_dir: Path) -> None:
    tokenizer = prepare_tokenizer(model_dir, LOG)
    assert tokenizer.path == model_dir / "tokenizer.json"
    assert tokenizer.temp_dir is None


def test_slow_tokenizer_is_converted(tmp_path: Path) -> None:
    """A BERT vocab.txt without tokenizer.json: transformers writes one to a temp dir."""
    model = write_model(tmp_path / "bert", {"model_type": "bert"}, tokenizer=False)
    (model / "vocab.txt").write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\nhello\nworld\n")
    (model / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "BertTokenizer"}))
    tokenizer = prepare_tokenizer(model, LOG)
    try:
        assert tokenizer.temp_dir is not None
        assert tokenizer.path == tokenizer.temp_dir / "tokenizer.json"
        assert "hello" in json.loads(tokenizer.path.read_text())["model"]["vocab"]
    finally:
        tokenizer.cleanup()
    assert not tokenizer.temp_dir.exists()
