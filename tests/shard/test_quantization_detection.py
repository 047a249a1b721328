"""Which quantization a model would be served with (tgis/shard/checkpoints/quantization.py),
and the refusal, in one line at start-up, of every quantized scheme until tgis serves it."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
from conftest import TinyModel

from tgis.shard.checkpoints.quantization import (
    QuantScheme,
    canonical_quantize_flag,
    checkpoint_scheme,
    require_servable,
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
    with caplog.at_level(logging.INFO, logger="tgis.shard.checkpoints.quantization"):
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


def test_every_scheme_is_refused_until_served() -> None:
    require_servable(None)
    with pytest.raises(StartupError, match=r"^fp8 \(at load\): tgis does not serve fp8 quant"):
        require_servable(QuantScheme("fp8", pre_quantized=False))


@pytest.mark.parametrize("load_format", ["auto", "dummy"])
def test_a_quantized_checkpoint_is_refused_at_load_not_served_as_dense(
    tiny_model: TinyModel, tmp_path: Path, load_format: str
) -> None:
    """The tiny model's weights under a config.json that says FP8: before this check it was
    served as if dense (the scales never read), with wrong tokens."""
    model = tmp_path / "fp8"
    shutil.copytree(tiny_model.path, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(config | {"quantization_config": FP8_CT}))
    with pytest.raises(StartupError) as failure:
        load_runner(ShardConfig(model_name=str(model), load_format=load_format))
    message = str(failure.value)
    assert message.startswith(
        "compressed-tensors, float-quantized (in config.json quantization_config): tgis does "
        "not serve compressed-tensors checkpoints yet"
    )
    assert "\n" not in message
