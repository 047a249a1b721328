"""Adapters (`adapter_id`) through the real launcher, router and shard.

The oracle is PEFT: `PeftModel.generate` greedy on the same random model with the same
adapter directory, compared token by token (the raw vocabulary strings of
`generated_tokens` details). The adapter cache holds two LoRA adapters (one nested) and a
prompt-tuning adapter; errors are vllm-tgis-adapter's messages, verbatim. `--max-loras 1`
makes requests for the two LoRA adapters take turns while the plain one runs beside them.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest
import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer

from tests.e2e.models import save_tiny_llama
from tests.e2e.server import LauncherProcess, healthy_launcher
from tests.lora_oracle import lora_greedy, save_random_lora
from tests.prefix_oracle import prefixed_greedy
from tgis.pb import generation_pb2 as pb
from tgis.pb import generation_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow

HIDDEN = 64
NEW_TOKENS = 8
PROMPT = "Return the number of"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    path = tmp_path_factory.mktemp("lora-llama")
    return path, save_tiny_llama(path)


@pytest.fixture(scope="module")
def cache(model: tuple[Path, Any], tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("adapter-cache")
    save_random_lora(model[0], root / "sql-lora", seed=1, r=8, alpha=16)
    save_random_lora(model[0], root / "team" / "tone", seed=2, r=4, alpha=4, rslora=True)
    (root / "prompt").mkdir()
    (root / "prompt" / "adapter_config.json").write_text('{"peft_type": "PROMPT_TUNING"}')
    embeddings = torch.randn(4, HIDDEN, generator=torch.Generator().manual_seed(3))
    save_file({"prompt_embeddings": embeddings}, root / "prompt" / "adapter_model.safetensors")
    (root / "ia3").mkdir()
    (root / "ia3" / "adapter_config.json").write_text('{"peft_type": "IA3"}')
    (root / "empty").mkdir()
    return root


@pytest.fixture(scope="module")
def server(
    model: tuple[Path, Any], cache: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LauncherProcess]:
    with healthy_launcher(
        tmp_path_factory.mktemp("adapters-e2e"),
        ["--model-name", str(model[0]), "--max-sequence-length", "64", "--max-loras", "1"],
        env={"ADAPTER_CACHE": str(cache)},
    ) as launcher:
        yield launcher


def params(new_tokens: int = NEW_TOKENS) -> pb.Parameters:
    return pb.Parameters(
        method=pb.GREEDY,
        stopping=pb.StoppingCriteria(max_new_tokens=new_tokens, min_new_tokens=new_tokens),
        response=pb.ResponseOptions(generated_tokens=True),
    )


def expected(model: tuple[Path, Any], cache: Path, adapter_id: str) -> list[str]:
    """PEFT's greedy continuation of PROMPT with the adapter, as raw vocabulary strings."""
    tokenizer = Tokenizer.from_file(str(model[0] / "tokenizer.json"))
    ids = tokenizer.encode(PROMPT).ids
    if adapter_id == "prompt":
        from safetensors.torch import load_file

        embeddings = load_file(cache / "prompt" / "adapter_model.safetensors")
        tokens, _ = prefixed_greedy(model[1], embeddings["prompt_embeddings"], ids, NEW_TOKENS)
    else:
        tokens, _ = lora_greedy(
            model[0], cache / adapter_id if adapter_id else None, ids, NEW_TOKENS
        )
    return [tokenizer.id_to_token(i) for i in tokens]


def stream_tokens(stub: pb_grpc.GenerationServiceStub, adapter_id: str | None) -> list[str]:
    request = pb.SingleGenerationRequest(request=pb.GenerationRequest(text=PROMPT), params=params())
    if adapter_id is not None:
        request.adapter_id = adapter_id
    return [t.text for m in stub.GenerateStream(request, timeout=120) for t in m.tokens]


def test_adapters_and_plain_requests_at_once_match_peft(
    stub: pb_grpc.GenerationServiceStub, model: tuple[Path, Any], cache: Path
) -> None:
    """Two LoRA adapters (one step holds only one of them), a prompt-tuning adapter and a
    plain request, all in flight together: each equals its oracle alone."""
    ids = ["sql-lora", "team/tone", "prompt", None]
    with ThreadPoolExecutor(len(ids)) as pool:
        results = list(pool.map(lambda a: stream_tokens(stub, a), ids))
    for adapter_id, got in zip(ids, results, strict=True):
        assert got == expected(model, cache, adapter_id or ""), adapter_id
    assert results[0] != results[3] and results[1] != results[3]


def test_batch_generate_with_a_lora_adapter(
    stub: pb_grpc.GenerationServiceStub, model: tuple[Path, Any], cache: Path
) -> None:
    request = pb.BatchedGenerationRequest(
        adapter_id="sql-lora", requests=[pb.GenerationRequest(text=PROMPT)] * 2, params=params()
    )
    response = stub.Generate(request, timeout=120)
    for got in response.responses:
        assert [t.text for t in got.tokens] == expected(model, cache, "sql-lora")


def test_tokenize_accepts_an_adapter(stub: pb_grpc.GenerationServiceStub) -> None:
    request = pb.BatchedTokenizeRequest(
        adapter_id="sql-lora", requests=[pb.TokenizeRequest(text=PROMPT)]
    )
    plain = pb.BatchedTokenizeRequest(requests=[pb.TokenizeRequest(text=PROMPT)])
    assert (
        stub.Tokenize(request).responses[0].token_count
        == stub.Tokenize(plain).responses[0].token_count
    )


@pytest.mark.parametrize(
    ("adapter_id", "message"),
    [
        ("missing", "can't retrieve adapter with id 'missing': directory does not exist"),
        (
            "empty",
            "can't retrieve adapter with id 'empty': invalid adapter: no adapter_config.json found",
        ),
        ("ia3", "adapter type IA3 is not currently supported"),
        ("../etc", "Invalid adapter id '../etc', must contain only alphanumeric, _ and - and /"),
        ("a b", "Invalid adapter id 'a b', must contain only alphanumeric, _ and - and /"),
    ],
)
def test_adapter_errors_are_the_peers_messages(
    stub: pb_grpc.GenerationServiceStub, adapter_id: str, message: str
) -> None:
    request = pb.BatchedGenerationRequest(
        adapter_id=adapter_id, requests=[pb.GenerationRequest(text="Hi")], params=params(2)
    )
    with pytest.raises(grpc.RpcError) as caught:
        stub.Generate(request, timeout=60)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details() == message


def test_a_symlink_out_of_the_cache_is_refused(
    stub: pb_grpc.GenerationServiceStub, cache: Path, tmp_path: Path
) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "adapter_config.json").write_text('{"peft_type": "LORA"}')
    (cache / "escape").symlink_to(outside, target_is_directory=True)
    request = pb.BatchedGenerationRequest(
        adapter_id="escape", requests=[pb.GenerationRequest(text="Hi")], params=params(2)
    )
    with pytest.raises(grpc.RpcError) as caught:
        stub.Generate(request, timeout=60)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details() == (
        "Invalid adapter id 'escape', must contain only alphanumeric, _ and - and /"
    )


@pytest.mark.parametrize("adapter_id", ["sql-lora", "prompt"])
def test_guided_decoding_with_an_adapter(
    stub: pb_grpc.GenerationServiceStub, adapter_id: str
) -> None:
    """A LoRA or prompt-tuning adapter's output still keeps to the regex."""
    regex = "[a-z]{2,4}-[0-9]{2}"
    request = pb.BatchedGenerationRequest(
        adapter_id=adapter_id,
        requests=[pb.GenerationRequest(text=PROMPT)] * 2,
        params=pb.Parameters(
            decoding=pb.DecodingParameters(regex=regex),
            stopping=pb.StoppingCriteria(max_new_tokens=20),
        ),
    )
    for response in stub.Generate(request, timeout=120).responses:
        assert response.stop_reason == pb.EOS_TOKEN
        assert re.fullmatch(regex, response.text), response.text


def test_openai_model_names_an_adapter(
    server: LauncherProcess, model: tuple[Path, Any], cache: Path
) -> None:
    """vLLM's convention: ``model`` names a LoRA or prompt-tuning adapter of the store; the
    answer is PEFT's (the oracle, as for adapter_id), the reply names the adapter, and
    /v1/models lists it with the served model as its parent; an unknown name is 404."""
    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{server.http_port}/v1", api_key="-", max_retries=0
    )
    tokenizer = Tokenizer.from_file(str(model[0] / "tokenizer.json"))
    served = client.models.list().data[0].id
    for adapter_id in ("sql-lora", "prompt"):
        reply = client.completions.create(
            model=adapter_id, prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        want = expected(model, cache, adapter_id)
        assert reply.model == adapter_id
        assert reply.choices[0].text == tokenizer.decode([tokenizer.token_to_id(t) for t in want])
    cards = {card.id: card for card in client.models.list().data}
    assert {"sql-lora", "prompt"} <= set(cards)
    assert getattr(cards["sql-lora"], "parent", None) == served
    for unknown in ("nonexistent", "ia3", "../escape"):
        with pytest.raises(openai.NotFoundError) as missing:
            client.completions.create(model=unknown, prompt=PROMPT, max_tokens=2)
        assert f"The model `{unknown}` does not exist." in str(missing.value)
