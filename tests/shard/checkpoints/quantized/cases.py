"""The quantized checkpoints the shard tests serve (``CASES``: a family and the writer of its
format), the runner they are loaded into, and the comparisons with their transformers
oracle (the dequantized model)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from tests.quant_fixtures.compressed_tensors import load_reference, save_compressed
from tests.quant_fixtures.packing import decoder_linears, save_awq_checkpoint, save_gptq_checkpoint
from tests.shard.driving import Router, prefill_then_decode
from tests.shard.families import FAMILIES, LOGPROBS, PROMPTS
from tests.shard.models import TinyModel, build_tiny_llama
from tgis.shard.config import ShardConfig
from tgis.shard.loader import load_runner
from tgis.shard.native.models.decoder import DecoderLM
from tgis.shard.native.runtime.model_runner import ModelRunner

NEW_TOKENS = 10
MAX_SEQUENCE_LENGTH = 256
Writer = Callable[[Any, Path], Any]


def dense_model(family: str, path: Path, **overrides: Any) -> Any:
    """A tiny random float32 model of ``family`` (``llama`` or one of ``FAMILIES``),
    saved dense to ``path`` (``overrides``: config values, such as ``num_hidden_layers``)."""
    if family == "llama":
        return build_tiny_llama(path, seed=1, **overrides)
    return FAMILIES[family].build(path, seed=1, **overrides)


def write_fp8_block(model: Any, path: Path, block: int = 32) -> Any:
    """Native FP8 (``quant_method: fp8``, ``weight_block_size``): every decoder linear as
    e4m3 with one ``weight_scale_inv`` multiplier per ``block`` x ``block`` tile; returns
    the model with the weights those stand for."""
    reference = _copy(model)
    tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
    for name, linear in decoder_linears(model).items():
        w = linear.weight.detach().float()
        out, in_ = w.shape
        rows, cols = -(-out // block), -(-in_ // block)  # a partial last tile has a scale too
        padded = torch.zeros(rows * block, cols * block)
        padded[:out, :in_] = w
        tiles = padded.reshape(rows, block, cols, block)
        scale = tiles.abs().amax(dim=(1, 3)) / 448.0
        q = (tiles / scale[:, None, :, None]).to(torch.float8_e4m3fn)
        dense = (q.float() * scale[:, None, :, None]).reshape(rows * block, -1)[:out, :in_]
        tensors[f"{name}.weight"] = q.reshape(rows * block, -1)[:out, :in_].contiguous()
        tensors[f"{name}.weight_scale_inv"] = scale
        with torch.no_grad():
            reference.get_submodule(name).weight.copy_(dense)
    _save(model, path, tensors, {"quant_method": "fp8", "weight_block_size": [block, block]})
    return reference


def _copy(model: Any) -> Any:
    import copy

    return copy.deepcopy(model).eval()


def _save(model: Any, path: Path, tensors: dict[str, torch.Tensor], quant: dict[str, Any]) -> None:
    path.mkdir(parents=True, exist_ok=True)
    if getattr(model.config, "tie_word_embeddings", False):
        tensors.pop("lm_head.weight", None)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict() | {
        "architectures": [type(model).__name__],
        "quantization_config": quant,
    }
    (path / "config.json").write_text(json.dumps(config))


def write_ct_g_idx(model: Any, path: Path, group: int = 32) -> Any:
    """compressed-tensors ``pack-quantized`` W4A16 with ``weight_g_idx`` (older
    LLM Compressor's group activation order; 0.20 no longer writes it): each column's group
    from a random permutation, integers packed by compressed-tensors' own
    ``pack_to_int32``; the oracle holds ``scale[:, g_idx] * q``."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    reference = _copy(model)
    tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
    gen = torch.Generator().manual_seed(7)
    for name, linear in decoder_linears(model).items():
        w = linear.weight.detach().float()
        out, in_ = w.shape
        g_idx = (torch.randperm(in_, generator=gen) // group).to(torch.int32)
        scale = torch.stack(
            [w[:, g_idx == g].abs().amax(dim=1) / 7.5 for g in range(in_ // group)], dim=1
        )
        q = torch.round(w / scale[:, g_idx.long()]).clamp(-8, 7).to(torch.int8)
        del tensors[f"{name}.weight"]
        tensors[f"{name}.weight_packed"] = pack_to_int32(q, 4)
        tensors[f"{name}.weight_scale"] = scale
        tensors[f"{name}.weight_shape"] = torch.tensor([out, in_])
        tensors[f"{name}.weight_g_idx"] = g_idx
        with torch.no_grad():
            reference.get_submodule(name).weight.copy_(scale[:, g_idx.long()] * q.float())
    scheme = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group"}
    quant = {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": scheme | {"group_size": group, "actorder": "group"},
            }
        },
        "ignore": ["lm_head"],
    }
    _save(model, path, tensors, quant)
    return reference


def gptq(bits: int, group: int, sym: bool, act_order: bool, fmt: str = "gptq") -> Writer:
    return lambda model, path: save_gptq_checkpoint(model, path, bits, group, sym, act_order, fmt)


def awq(group: int) -> Writer:
    return lambda model, path: save_awq_checkpoint(model, path, group)


def compressed(recipe: str) -> Writer:
    """compressed-tensors' own compressor writes it; transformers decompresses it."""

    def write(model: Any, path: Path) -> Any:
        save_compressed(model, path, recipe)
        return load_reference(path)

    return write


# (family, writer); the families with fused q/k/v (GPT-NeoX, Falcon, GPT-BigCode), grouped
# and multi-query attention, biases, and each layout variant.
CASES: dict[str, tuple[str, Writer]] = {
    "gptq-4bit-g32-actorder-llama": ("llama", gptq(4, 32, False, True)),
    "gptq-4bit-g32-actorder-gpt-neox": ("gpt-neox-parallel", gptq(4, 32, False, True)),
    "gptq-4bit-g32-falcon-gqa": ("falcon-new-gqa", gptq(4, 32, True, False)),
    "gptq-8bit-channel-gpt-bigcode-mqa": ("gpt-bigcode-mqa", gptq(8, -1, False, False)),
    "gptq-v2-4bit-g32-qwen2-biases": ("qwen2-biases", gptq(4, 32, False, True, "gptq_v2")),
    "gptq-4bit-channel-granite": ("granite", gptq(4, -1, True, False)),
    "awq-g32-llama": ("llama", awq(32)),
    "awq-g64-gpt-neox": ("gpt-neox-sequential", awq(64)),
    "awq-g32-falcon-mqa": ("falcon-old-mqa", awq(32)),
    "fp8-block-llama": ("llama", write_fp8_block),
    "fp8-block-qwen2-tied": ("qwen2-tied", write_fp8_block),
    "ct-w4a16-group32-llama": ("llama", compressed("w4a16-group32")),
    "ct-w4a16-group32-asym-gpt-neox": ("gpt-neox-parallel", compressed("w4a16-group32-asym")),
    "ct-w4a16-actorder-weight-qwen2": ("qwen2-biases", compressed("w4a16-group32-actorder-weight")),
    "ct-w8a16-channel-falcon-gqa": ("falcon-new-gqa", compressed("w8a16-channel")),
    "ct-w8a8-int8-channel-llama": ("llama", compressed("w8a8-int8-channel")),
    "ct-fp8-tensor-gpt-bigcode-mha": ("gpt-bigcode-mha", compressed("fp8-tensor")),
    "ct-fp8-channel-llama": ("llama", compressed("fp8-channel")),
    "ct-fp8-block-falcon-mqa": ("falcon-old-mqa", compressed("fp8-block")),
    "ct-w4a16-g-idx-gpt-neox": ("gpt-neox-parallel", write_ct_g_idx),
    "gptq-4bit-g32-actorder-phi3": ("phi3-longrope", gptq(4, 32, False, True)),
    "awq-g32-olmo2": ("olmo2", awq(32)),
    "ct-w4a16-group32-qwen3": ("qwen3", compressed("w4a16-group32")),
}


def make_runner(path: Path, **kwargs: Any) -> ModelRunner:
    kwargs.setdefault("kv_cache_blocks", 64)
    kwargs.setdefault("max_sequence_length", MAX_SEQUENCE_LENGTH)
    return load_runner(ShardConfig(model_name=str(path), **kwargs))


def generate(runner: ModelRunner, prompts: dict[int, list[int]]) -> Router:
    """Prefill ``prompts`` in one step, then decode them together (with logprobs)."""
    return prefill_then_decode(runner, prompts, NEW_TOKENS, LOGPROBS)


def kernels(runner: ModelRunner) -> dict[str, int]:
    assert isinstance(runner.model, DecoderLM)
    return dict(runner.model.linear_kernels())


# bfloat16 against the float32 oracle: every generated token's logprob (under the oracle,
# teacher-forced on the shard's own tokens) within this of the oracle's best, i.e. the
# shard only ever picks a token the oracle ranks (near-)first.
BF16_LOGPROB_GAP = 0.25


def assert_near_the_oracle(router: Router, model: TinyModel) -> None:
    """Every token the router generated for ``PROMPTS`` is within ``BF16_LOGPROB_GAP`` of
    the oracle's best at that position (the oracle teacher-forced on those tokens)."""
    for rid, prompt in PROMPTS.items():
        tokens = router.generated[rid]
        with torch.no_grad():
            logits = model.hf(torch.tensor([prompt + tokens])).logits[0].float()
        logprobs = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
        chosen = logprobs[torch.arange(len(tokens)), torch.tensor(tokens)]
        gap = (logprobs.max(dim=-1).values - chosen).max().item()
        assert gap < BF16_LOGPROB_GAP, (rid, gap)
