"""Quantized checkpoints served by the shard, against transformers on the dequantized model.

Each case writes a tiny random model of a native family in a quantized format:

- GPTQ and AWQ with the project's writers (``tests/quant_fixtures/packing.py``, checked bit
  for bit against auto-gptq 0.7.1 and AutoAWQ 0.2.9 by ``tests/test_quant_fixtures_gptq_awq.py``);
- compressed-tensors with the real library (``tests/quant_fixtures/compressed_tensors.py``);
- native FP8 (``quant_method: fp8``, block scales) written by ``cases.py``;

and the oracle is transformers' ``generate`` on the same architecture holding the weights
the checkpoint stands for. In float32 the shard dequantizes at load, so greedy tokens are
equal and logprobs within 1e-4; in bfloat16 it runs PyTorch's int4/int8 weight-only kernels
(checked by the start-up summary), within ``cases.py``'s ``BF16_LOGPROB_GAP``. Tensor
parallelism (gloo, 2 ranks) must give world 1's outputs for GPTQ with activation order and
for AWQ.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.lora_oracle import lora_greedy, save_random_lora
from tests.prefix_oracle import prefixed_greedy
from tests.shard.checkpoints.quantized.cases import (
    CASES,
    NEW_TOKENS,
    assert_near_the_oracle,
    dense_model,
    generate,
    kernels,
    make_runner,
)
from tests.shard.driving import Router
from tests.shard.families import LOGPROBS, PROMPTS, assert_matches_hf
from tests.shard.models import TinyModel, build_tiny_llama
from tests.shard.tp_utils import Request, assert_tensor_parallel_matches, make_plans
from tgis.shard.config import EngineSettings
from tgis.shard.errors import StartupError
from tgis.shard.native.graphs.compiled import CompiledForward
from tgis.shard.native.linear import cpu_quant

needs_tgis_kernel = pytest.mark.skipif(
    cpu_quant.KERNEL is None, reason="the cpu_quant extension is not built or no AVX-512"
)


@pytest.fixture(scope="module", params=sorted(CASES))
def quantized(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """One quantized checkpoint per case, with its transformers oracle."""
    family, write = CASES[request.param]
    root = tmp_path_factory.mktemp(request.param)
    reference = write(dense_model(family, root / "dense"), root / "quantized")
    reference.generation_config.eos_token_id = None  # the oracle never stops early
    return TinyModel(root / "quantized", reference)


def test_float32_greedy_equals_transformers_on_the_dequantized_model(
    quantized: TinyModel,
) -> None:
    runner = make_runner(quantized.path, dtype="float32")
    used = kernels(runner)
    assert all(k.startswith("dequantized (float32") or k == "dense" for k in used), used
    assert_matches_hf(generate(runner, PROMPTS), quantized, PROMPTS)


def test_chunked_prefill_beside_a_decode_on_a_quantized_model(quantized: TinyModel) -> None:
    router = Router(make_runner(quantized.path, dtype="float32"), seed=1)
    router.add(2, PROMPTS[2])
    router.step({2: len(PROMPTS[2])})
    router.add(3, PROMPTS[3])
    for chunk in (10, 10, 9):
        router.step({2: 1, 3: chunk})
    for _ in range(NEW_TOKENS - 1):
        router.decode([2, 3])
    assert router.generated[3] == quantized.greedy(PROMPTS[3], NEW_TOKENS)[0]
    assert router.generated[2] == quantized.greedy(PROMPTS[2], NEW_TOKENS + 3)[0]


def test_bfloat16_runs_the_weight_only_kernels_within_tolerance(quantized: TinyModel) -> None:
    runner = make_runner(quantized.path, dtype="bfloat16")
    used = kernels(runner)
    name = quantized.path.parent.name
    if "fp8" in name:  # FP8 is dequantized at load on the CPU (block scales: read dense)
        assert all(k == "dense" or k.startswith("dequantized (no fast FP8") for k in used), used
    else:
        assert any(k.startswith(("int4", "int8")) for k in used), used
    assert_near_the_oracle(generate(runner, PROMPTS), quantized)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["gptq-4bit-g32-actorder-llama", "awq-g32-llama"])
def test_two_ranks_equal_one(case: str, tmp_path: Path) -> None:
    """Column- and row-parallel slices of each layout (GPTQ's activation order on the
    row-parallel o_proj and down_proj included) give world 1's tokens and logprobs."""
    family, write = CASES[case]
    write(dense_model(family, tmp_path / "dense"), tmp_path / "quantized")
    prompt = tuple(PROMPTS[3])
    plans = make_plans([Request(1, prompt, 6, chunk=8), Request(2, prompt[:9], 5, arrives=1)])
    assert_tensor_parallel_matches(tmp_path / "quantized", plans, 2, dtype="float32")


def test_dummy_weights_of_a_quantized_config_use_the_kernels(tmp_path: Path) -> None:
    """``--load-format dummy`` with a GPTQ quantization_config: random 4-bit layers of the
    config's group size, multiplied by the int4 kernel in bfloat16."""
    build_tiny_llama(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 32}
    (tmp_path / "config.json").write_text(json.dumps(config))
    runner = make_runner(tmp_path, load_format="dummy", dtype="bfloat16")
    used = kernels(runner)
    assert len(used) == 1 and next(iter(used)).startswith("int4 ("), used
    router = generate(runner, {1: PROMPTS[1]})
    assert len(router.generated[1]) == NEW_TOKENS
    assert math.isfinite(router.outputs[0].tokens[0].token.logprob)


@pytest.mark.parametrize(
    "kernel", ["dequant", "torch", pytest.param("tgis", marks=needs_tgis_kernel)]
)
def test_lora_adapters_on_a_quantized_base_match_peft(kernel: str, tmp_path: Path) -> None:
    """A LoRA adapter's delta is added to the quantized layer's output: PEFT on the
    dequantized model is the oracle, with the base dequantized and with each int4 kernel
    itself (``TGIS_QUANT_KERNEL=torch`` or ``tgis`` runs it on float32 activations, exact
    to float32 rounding), the adapter and a plain request in one batch."""
    family, write = CASES["gptq-4bit-g32-actorder-llama"]
    reference = write(dense_model(family, tmp_path / "dense"), tmp_path / "quantized")
    reference.save_pretrained(tmp_path / "reference")
    save_random_lora(tmp_path / "reference", tmp_path / "adapters" / "all", seed=1)
    runner = make_runner(
        tmp_path / "quantized",
        dtype="float32",
        adapter_cache=str(tmp_path / "adapters"),
        engine=EngineSettings(quant_kernel=kernel),
    )
    expected = "dequantized" if kernel == "dequant" else "int4"
    assert any(k.startswith(expected) for k in kernels(runner)), kernels(runner)
    runner.lookup_adapter("all")
    router = Router(runner)
    router.add(1, PROMPTS[2], details=LOGPROBS, adapter_id="all")
    router.add(2, PROMPTS[3], details=LOGPROBS)
    router.step({1: len(PROMPTS[2]), 2: len(PROMPTS[3])})
    for _ in range(5):
        router.decode([1, 2])
    cases = {1: (tmp_path / "adapters" / "all", PROMPTS[2]), 2: (None, PROMPTS[3])}
    for rid, (adapter, prompt) in cases.items():
        tokens, logits = lora_greedy(tmp_path / "reference", adapter, prompt, 6)
        assert router.generated[rid] == tokens, rid
        details = [t.token for o in router.outputs for t in o.tokens if t.request_id == rid]
        for detail, step_logits in zip(details, logits, strict=True):
            expected = torch.log_softmax(step_logits, dim=-1)[detail.token_id].item()
            assert abs(detail.logprob - expected) < 1e-3, rid


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_prefixes_and_preemption_on_a_quantized_model(dtype: str, tmp_path: Path) -> None:
    """A prompt-tuning prefix (its embeddings in place of the first positions) and a
    sequence preempted and recomputed, on a 4-bit AWQ model: in float32 the prefix equals
    transformers' ``inputs_embeds`` oracle; in both dtypes the preempted sequence equals the
    same request run without preemption, on the same kernels."""
    family, write = CASES["awq-g32-llama"]
    reference = write(dense_model(family, tmp_path / "dense"), tmp_path / "quantized")
    reference.generation_config.eos_token_id = None
    prefix = torch.randn(4, 64, generator=torch.Generator().manual_seed(5)) * 0.5
    (tmp_path / "store" / "p").mkdir(parents=True)
    torch.save(prefix, tmp_path / "store" / "p" / "decoder.pt")
    runner = make_runner(
        tmp_path / "quantized", dtype=dtype, prefix_store_path=str(tmp_path / "store")
    )
    prompt = PROMPTS[2]
    router = Router(runner)
    router.add(1, prompt, prefix_id="p", prefix_length=runner.lookup_prefix("p").length)
    router.add(2, prompt)
    router.add(3, prompt)
    router.step({1: 4 + len(prompt), 2: len(prompt), 3: len(prompt)})
    router.decode([1, 2, 3])
    router.preempt(3)
    router.step({1: 1, 2: 1, 3: len(prompt) + 2})  # 3 recomputes its prompt and 2 tokens
    for _ in range(NEW_TOKENS - 3):
        router.decode([1, 2, 3])
    assert router.generated[3] == router.generated[2] and len(router.generated[3]) == NEW_TOKENS
    if dtype == "float32":
        expected = prefixed_greedy(reference, prefix, prompt, NEW_TOKENS)[0]
        assert router.generated[1] == expected


@pytest.mark.slow
@needs_tgis_kernel
def test_the_compiled_step_holds_tgis_kernel(tmp_path: Path) -> None:
    """``TGIS_COMPILE=1``: the kernel is one operator (``tgis::cpu_quant_linear``) inside
    the compiled step, which compiles (no fallback to eager) and, on float32 activations
    (the kernel forced: exact to float32 rounding), gives transformers' tokens. One decoder
    layer: the operator is traced the same in each, and a second doubled the compilation."""
    family, write = CASES["awq-g32-llama"]
    dense = dense_model(family, tmp_path / "dense", num_hidden_layers=1)
    reference = write(dense, tmp_path / "quantized")
    reference.generation_config.eos_token_id = None
    engine = EngineSettings(compile="1", quant_kernel="tgis")
    runner = make_runner(tmp_path / "quantized", dtype="float32", engine=engine)
    assert isinstance(runner.forward, CompiledForward)
    assert set(kernels(runner)) == {"int4 (tgis cpu_quant)"}
    model = TinyModel(tmp_path / "quantized", reference)
    assert_matches_hf(generate(runner, PROMPTS), model, PROMPTS)


def _edit(name: str, tensors: dict[str, torch.Tensor]) -> None:
    layer = "model.layers.0.self_attn.q_proj"
    if name == "missing qzeros":
        del tensors[f"{layer}.qzeros"]
    elif name == "scales of the wrong shape":
        tensors[f"{layer}.scales"] = tensors[f"{layer}.scales"][:1]
    elif name == "integer scales":
        tensors[f"{layer}.scales"] = tensors[f"{layer}.scales"].to(torch.int32)
    elif name == "g_idx out of range":
        tensors[f"{layer}.g_idx"] = tensors[f"{layer}.g_idx"] + 5
    elif name == "qweight of floats":
        tensors[f"{layer}.qweight"] = tensors[f"{layer}.qweight"].float()


@pytest.mark.parametrize(
    "damage,message",
    [
        (
            "missing qzeros",
            "weight 'model.layers.0.self_attn.q_proj.qzeros' not found in the safetensors files",
        ),
        (
            "scales of the wrong shape",
            r"model.layers.0.self_attn.q_proj.scales has shape \[1, 64\]; expected \[2, 64\] "
            r"\(64 inputs, 64 outputs, group size 32, 4 bits\)",
        ),
        (
            "integer scales",
            "model.layers.0.self_attn.q_proj.scales is int32; expected float16 or bfloat16 or "
            "float32",
        ),
        (
            "g_idx out of range",
            r"model.layers.0.self_attn.q_proj.g_idx has group indices outside \[0, 2\)",
        ),
        ("qweight of floats", "model.layers.0.self_attn.q_proj.qweight is float32; expected int32"),
    ],
)
def test_a_damaged_checkpoint_fails_naming_the_tensor(
    damage: str, message: str, tmp_path: Path
) -> None:
    """A GPTQ checkpoint with one tensor missing, misshaped, of the wrong dtype or out of
    range fails at load in one line naming it and what was expected."""
    family, write = CASES["gptq-4bit-g32-actorder-llama"]
    write(dense_model(family, tmp_path / "dense"), tmp_path / "quantized")
    path = tmp_path / "quantized" / "model.safetensors"
    tensors = load_file(path)
    _edit(damage, tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})
    with pytest.raises(StartupError, match=f"^{message}$") as failure:
        make_runner(tmp_path / "quantized", dtype="float32")
    assert "\n" not in str(failure.value)
