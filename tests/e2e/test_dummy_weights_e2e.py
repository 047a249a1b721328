"""`text-generation-launcher --load-format dummy` on a directory holding only config.json and
a synthetic tokenizer (benchmarks/make_synthetic_tokenizer.py): it serves a Generate."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from tgis.launcher.local_process import LauncherProcess, start_launcher
from tgis.pb import generation_pb2 as pb
from tgis.pb import generation_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "make_synthetic_tokenizer.py"
CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "vocab_size": 1024,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "bfloat16",
}
NEW_TOKENS = 8
ISOLATED_ENV = ("MODEL_NAME", "NUM_GPUS", "CUDA_VISIBLE_DEVICES", "NUM_SHARD", "LOAD_FORMAT")


def write_synthetic_tokenizer(model_dir: Path) -> None:
    spec = importlib.util.spec_from_file_location("make_synthetic_tokenizer", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main([str(model_dir)]) == 0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LauncherProcess]:
    model_dir = tmp_path_factory.mktemp("dummy-llama")
    (model_dir / "config.json").write_text(json.dumps(CONFIG))
    write_synthetic_tokenizer(model_dir)
    assert sorted(p.name for p in model_dir.iterdir()) == [
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    launcher = start_launcher(
        tmp_path_factory.mktemp("logs"),
        ["--model-name", str(model_dir), "--load-format", "dummy"],
        unset_env=ISOLATED_ENV,
    )
    try:
        launcher.wait_healthy()
        yield launcher
    finally:
        launcher.stop()


def test_generate_with_dummy_weights(server: LauncherProcess) -> None:
    stopping = pb.StoppingCriteria(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
    request = pb.BatchedGenerationRequest(
        requests=[pb.GenerationRequest(text="hello world"), pb.GenerationRequest(text="abc")],
        params=pb.Parameters(
            method=pb.GREEDY,
            stopping=stopping,
            response=pb.ResponseOptions(generated_tokens=True),
        ),
    )
    with grpc.insecure_channel(server.grpc_target) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        response = stub.Generate(request, timeout=60)
        info = stub.ModelInfo(pb.ModelInfoRequest(), timeout=10)
    assert info.max_sequence_length == 256
    for got in response.responses:
        assert got.generated_token_count == NEW_TOKENS
        assert got.stop_reason == pb.MAX_TOKENS
        assert got.input_token_count > 1  # BOS + the words
        assert len(got.tokens) == NEW_TOKENS
        assert got.text  # random tokens of the synthetic vocabulary, detokenized
    log = server.log_tail(20000)
    assert "Dummy weights (--load-format dummy)" in log
    assert "with dummy weights" in log
