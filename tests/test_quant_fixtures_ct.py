"""The compressed-tensors fixtures (tests/quant_fixtures/compressed_tensors.py): each recipe
writes the tensors and config NOTES-compressed-tensors.md describes, a decoder written from
those notes alone reproduces compressed-tensors' decompression bit for bit, and the oracle
(transformers' loader) holds exactly the dequantized weights, close to the float ones, and
generates."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from compressed_tensors.quantization import QuantizationArgs, QuantizationStatus
from safetensors.torch import load_file

from tests.quant_fixtures.compressed_tensors import (
    RECIPES,
    dequantized_state,
    load_reference,
    recipe_scheme,
    save_compressed,
)

VOCAB = 256
PROMPT = [5, 17, 42, 99, 3, 250]
NEW_TOKENS = 6

_COMMON: dict[str, Any] = dict(vocab_size=VOCAB, eos_token_id=2, bos_token_id=1)
# family: config class, model class, config parameters (hidden 64, intermediate 128, 2 layers)
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=False,
        ),
    ),
    "qwen2-tied": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=True,
        ),
    ),
    "gpt-neox": (
        "GPTNeoXConfig",
        "GPTNeoXForCausalLM",
        dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4),
    ),
    "falcon-gqa": (
        "FalconConfig",
        "FalconForCausalLM",
        dict(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=8,
            num_kv_heads=2,
            new_decoder_architecture=True,
            tie_word_embeddings=False,
        ),
    ),
    "gpt-bigcode-mqa": (
        "GPTBigCodeConfig",
        "GPTBigCodeForCausalLM",
        dict(n_embd=64, n_inner=128, n_layer=2, n_head=4, multi_query=True),
    ),
}

# The tensors of the Llama gate_proj (128 x 64): name suffix -> (dtype, shape).
_INT4 = {
    "weight_packed": (torch.int32, (128, 8)),
    "weight_scale": (torch.float32, (128, 2)),
    "weight_shape": (torch.int64, (2,)),
}
GATE_PROJ_TENSORS: dict[str, dict[str, tuple[torch.dtype, tuple[int, ...]]]] = {
    "w4a16-group32": _INT4,
    "w4a16-group32-asym": _INT4 | {"weight_zero_point": (torch.int32, (16, 2))},
    "w4a16-group32-actorder-weight": _INT4,
    "w8a16-channel": {
        "weight_packed": (torch.int32, (128, 16)),
        "weight_scale": (torch.float32, (128, 1)),
        "weight_shape": (torch.int64, (2,)),
    },
    "fp8-tensor": {
        "weight": (torch.float8_e4m3fn, (128, 64)),
        "weight_scale": (torch.float32, (1,)),
    },
    "fp8-channel": {
        "weight": (torch.float8_e4m3fn, (128, 64)),
        "weight_scale": (torch.float32, (128, 1)),
    },
    "fp8-block": {
        "weight": (torch.float8_e4m3fn, (128, 64)),
        "weight_scale": (torch.float32, (4, 2)),
    },
    "w8a8-int8-channel": {
        "weight": (torch.int8, (128, 64)),
        "weight_scale": (torch.float32, (128, 1)),
    },
}
FORMATS = {
    "fp8-tensor": "float-quantized",
    "fp8-channel": "float-quantized",
    "fp8-block": "float-quantized",
    "w8a8-int8-channel": "int-quantized",
}


def tiny_model(family: str, seed: int = 0) -> Any:
    """A tiny random float32 causal LM of ``family``; weights wider than the default init
    (no near-ties in the logits), biases non-zero."""
    config_class, model_class, params = FAMILIES[family]
    config = getattr(transformers, config_class)(**_COMMON, **params)
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 2:
                param.normal_(0.0, 0.15)
            elif name.endswith("bias"):
                param.normal_(0.0, 0.1)
    return model


def greedy(model: Any, new_tokens: int = NEW_TOKENS) -> tuple[list[int], torch.Tensor]:
    """``model``'s greedy continuation of PROMPT and the logits of its first step."""
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
            eos_token_id=None,
        )
    return out.sequences[0, len(PROMPT) :].tolist(), out.logits[0][0]


@pytest.fixture(scope="module")
def llama() -> Any:
    return tiny_model("llama")


@pytest.fixture(scope="module")
def llama_checkpoints(llama: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every recipe's checkpoint of the tiny Llama."""
    root = tmp_path_factory.mktemp("ct")
    paths = {}
    for recipe in RECIPES:
        save_compressed(llama, root / recipe, recipe)
        paths[recipe] = root / recipe
    return paths


# --- a decoder written from NOTES-compressed-tensors.md alone ----------------------------


def _unpack_rows(words: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """The first ``count`` unsigned ``bits``-bit fields of each row of int32 ``words``,
    field j at bit (j * bits) % 32 of word (j * bits) // 32 (4 and 8 bits never straddle)."""
    unsigned = words.to(torch.int64) & 0xFFFFFFFF
    j = torch.arange(count)
    return (unsigned[:, (j * bits) // 32] >> ((j * bits) % 32)) & ((1 << bits) - 1)


def _per_element(scale: torch.Tensor, args: Any, shape: tuple[int, int]) -> torch.Tensor:
    """A scale (or zero point) tensor broadcast to one value per weight element."""
    rows, cols = shape
    if args.strategy == "tensor":
        return scale.reshape(1, 1).expand(rows, cols)
    if args.strategy == "channel":
        return scale.reshape(rows, 1).expand(rows, cols)
    if args.strategy == "group":
        return scale.repeat_interleave(args.group_size, dim=1)
    height, width = args.block_structure
    return scale.repeat_interleave(height, 0)[:rows].repeat_interleave(width, 1)[:, :cols]


def decode_by_the_notes(tensors: dict[str, torch.Tensor], recipe: str) -> torch.Tensor:
    """One linear's dense weight from its checkpoint tensors (local names), float32."""
    args = recipe_scheme(recipe).weights
    assert args is not None
    scale = tensors["weight_scale"].float()
    if "weight_packed" in tensors:
        rows, cols = tensors["weight_shape"].tolist()
        offset = 1 << (args.num_bits - 1)
        stored = _unpack_rows(tensors["weight_packed"], args.num_bits, cols).float()
        zero = torch.full_like(scale, float(offset))
        if "weight_zero_point" in tensors:  # packed along the output rows
            zero = _unpack_rows(tensors["weight_zero_point"].T, args.num_bits, rows).T.float()
        return (stored - _per_element(zero, args, (rows, cols))) * _per_element(
            scale, args, (rows, cols)
        )
    quantized = tensors["weight"].float()
    rows, cols = quantized.shape
    return quantized * _per_element(scale, args, (rows, cols))


# --- the tests --------------------------------------------------------------------------------


def test_the_recipes() -> None:
    assert tuple(GATE_PROJ_TENSORS) == RECIPES
    assert "w4a16-actorder" not in RECIPES  # 0.20.0 cannot write weight_g_idx
    with pytest.raises(ValueError, match="unknown recipe"):
        recipe_scheme("w4a16-actorder")
    with pytest.raises(ValueError, match="actorder='group' has been removed"):
        QuantizationArgs(num_bits=4, strategy="group", group_size=32, actorder="group")


@pytest.mark.parametrize("recipe", RECIPES)
def test_checkpoint_layout(recipe: str, llama_checkpoints: dict[str, Path]) -> None:
    """The tensors and the quantization_config each recipe writes."""
    path = llama_checkpoints[recipe]
    tensors = load_file(path / "model.safetensors")
    prefix = "model.layers.0.mlp.gate_proj."
    gate = {k.removeprefix(prefix): v for k, v in tensors.items() if k.startswith(prefix)}
    layout = {name: (t.dtype, tuple(t.shape)) for name, t in gate.items()}
    assert layout == GATE_PROJ_TENSORS[recipe]
    if "weight_shape" in gate:
        assert gate["weight_shape"].tolist() == [128, 64]
    # Every linear but lm_head is quantized; the rest stays plain float32.
    quantized = {n.removesuffix("weight_scale") for n in tensors if n.endswith(".weight_scale")}
    assert len(quantized) == 14
    plain = [n for n in tensors if not any(n.startswith(module) for module in quantized)]
    assert "lm_head.weight" in plain and "model.embed_tokens.weight" in plain
    assert all(tensors[name].dtype == torch.float32 for name in plain)

    config = json.loads((path / "config.json").read_text())["quantization_config"]
    fmt = FORMATS.get(recipe, "pack-quantized")
    assert config["quant_method"] == "compressed-tensors"
    assert config["format"] == fmt
    assert config["quantization_status"] == "compressed"
    assert config["ignore"] == ["lm_head"]
    assert config["version"] == "0.20.0"
    assert list(config["config_groups"]) == ["group_0"]
    group = config["config_groups"]["group_0"]
    assert group["targets"] == ["Linear"] and group["format"] == fmt
    scheme = recipe_scheme(recipe)
    assert group["weights"] == scheme.model_dump()["weights"]
    assert (group["input_activations"] is not None) == (recipe == "w8a8-int8-channel")
    assert ("weight_zero_point" in gate) == (not group["weights"]["symmetric"])


def test_actorder_weight_is_the_group_layout(llama_checkpoints: dict[str, Path]) -> None:
    plain = load_file(llama_checkpoints["w4a16-group32"] / "model.safetensors")
    ordered = load_file(llama_checkpoints["w4a16-group32-actorder-weight"] / "model.safetensors")
    assert plain.keys() == ordered.keys()
    assert all(torch.equal(plain[name], ordered[name]) for name in plain)


@pytest.mark.parametrize("recipe", RECIPES)
def test_notes_decoder_matches_the_library(recipe: str, llama_checkpoints: dict[str, Path]) -> None:
    tensors = load_file(llama_checkpoints[recipe] / "model.safetensors")
    dense = dequantized_state(llama_checkpoints[recipe])
    for name, weight in dense.items():
        module = name.removesuffix("weight")
        local = {k.removeprefix(module): v for k, v in tensors.items() if k.startswith(module)}
        assert torch.equal(decode_by_the_notes(local, recipe), weight), name


def _error_bound(recipe: str, original: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The largest round-to-nearest error each weight may have: half a step for integers;
    for float8 e4m3, 1/16 of the value (3 mantissa bits) or half a subnormal step."""
    args = recipe_scheme(recipe).weights
    assert args is not None
    rows, cols = original.shape
    per_element = _per_element(scale.float(), args, (rows, cols))
    if args.type == "float":
        return original.abs() / 16 + per_element / 1024 + 1e-7
    return per_element / 2 * (1 + 1e-5) + 1e-7


@pytest.mark.parametrize("recipe", RECIPES)
def test_reference_holds_the_dequantized_weights(
    recipe: str, llama: Any, llama_checkpoints: dict[str, Path]
) -> None:
    path = llama_checkpoints[recipe]
    reference = load_reference(path)
    dense = dequantized_state(path)
    tensors = load_file(path / "model.safetensors")
    state = reference.state_dict()
    original = llama.state_dict()
    assert len(dense) == 14 and not hasattr(reference.config, "quantization_config")
    for name, weight in dense.items():
        module = reference.get_submodule(name.removesuffix(".weight"))
        assert type(module) is torch.nn.Linear and not hasattr(module, "quantization_scheme")
        assert torch.equal(state[name], weight), name
        scale = tensors[name.removesuffix("weight") + "weight_scale"]
        error = (weight - original[name]).abs()
        assert (error <= _error_bound(recipe, original[name], scale)).all(), name
        assert (weight != original[name]).float().mean() > 0.5, name
    # Nothing else changed: the original model class with these weights gives the same
    # logits, and the forward quantizes nothing.
    dequantized = copy.deepcopy(llama)
    dequantized.load_state_dict(dense, strict=False)
    tokens, logits = greedy(reference)
    tokens_again, logits_again = greedy(dequantized)
    assert tokens == tokens_again and len(tokens) == NEW_TOKENS
    torch.testing.assert_close(logits, logits_again, rtol=0, atol=1e-5)
    _, float_logits = greedy(llama, 1)
    assert not torch.equal(logits, float_logits)


@pytest.mark.parametrize("recipe", ["w4a16-group32", "fp8-block"])
def test_weight_only_routes_agree(recipe: str, llama_checkpoints: dict[str, Path]) -> None:
    """transformers' default route (decompressed at once) gives the same model output as
    the dequantize-on-load route for weight-only schemes: no weight fake-quantization."""
    path = llama_checkpoints[recipe]
    default_route = load_reference(path, quantize_activations=True)
    gate = default_route.model.layers[0].mlp.gate_proj
    assert gate.quantization_status == QuantizationStatus.DECOMPRESSED
    assert torch.equal(gate.weight, dequantized_state(path)["model.layers.0.mlp.gate_proj.weight"])
    tokens, logits = greedy(default_route)
    tokens_again, logits_again = greedy(load_reference(path))
    assert tokens == tokens_again
    torch.testing.assert_close(logits, logits_again, rtol=0, atol=1e-6)


def test_w8a8_activations_are_fake_quantized_per_token(
    llama_checkpoints: dict[str, Path],
) -> None:
    path = llama_checkpoints["w8a8-int8-channel"]
    gate = load_reference(path, quantize_activations=True).model.layers[0].mlp.gate_proj
    torch.manual_seed(1)
    x = torch.randn(2, 5, 64)
    scale = x.abs().amax(dim=-1, keepdim=True) / 127.5
    x_q = torch.round(torch.clamp(x / scale, -128, 127)) * scale
    with torch.no_grad():
        out = gate(x)
        torch.testing.assert_close(out, torch.nn.functional.linear(x_q, gate.weight))
        assert not torch.allclose(out, torch.nn.functional.linear(x, gate.weight), atol=1e-4)
    dense_gate = load_reference(path).model.layers[0].mlp.gate_proj
    assert torch.equal(dense_gate.weight, gate.weight)
    with torch.no_grad():
        torch.testing.assert_close(dense_gate(x), torch.nn.functional.linear(x, gate.weight))


def test_the_activation_route_refuses_packed_zero_points(
    llama_checkpoints: dict[str, Path],
) -> None:
    with pytest.raises(ValueError, match="packed zero points"):
        load_reference(llama_checkpoints["w4a16-group32-asym"], quantize_activations=True)


@pytest.mark.parametrize("family", sorted(set(FAMILIES) - {"llama"}))
@pytest.mark.parametrize("recipe", ["w4a16-group32-asym", "fp8-block"])
def test_other_families(family: str, recipe: str, tmp_path: Path) -> None:
    """Every Linear but the output projection is quantized, biases stay float, and the
    reference holds the dequantized weights and generates."""
    model = tiny_model(family)
    output = model.get_output_embeddings()
    output_name = next(name for name, m in model.named_modules() if m is output)
    linears = {name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    save_compressed(model, tmp_path, recipe)
    config = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert config["ignore"] == [output_name]
    dense = dequantized_state(tmp_path)
    assert {name.removesuffix(".weight") for name in dense} == linears - {output_name}
    tensors = load_file(tmp_path / "model.safetensors")
    biases = [name for name in tensors if name.endswith(".bias")]
    assert all(tensors[name].dtype == torch.float32 for name in biases)
    reference = load_reference(tmp_path)
    state = reference.state_dict()
    for name, weight in dense.items():
        assert torch.equal(state[name], weight), name
    for name in biases:
        assert torch.equal(state[name], model.state_dict()[name]), name
    tokens, _ = greedy(reference)
    assert len(tokens) == NEW_TOKENS
    if recipe == "fp8-block":  # transformers' default route leaves the output layer alone
        default_route = load_reference(tmp_path, quantize_activations=True)
        output_weight = default_route.get_output_embeddings().weight
        assert torch.equal(output_weight, model.get_output_embeddings().weight)
        assert greedy(default_route)[0] == tokens


def test_the_callers_model_is_untouched(tmp_path: Path) -> None:
    fresh = tiny_model("llama")
    before = {name: t.clone() for name, t in fresh.state_dict().items()}
    forward = fresh.model.layers[0].mlp.gate_proj.forward
    save_compressed(fresh, tmp_path, "w4a16-group32-asym")
    after = fresh.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[name], after[name]) for name in before)
    assert not any(hasattr(m, "quantization_scheme") for m in fresh.modules())
    assert fresh.model.layers[0].mlp.gate_proj.forward == forward
    assert not fresh._forward_pre_hooks
