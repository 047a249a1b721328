"""Which quantization a model is served with (tgis/shard/checkpoints/quantized/scheme.py),
the one-line refusal of variants tgis does not read, and of quantized values whose scales
are missing."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.shard.models import TinyModel
from tgis.shard.checkpoints.quantized.readers import layout_reader
from tgis.shard.checkpoints.quantized.scheme import (
    QuantScheme,
    canonical_quantize_flag,
    checkpoint_scheme,
    resolve_quantization,
)
from tgis.shard.config import ShardConfig
from tgis.shard.errors import StartupError
from tgis.shard.loader import load_runner

GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True, "sym": True}
# What compressed-tensors writes for FP8 per channel (the keys that matter here).
FP8_CT = {
    "quant_method": "compressed-tensors",
    "format": "float-quantized",
    "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 8}}},
    "ignore": ["lm_head"],
}


def test_a_dense_checkpoint_has_no_scheme(tmp_path: Path) -> None:
    assert checkpoint_scheme(tmp_path, {"model_type": "llama"}) is None


def test_schemes_from_config_json() -> None:
    gptq = checkpoint_scheme(Path("."), {"quantization_config": GPTQ})
    assert gptq == QuantScheme(
        "gptq", True, bits=4, group_size=128, source="config.json quantization_config"
    )
    assert gptq.describe() == "gptq, 4-bit, group 128 (in config.json quantization_config)"
    per_channel = checkpoint_scheme(Path("."), {"quantization_config": GPTQ | {"group_size": -1}})
    assert per_channel is not None and "per channel" in per_channel.describe()
    fp8 = checkpoint_scheme(Path("."), {"quantization_config": FP8_CT})
    assert fp8 is not None and (fp8.method, fp8.variant) == (
        "compressed-tensors",
        "float-quantized",
    )
    native = checkpoint_scheme(
        Path("."), {"quantization_config": {"quant_method": "FP8", "weight_block_size": [128, 128]}}
    )
    assert native is not None and native.method == "fp8"


def test_quantize_config_json_is_gptq_as_tgis_reads_it(tmp_path: Path) -> None:
    (tmp_path / "quantize_config.json").write_text(
        json.dumps({"bits": 8, "group_size": 32, "desc_act": False, "sym": False})
    )
    scheme = checkpoint_scheme(tmp_path, {"model_type": "llama"})
    assert scheme == QuantScheme("gptq", True, bits=8, group_size=32, source="quantize_config.json")
    (tmp_path / "quantize_config.json").write_text("{not json")
    with pytest.raises(StartupError, match=r"quantize_config\.json is not readable JSON"):
        checkpoint_scheme(tmp_path, {})


@pytest.mark.parametrize(
    "config,message",
    [
        (
            {"quant_method": "gptq_marlin"},
            "quantized as gptq_marlin .* a format tgis does not serve",
        ),
        ({"quant_method": "gguf"}, "quantized as gguf"),
        ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quantized as bitsandbytes"),
        ({"quant_method": "mystery"}, "unknown quant_method 'mystery'"),
        ({"bits": 4}, "names no quant_method"),
        ("gptq", "is not a JSON object"),
    ],
)
def test_unknown_and_foreign_checkpoint_formats_fail_naming_them(
    config: object, message: str
) -> None:
    with pytest.raises(StartupError, match=message):
        checkpoint_scheme(Path("."), {"quantization_config": config})


def test_flags_aliases_and_unknown_values(caplog: pytest.LogCaptureFixture) -> None:
    assert canonical_quantize_flag(None) is None and canonical_quantize_flag(" ") is None
    assert canonical_quantize_flag("GPTQ") == "gptq"
    with caplog.at_level(logging.INFO, logger="tgis.shard.checkpoints.quantized.scheme"):
        assert canonical_quantize_flag("bitsandbytes") == "int8"
        assert canonical_quantize_flag("eetq") == "int8"
    assert "TGIS's name for weight-only int8" in caplog.text
    with pytest.raises(StartupError, match="unknown quantize 'nf4': expected one of gptq, awq"):
        canonical_quantize_flag("nf4")


def test_a_flag_may_repeat_the_checkpoint_but_not_contradict_it() -> None:
    gptq = checkpoint_scheme(Path("."), {"quantization_config": GPTQ})
    assert resolve_quantization(None, gptq) is gptq
    assert resolve_quantization("gptq", gptq) is gptq
    with pytest.raises(
        StartupError, match="--quantize awq contradicts the checkpoint, which is gptq"
    ):
        resolve_quantization("awq", gptq)
    with pytest.raises(StartupError, match="--quantize int8 contradicts"):
        resolve_quantization("bitsandbytes", gptq)
    with pytest.raises(StartupError, match="--quantize gptq needs a gptq checkpoint"):
        resolve_quantization("gptq", None)
    assert resolve_quantization("int8", None) == QuantScheme("int8", pre_quantized=False)
    assert resolve_quantization(None, None) is None


@pytest.mark.parametrize(
    "config,message",
    [
        (GPTQ | {"bits": 3}, "gptq with 3-bit weights is not supported; tgis reads 4- and 8-bit"),
        (GPTQ | {"checkpoint_format": "marlin"}, "gptq checkpoint_format 'marlin' is not"),
        (
            {"quant_method": "awq", "bits": 4, "version": "gemv"},
            "awq version 'gemv' is not supported",
        ),
        (
            FP8_CT | {"format": "marlin-24"},
            "compressed-tensors format 'marlin-24' is not supported; tgis reads pack-quantized",
        ),
        (
            FP8_CT | {"config_groups": {"g": {"weights": {"num_bits": 4, "type": "float"}}}},
            "float 4-bit weights are not supported",
        ),
    ],
)
def test_unsupported_variants_fail_in_one_line_naming_them(config: object, message: str) -> None:
    scheme = checkpoint_scheme(Path("."), {"quantization_config": config})
    with pytest.raises(StartupError, match=message) as failure:
        layout_reader(scheme)
    assert "\n" not in str(failure.value)


@pytest.mark.parametrize("load_format", ["auto", "dummy"])
def test_fp8_values_without_their_scales_are_refused_not_served_as_dense(
    tiny_model: TinyModel, tmp_path: Path, load_format: str
) -> None:
    """A compressed-tensors FP8 config over FP8 weights whose scales are missing: the
    values alone are not the model's, so loading fails naming the missing tensor. (With
    the dummy load format every layer is quantized as configured, so it loads.)"""
    model = tmp_path / "fp8"
    shutil.copytree(tiny_model.path, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(config | {"quantization_config": FP8_CT}))
    tensors = load_file(model / "model.safetensors")
    tensors = {
        k: v.to(torch.float8_e4m3fn) if k.endswith("q_proj.weight") else v
        for k, v in tensors.items()
    }
    save_file(tensors, model / "model.safetensors", metadata={"format": "pt"})
    if load_format == "dummy":
        load_runner(ShardConfig(model_name=str(model), load_format=load_format))
        return
    with pytest.raises(StartupError) as failure:
        load_runner(ShardConfig(model_name=str(model), load_format=load_format))
    message = str(failure.value)
    assert message == (
        "model.layers.0.self_attn.q_proj.weight is stored as float8_e4m3fn but "
        "model.layers.0.self_attn.q_proj.weight_scale is missing: its values cannot be read "
        "without their scale"
    )
