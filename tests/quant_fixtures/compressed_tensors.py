"""Real compressed-tensors checkpoints of tiny causal LMs, and the oracles that read them back.

``save_compressed(model, path, recipe)`` quantizes every ``nn.Linear`` of an in-memory causal LM
except its output projection (``lm_head``; GPT-NeoX: ``embed_out``) with round-to-nearest
scales, compresses it with compressed-tensors' own ``ModelCompressor`` and writes the
checkpoint (``model.safetensors``, and ``config.json`` whose ``quantization_config`` is the one
``ModelCompressor.update_config`` writes). ``load_reference`` is the oracle: transformers'
``from_pretrained``, which decompresses the checkpoint into a dense model.
``dequantized_state`` is compressed-tensors' own decompression of every quantized weight, for
unit-level comparisons. NOTES-compressed-tensors.md beside this file describes, for the
engineer writing the server-side reader, exactly what each recipe writes.

Recipes (``RECIPES``), each one group of compressed-tensors 0.20.0 targeting ``Linear``:

* ``w4a16-group32``: int4 weights, symmetric, one scale per 32 input columns; pack-quantized.
* ``w4a16-group32-asym``: the same, asymmetric (a packed ``weight_zero_point`` is written).
* ``w4a16-group32-actorder-weight``: ``w4a16-group32`` with ``"actorder": "weight"`` in the
  config, as llm-compressor's GPTQ writes it now that group ordering is gone. It only changes
  the order GPTQ visits columns in, so this is the ``w4a16-group32`` layout (no ``g_idx``);
  with round-to-nearest the tensors are identical too. It is here so that a reader is tested
  on a config carrying ``actorder``.
* ``w8a16-channel``: int8 weights, symmetric, one scale per output row; pack-quantized.
* ``fp8-tensor``, ``fp8-channel``, ``fp8-block``: float8 e4m3 weights with one scale per
  tensor, per output row, or per 32x32 block; float-quantized; weight-only.
* ``w8a8-int8-channel``: int8 weights per output row and dynamic per-token symmetric int8
  input activations (no activation tensors are written); int-quantized.

Left out, because compressed-tensors 0.20.0 cannot write it:

* ``w4a16-actorder`` (group-wise activation ordering, ``weight_g_idx``): 0.20.0 removed
  ``ActivationOrdering.GROUP`` and every trace of ``g_idx``: ``QuantizationArgs(actorder=
  "group")`` (or ``"dynamic"``, or ``True``) raises a ValueError saying it has been removed,
  no compressor writes or reads ``weight_g_idx``, and the same validation makes transformers
  refuse to load an older checkpoint whose config says ``"actorder": "group"``. There is no
  way left to set a group index through the library, and a hand-made one would have no
  oracle.

What happens to the model passed in: nothing. ``save_compressed`` deep-copies it and
quantizes, compresses and saves the copy (compression replaces weights by packed tensors and
patches ``forward``), then drops the copy.
"""

from __future__ import annotations

import copy
import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from compressed_tensors.compressors import BaseCompressor, ModelCompressor
from compressed_tensors.offload import update_offload_parameter
from compressed_tensors.quantization import (
    QuantizationArgs,
    QuantizationConfig,
    QuantizationScheme,
    QuantizationStatus,
    QuantizationStrategy,
    apply_quantization_config,
)
from compressed_tensors.quantization.utils import (
    calculate_qparams,
    maybe_pad_tensor_for_block_quant,
)
from compressed_tensors.utils.match import match_name
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, CompressedTensorsConfig


@dataclass(frozen=True)
class _Recipe:
    """The compressed-tensors scheme of one recipe: ``QuantizationArgs`` fields of the
    weights (and of the input activations, if any) and the checkpoint format."""

    weights: dict[str, Any]
    format: str
    input_activations: dict[str, Any] | None = None


_INT4_GROUP32: dict[str, Any] = dict(
    num_bits=4, type="int", symmetric=True, strategy="group", group_size=32
)
_FP8: dict[str, Any] = dict(num_bits=8, type="float", symmetric=True)

_RECIPES: dict[str, _Recipe] = {
    "w4a16-group32": _Recipe(_INT4_GROUP32, "pack-quantized"),
    "w4a16-group32-asym": _Recipe(_INT4_GROUP32 | dict(symmetric=False), "pack-quantized"),
    "w4a16-group32-actorder-weight": _Recipe(
        _INT4_GROUP32 | dict(actorder="weight"), "pack-quantized"
    ),
    "w8a16-channel": _Recipe(
        dict(num_bits=8, type="int", symmetric=True, strategy="channel"), "pack-quantized"
    ),
    "fp8-tensor": _Recipe(_FP8 | dict(strategy="tensor"), "float-quantized"),
    "fp8-channel": _Recipe(_FP8 | dict(strategy="channel"), "float-quantized"),
    "fp8-block": _Recipe(
        _FP8 | dict(strategy="block", block_structure=[32, 32]), "float-quantized"
    ),
    "w8a8-int8-channel": _Recipe(
        dict(num_bits=8, type="int", symmetric=True, strategy="channel"),
        "int-quantized",
        input_activations=dict(
            num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True
        ),
    ),
}

RECIPES: tuple[str, ...] = tuple(_RECIPES)


def recipe_scheme(recipe: str) -> QuantizationScheme:
    """The compressed-tensors ``QuantizationScheme`` of ``recipe`` (targets: every
    ``Linear``; the output layer is left out by the config's ``ignore``)."""
    if recipe not in _RECIPES:
        raise ValueError(f"unknown recipe {recipe!r}; known: {', '.join(RECIPES)}")
    spec = _RECIPES[recipe]
    inputs = spec.input_activations
    return QuantizationScheme(
        targets=["Linear"],
        weights=QuantizationArgs(**spec.weights),
        input_activations=QuantizationArgs(**inputs) if inputs is not None else None,
        format=spec.format,
    )


def _observed_min_max(
    weight: torch.Tensor, args: QuantizationArgs
) -> tuple[torch.Tensor, torch.Tensor]:
    """The minimum and maximum of ``weight`` over each region that shares one scale, shaped
    like the scale compressed-tensors registers for the strategy (what a min-max observer
    would see)."""
    strategy = args.strategy
    if strategy == QuantizationStrategy.TENSOR:
        return weight.amin().reshape(1), weight.amax().reshape(1)
    if strategy == QuantizationStrategy.CHANNEL:
        return weight.amin(dim=-1, keepdim=True), weight.amax(dim=-1, keepdim=True)
    if strategy == QuantizationStrategy.GROUP:
        assert args.group_size is not None
        if weight.shape[-1] % args.group_size:
            raise ValueError(
                f"{weight.shape[-1]} input columns are not a multiple of the group size "
                f"{args.group_size} (compressed-tensors refuses to quantize them)"
            )
        groups = weight.unflatten(-1, (-1, args.group_size))
        return groups.amin(dim=-1), groups.amax(dim=-1)
    if strategy == QuantizationStrategy.BLOCK:
        assert args.block_structure is not None
        height, width = args.block_structure
        # compressed-tensors pads with zeros too; a zero never changes a block's range,
        # which always includes zero (calculate_qparams widens it to do so).
        padded = maybe_pad_tensor_for_block_quant(weight, (height, width))
        rows, cols = padded.shape
        blocks = padded.reshape(rows // height, height, cols // width, width)
        return blocks.amin(dim=(1, 3)), blocks.amax(dim=(1, 3))
    raise ValueError(f"no round-to-nearest observer here for strategy {strategy!r}")


def _calibrate(module: Any) -> None:
    """Round-to-nearest qparams for ``module``'s weight: min-max over each scale's region,
    turned into a scale (and zero point) by compressed-tensors' ``calculate_qparams``."""
    args = module.quantization_scheme.weights
    weight = module.weight.detach()
    low, high = _observed_min_max(weight, args)
    scale, zero_point = calculate_qparams(low, high, args)
    update_offload_parameter(module, "weight_scale", scale)
    if hasattr(module, "weight_zero_point"):
        update_offload_parameter(module, "weight_zero_point", zero_point)
    module.quantization_status = QuantizationStatus.FROZEN


def _output_layer_name(model: Any) -> str:
    """The name of the model's output projection (``lm_head``; GPT-NeoX: ``embed_out``)."""
    output = model.get_output_embeddings()
    for name, module in model.named_modules():
        if module is output:
            return name
    raise ValueError(f"{type(model).__name__} has no output projection")


def save_compressed(model: torch.nn.Module, path: Path, recipe: str) -> None:
    """Write ``model`` quantized with ``recipe`` to the directory ``path`` as a
    compressed-tensors checkpoint (``model.safetensors``, ``config.json`` with its
    ``quantization_config``, ``generation_config.json``).

    The steps are llm-compressor's, without calibration data: ``apply_quantization_config``
    attaches the recipe's scheme (and empty qparams) to every ``Linear`` but the output
    projection; each weight's scale (and zero point) comes from compressed-tensors'
    ``calculate_qparams`` on the minimum and maximum of the weights each scale covers
    (round-to-nearest, what a min-max observer gives; no GPTQ); ``ModelCompressor``
    infers the config from the modules and compresses them; transformers saves the state
    dict, and ``update_config`` adds the ``quantization_config`` to ``config.json``.

    The written ``ignore`` always names the output projection (compressed-tensors' own
    inference of it misses Falcon's ``lm_head``; see the comment in the body).

    ``model`` itself is left untouched (a deep copy is quantized). Scales are stored in the
    model's dtype (float32 for a float32 model). Group quantization needs the input width to
    be a multiple of 32; block quantization does not (edge blocks are partial).
    """
    scheme = recipe_scheme(recipe)
    work: Any = copy.deepcopy(model).eval()
    output_name = _output_layer_name(work)
    config = QuantizationConfig(config_groups={"group_0": scheme}, ignore=[output_name])
    apply_quantization_config(work, config, show_progress=False)
    with torch.no_grad():
        for module in work.modules():
            if getattr(module, "quantization_scheme", None) is not None:
                _calibrate(module)
    compressor = ModelCompressor.from_pretrained_model(work)
    written = compressor.quantization_config
    assert written is not None
    # ModelCompressor rebuilds `ignore` from the modules, listing an unquantized module only
    # if its class is one of the quantized modules' classes: Falcon's layers are
    # FalconLinear and its lm_head a plain Linear, so lm_head would be left out while the
    # "Linear" target matches it, and transformers' default route would then expect a
    # quantized lm_head. The output projection is named explicitly.
    written.ignore = sorted({*(written.ignore or ()), output_name})
    compressor.compress_model(work)
    work.save_pretrained(path)
    compressor.update_config(str(path))


def load_reference(path: Path, *, quantize_activations: bool = False) -> Any:
    """The oracle: transformers' model of the checkpoint in ``path``, float32, on the CPU,
    in eval mode.

    By default transformers dequantizes while loading (``CompressedTensorsConfig(
    dequantize=True)``: each weight goes through compressed-tensors' compressor
    ``decompress``): the result is a plain dense model, every quantized linear an ordinary
    ``nn.Linear`` whose weight equals ``dequantized_state``'s, with no quantization left in
    its forward and no ``quantization_config``. Input activations are not quantized, so for
    ``w8a8-int8-channel`` this is the "dequantized weights, float activations" reference.

    ``quantize_activations=True`` takes transformers' default compressed-tensors route
    instead (``from_pretrained`` with no ``quantization_config``): the linears keep their
    scheme, and their forward fake-quantizes what the scheme quantizes at run time. The
    weights are decompressed here (transformers would do it on the first forward) into the
    same dense values, and a decompressed weight is not quantized again in the forward; for
    ``w8a8-int8-channel`` each linear's input is fake-quantized per token (symmetric int8:
    scale = max|x| / 127.5 over the token's features, x -> round(clamp(x / scale, -128,
    127)) * scale) before the float matmul. For the weight-only recipes both routes give the
    same model output. This route cannot load ``w4a16-group32-asym`` (ValueError): on load
    compressed-tensors 0.20.0 builds the compressed layout on meta tensors and leaves
    ``weight_zero_point`` unpacked, shaped (out, groups) where the checkpoint's packed one is
    (out / 8, groups), so transformers refuses the size mismatch.
    """
    if quantize_activations and _has_packed_zero_points(path):
        raise ValueError(
            f"{path}: transformers' compressed-tensors route cannot load packed zero points "
            "(compressed-tensors 0.20.0 leaves them unpacked on meta); use the default route"
        )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="You passed `quantization_config`")
        if quantize_activations:
            model: Any = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
            model.hf_quantizer.compressor.decompress_model(model)
        else:
            model = AutoModelForCausalLM.from_pretrained(
                path,
                dtype=torch.float32,
                quantization_config=CompressedTensorsConfig(dequantize=True),
            )
    return model.eval()


def _quantization_config(path: Path) -> QuantizationConfig:
    """The ``quantization_config`` of the checkpoint in ``path``, parsed by compressed-tensors."""
    raw = json.loads((path / "config.json").read_text())["quantization_config"]
    return QuantizationConfig.model_validate(raw)


def _has_packed_zero_points(path: Path) -> bool:
    """Whether the checkpoint in ``path`` packs zero points (asymmetric pack-quantized,
    group or channel strategy)."""
    config = _quantization_config(path)
    for scheme in config.config_groups.values():
        assert isinstance(scheme, QuantizationScheme)
        weights = scheme.weights
        if (
            weights is not None
            and not weights.symmetric
            and (scheme.format or config.format) == "pack-quantized"
            and weights.strategy in ("group", "channel")
        ):
            return True
    return False


def _checkpoint_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint in ``path`` (one file or shards)."""
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def _scheme_of(config: QuantizationConfig, module_name: str) -> QuantizationScheme:
    """The config group that quantizes ``module_name`` (matched by name, as
    compressed-tensors does when no model is at hand)."""
    for scheme in config.config_groups.values():
        assert isinstance(scheme, QuantizationScheme)
        targeted = "Linear" in scheme.targets or any(
            match_name(module_name, target) for target in scheme.targets
        )
        if targeted and not any(match_name(module_name, ign) for ign in config.ignore or ()):
            return scheme
    raise ValueError(f"{module_name} has a weight_scale but no config group quantizes it")


def dequantized_state(path: Path) -> dict[str, torch.Tensor]:
    """The dense float32 weight of every quantized linear of the checkpoint in ``path``,
    named ``<module>.weight``, as compressed-tensors' own decompression computes it.

    Every module with a ``weight_scale`` in the checkpoint is decompressed by the compressor
    of its scheme's format (``BaseCompressor.get_value_from_registry(format).decompress`` on
    the tensors ``compression_param_names`` lists), which is what transformers' loader calls
    too. (compressed-tensors' model-free ``CompressedTensorsDequantizer`` is not used: for
    the formats that store ``weight`` it also picks up embeddings and non-``*norm`` norms,
    which have no scale, and fails on them.)
    """
    config = _quantization_config(path)
    tensors = _checkpoint_tensors(path)
    modules = sorted(
        {name[: -len(".weight_scale")] for name in tensors if name.endswith(".weight_scale")}
    )
    dense: dict[str, torch.Tensor] = {}
    for module_name in modules:
        scheme = _scheme_of(config, module_name)
        compressor: Any = BaseCompressor.get_value_from_registry(scheme.format or config.format)
        local = {
            param: tensors[f"{module_name}.{param}"]
            for param in compressor.compression_param_names(scheme)
        }
        dense[f"{module_name}.weight"] = compressor.decompress(local, scheme)["weight"].float()
    return dense
