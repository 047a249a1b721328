"""Quantized models through the real launcher, router and shard, against transformers.

One server per format, each serving a tiny random Llama with the embedded tokenizer:

- GPTQ (v1, 4-bit, groups of 32, activation order) and AWQ (GEMM, groups of 32), written by
  ``tests/quant_fixtures/packing.py`` (bit for bit what auto-gptq and AutoAWQ write);
- compressed-tensors W4A16 and FP8 per channel, written by compressed-tensors itself;
- a dense checkpoint quantized at load, ``--quantize int8`` and ``--quantize fp8``;

served with no ``--quantize`` flag for a quantized checkpoint (the format comes from
config.json). The oracle is transformers' greedy ``generate`` on the same Llama holding
the weights the checkpoint stands for (for quantization at load: the dense weights
quantized per output channel here, by the formula of the launcher's documentation). In
float32 the server dequantizes at load, so tokens and text are equal; the start-up log
names the format and the kernel of the linear layers.
"""

from __future__ import annotations

import copy
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from tokenizers import Tokenizer

from tests.e2e.models import PAD_TOKEN_ID, TOKENIZER_FILES, greedy_new_tokens, save_tiny_llama
from tests.e2e.server import LauncherProcess, healthy_launcher
from tests.quant_fixtures.compressed_tensors import load_reference, save_compressed
from tests.quant_fixtures.packing import decoder_linears, save_awq_checkpoint, save_gptq_checkpoint
from tgis.embedded_model import MODEL_DIR as EMBEDDED_MODEL_DIR
from tgis.pb import generation_pb2 as pb
from tgis.pb import generation_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow

NEW_TOKENS = 12
PROMPTS = ("Hi there", "Return the number of items in the list", "A")


def at_load(method: str) -> Callable[[Any, Path], Any]:
    """The dense checkpoint as it is; the oracle holds its weights quantized per output
    channel: int8 ``round(W / s) * s`` with ``s = max|W[o]| / 127``, fp8 ``W / s`` rounded to
    e4m3 times ``s = max|W[o]| / 448``."""

    def write(model: Any, path: Path) -> Any:
        model.save_pretrained(path)
        reference = copy.deepcopy(model).eval()
        for name, linear in decoder_linears(reference).items():
            w = linear.weight.detach()
            if method == "int8":
                s = w.abs().amax(dim=1, keepdim=True) / 127
                q = torch.round(w / s) * s
            else:
                s = w.abs().amax(dim=1, keepdim=True) / 448
                q = (w / s).to(torch.float8_e4m3fn).float() * s
            with torch.no_grad():
                reference.get_submodule(name).weight.copy_(q)
        return reference

    return write


def compressed(recipe: str) -> Callable[[Any, Path], Any]:
    def write(model: Any, path: Path) -> Any:
        save_compressed(model, path, recipe)
        return load_reference(path)

    return write


# name: (writer, launcher flags, what the start-up log says of the format and the kernel)
FORMATS: dict[str, tuple[Callable[[Any, Path], Any], list[str], str]] = {
    "gptq": (
        lambda m, p: save_gptq_checkpoint(m, p, 4, 32, False, True),
        [],
        "Quantization: gptq, 4-bit, group 32, gptq (in config.json quantization_config)",
    ),
    "awq": (
        lambda m, p: save_awq_checkpoint(m, p, 32),
        [],
        "Quantization: awq, 4-bit, group 32 (in config.json quantization_config)",
    ),
    "compressed-tensors-w4a16": (
        compressed("w4a16-group32"),
        [],
        "Quantization: compressed-tensors, pack-quantized",
    ),
    "compressed-tensors-fp8": (
        compressed("fp8-channel"),
        [],
        "Quantization: compressed-tensors, float-quantized",
    ),
    "int8-at-load": (at_load("int8"), ["--quantize", "bitsandbytes"], "Quantization: int8"),
    "fp8-at-load": (at_load("fp8"), ["--quantize", "fp8"], "Quantization: fp8 (at load)"),
}


@pytest.fixture(scope="module", params=sorted(FORMATS))
def served(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[LauncherProcess, Any, Path, str]]:
    """A launcher serving one format, the oracle, the model directory and the log line."""
    write, flags, log_line = FORMATS[request.param]
    root = tmp_path_factory.mktemp(request.param)
    dense = save_tiny_llama(root / "dense")
    path = root / "model"
    reference = write(dense, path)
    for name in TOKENIZER_FILES:
        shutil.copy(EMBEDDED_MODEL_DIR / name, path / name)
    (root / "logs").mkdir()
    with healthy_launcher(root / "logs", ["--model-name", str(path), *flags]) as launcher:
        yield launcher, reference, path, log_line


def expected(reference: Any, path: Path, text: str) -> tuple[list[str | None], str, int]:
    """The oracle's greedy tokens (vocabulary strings), text and input token count."""
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    ids = tokenizer.encode(text).ids
    new = greedy_new_tokens(reference, ids, NEW_TOKENS, eos_token_id=2, pad_token_id=PAD_TOKEN_ID)
    text_out = tokenizer.decode(new, skip_special_tokens=True).rstrip("\ufffd")
    return [tokenizer.id_to_token(i) for i in new], text_out, len(ids)


def test_greedy_batch_and_stream_equal_transformers(
    served: tuple[LauncherProcess, Any, Path, str],
) -> None:
    launcher, reference, path, log_line = served
    params = pb.Parameters(
        method=pb.GREEDY,
        stopping=pb.StoppingCriteria(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS),
        response=pb.ResponseOptions(generated_tokens=True),
    )
    with grpc.insecure_channel(launcher.grpc_target) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        batch = stub.Generate(
            pb.BatchedGenerationRequest(
                requests=[pb.GenerationRequest(text=t) for t in PROMPTS], params=params
            ),
            timeout=120,
        ).responses
        stream = list(
            stub.GenerateStream(
                pb.SingleGenerationRequest(
                    request=pb.GenerationRequest(text=PROMPTS[1]), params=params
                ),
                timeout=120,
            )
        )
    for text, got in zip(PROMPTS, batch, strict=True):
        tokens, text_out, input_tokens = expected(reference, path, text)
        assert [t.text for t in got.tokens] == tokens, text
        assert got.text == text_out and got.input_token_count == input_tokens, text
    streamed = [t.text for message in stream for t in message.tokens]
    assert streamed == expected(reference, path, PROMPTS[1])[0]
    log = launcher.log_path.read_text(errors="replace")
    assert log_line in log, launcher.log_tail()
    # 2 layers x (q/k/v, o, gate/up, down), dequantized at load for float32 activations
    assert "linear layers: 8 dequantized (float32 activations)" in log, launcher.log_tail()
