"""FP8 checkpoints served with their layers in FP8 (``torch._scaled_mm``, forced onto the
CPU with ``TGIS_QUANT_KERNEL=torch``), against transformers running the same arithmetic.

The oracle is transformers' model holding the weights the checkpoint stands for, each
decoder linear layer's input rounded to e4m3 per token first (a forward pre-hook:
``s = max|x[t]| / 448``, ``x[t] / s`` to e4m3, times ``s``): the dynamic W8A8 scheme. In
float32 the shard's greedy tokens equal the oracle's and its logprobs are within 1e-4; in
bfloat16 within the weight-only kernels' tolerance; on two ranks each row-parallel layer
scales the activation columns it holds, and the oracle does the same.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.quant_fixtures.packing import decoder_linears
from tests.shard.checkpoints.quantized.cases import (
    CASES,
    assert_near_the_oracle,
    dense_model,
    generate,
    kernels,
    make_runner,
)
from tests.shard.families import PROMPTS, assert_matches_hf
from tests.shard.models import TinyModel
from tests.shard.tp_utils import Request, make_plans, run_plans
from tgis.shard.config import EngineSettings
from tgis.shard.native.graphs.compiled import CompiledForward
from tgis.shard.native.linear.fp8_linear import Fp8ScaledWeight

SCALED = Fp8ScaledWeight.kernel


ROW_PARALLEL = ("o_proj", "down_proj")  # Llama's layers split by input columns


def round_activations_to_fp8(model: Any, ranks: int = 1) -> Any:
    """``model`` with each decoder linear's input rounded to e4m3 per token; with
    ``ranks`` > 1 a row-parallel layer's input is scaled per rank's slice of its columns,
    as each rank quantizes only the columns it holds."""

    def rounded(x: torch.Tensor) -> torch.Tensor:
        s = (x.abs().amax(dim=-1, keepdim=True) / 448).clamp_min(1e-12)
        return (x / s).to(torch.float8_e4m3fn).to(x.dtype) * s

    def whole(_module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor]:
        return (rounded(args[0]),)

    def sliced(_module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor]:
        return (torch.cat([rounded(part) for part in args[0].chunk(ranks, dim=-1)], dim=-1),)

    for name, linear in decoder_linears(model).items():
        linear.register_forward_pre_hook(sliced if name.endswith(ROW_PARALLEL) else whole)
    return model


def fp8_model(case: str, root: Path, **overrides: Any) -> TinyModel:
    family, write = CASES[case]
    reference = write(dense_model(family, root / "dense", **overrides), root / "quantized")
    reference.generation_config.eos_token_id = None
    return TinyModel(root / "quantized", round_activations_to_fp8(reference))


SCALED_MM = EngineSettings(quant_kernel="torch")
"""``TGIS_QUANT_KERNEL=torch``: FP8 layers run ``torch._scaled_mm`` on the CPU too."""


@pytest.mark.parametrize("case", ["ct-fp8-channel-llama", "ct-fp8-tensor-gpt-bigcode-mha"])
def test_float32_greedy_equals_transformers_with_fp8_activations(case: str, tmp_path: Path) -> None:
    model = fp8_model(case, tmp_path)
    runner = make_runner(model.path, dtype="float32", engine=SCALED_MM)
    assert set(kernels(runner)) == {SCALED}, kernels(runner)
    assert_matches_hf(generate(runner, PROMPTS), model, PROMPTS)


def test_fp8_at_load_runs_scaled_mm_like_a_checkpoint(tmp_path: Path) -> None:
    """``--quantize fp8`` on a dense checkpoint: every layer in FP8 per output channel."""
    family, _ = CASES["ct-fp8-channel-llama"]
    reference = copy.deepcopy(dense_model(family, tmp_path / "dense")).eval()
    for name, linear in decoder_linears(reference).items():
        w = linear.weight.detach()
        s = w.abs().amax(dim=1, keepdim=True) / 448
        with torch.no_grad():
            reference.get_submodule(name).weight.copy_((w / s).to(torch.float8_e4m3fn).float() * s)
    reference.generation_config.eos_token_id = None
    model = TinyModel(tmp_path / "dense", round_activations_to_fp8(reference))
    runner = make_runner(model.path, dtype="float32", quantize="fp8", engine=SCALED_MM)
    assert set(kernels(runner)) == {SCALED}, kernels(runner)
    assert_matches_hf(generate(runner, PROMPTS), model, PROMPTS)


def test_bfloat16_scaled_mm_within_tolerance(tmp_path: Path) -> None:
    model = fp8_model("ct-fp8-channel-llama", tmp_path)
    runner = make_runner(model.path, dtype="bfloat16", engine=SCALED_MM)
    assert set(kernels(runner)) == {SCALED}, kernels(runner)
    assert_near_the_oracle(generate(runner, PROMPTS), model)


@pytest.mark.slow
def test_the_compiled_step_holds_the_fp8_operator(tmp_path: Path) -> None:
    """``TGIS_COMPILE=1``: the FP8 product is one operator (``tgis::fp8_scaled_linear``)
    inside the compiled step, which compiles (``_scaled_mm`` itself cannot be traced over
    the step's symbolic token count) and gives the oracle's tokens. One decoder layer: the
    operator is traced the same in each, and a second doubled the compilation."""
    model = fp8_model("ct-fp8-channel-llama", tmp_path, num_hidden_layers=1)
    engine = EngineSettings(quant_kernel="torch", compile="1")
    runner = make_runner(model.path, dtype="float32", engine=engine)
    assert isinstance(runner.forward, CompiledForward)
    assert set(kernels(runner)) == {SCALED}, kernels(runner)
    assert_matches_hf(generate(runner, PROMPTS), model, PROMPTS)


@pytest.mark.slow
def test_two_ranks_scale_their_own_columns(tmp_path: Path) -> None:
    """Column- and row-parallel slices of FP8 layers (q/k/v and gate/up fused) on two ranks
    (each with ``TGIS_QUANT_KERNEL=torch``). A row-parallel layer's activations are
    scaled per rank, over the columns that rank holds (as in vLLM), so the oracle scales
    o_proj's and down_proj's inputs per half; the tokens are its greedy ones."""
    family, write = CASES["ct-fp8-channel-llama"]
    reference = write(dense_model(family, tmp_path / "dense"), tmp_path / "quantized")
    reference.generation_config.eos_token_id = None
    oracle = TinyModel(tmp_path / "quantized", round_activations_to_fp8(reference, ranks=2))
    prompt = tuple(PROMPTS[3])
    requests = [Request(1, prompt, 6, chunk=8), Request(2, prompt[:9], 5, arrives=1)]
    plans = make_plans(requests)
    outputs = run_plans(tmp_path / "quantized", plans, 2, dtype="float32", engine=SCALED_MM)[
        0
    ].outputs
    for request in requests:
        tokens = [
            t.token.token_id
            for output in outputs
            if not isinstance(output, str)
            for t in output.tokens
            if t.request_id == request.request_id
        ]
        expected = oracle.greedy(request.prompt, request.max_new_tokens)[0]
        assert tokens == expected, request.request_id
