"""Prompt-tuning prefixes (`prefix_id`) through the real launcher, router and shard.

The oracle is transformers: greedy `generate(inputs_embeds=concat(prefix, embed(ids)))` on
the same random model, compared token by token (the raw vocabulary strings of
`generated_tokens` details). The store holds a `decoder.pt` prefix under a nested id and a
PEFT prompt-tuning adapter; errors are TGIS's messages, verbatim.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest
import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer

from tests.e2e.models import PAD_TOKEN_ID, save_tiny_llama
from tests.e2e.server import LauncherProcess, healthy_launcher
from tests.prefix_oracle import prefixed_greedy
from tgis.pb import generation_pb2 as pb
from tgis.pb import generation_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow

HIDDEN = 64
MAX_SEQUENCE_LENGTH = 64
NEW_TOKENS = 8
PROMPTS = ["Return the number of", "A"]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """A random float32 Llama with the embedded tokenizer, and its transformers twin."""
    path = tmp_path_factory.mktemp("prefix-llama")
    return path, save_tiny_llama(path)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("prefix-store")
    generator = torch.Generator().manual_seed(4)
    (root / "sentiment" / "v1").mkdir(parents=True)
    torch.save(
        torch.randn(5, HIDDEN, generator=generator), root / "sentiment" / "v1" / "decoder.pt"
    )
    (root / "peft-tuned").mkdir()
    save_file(
        {"prompt_embeddings": torch.randn(7, HIDDEN, generator=generator)},
        root / "peft-tuned" / "adapter_model.safetensors",
    )
    (root / "bad").mkdir()
    torch.save(torch.zeros(2, HIDDEN, 1), root / "bad" / "decoder.pt")
    return root


@pytest.fixture(scope="module")
def server(
    model: tuple[Path, Any], store: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LauncherProcess]:
    with healthy_launcher(
        tmp_path_factory.mktemp("prefix-e2e"),
        ["--model-name", str(model[0]), "--max-sequence-length", str(MAX_SEQUENCE_LENGTH)],
        env={"PREFIX_STORE_PATH": str(store)},
    ) as launcher:
        yield launcher


def prefix_of(store: Path, prefix_id: str) -> torch.Tensor:
    item = store / prefix_id
    if (item / "decoder.pt").is_file():
        return torch.load(item / "decoder.pt", weights_only=True)
    from safetensors.torch import load_file

    return load_file(item / "adapter_model.safetensors")["prompt_embeddings"]


def expected_tokens(model: tuple[Path, Any], prefix: torch.Tensor, text: str) -> list[str]:
    """transformers' greedy continuation, as raw vocabulary strings."""
    tokenizer = Tokenizer.from_file(str(model[0] / "tokenizer.json"))
    ids = tokenizer.encode(text).ids
    tokens, _ = prefixed_greedy(model[1], prefix, ids, NEW_TOKENS)
    return [tokenizer.id_to_token(i) for i in tokens]


def params(new_tokens: int = NEW_TOKENS, **response: bool) -> pb.Parameters:
    return pb.Parameters(
        method=pb.GREEDY,
        stopping=pb.StoppingCriteria(max_new_tokens=new_tokens, min_new_tokens=new_tokens),
        response=pb.ResponseOptions(generated_tokens=True, **response),
    )


@pytest.mark.parametrize("prefix_id", ["sentiment/v1", "peft-tuned"])
def test_batch_with_a_prefix_matches_transformers(
    stub: pb_grpc.GenerationServiceStub, model: tuple[Path, Any], store: Path, prefix_id: str
) -> None:
    request = pb.BatchedGenerationRequest(
        prefix_id=prefix_id,
        requests=[pb.GenerationRequest(text=t) for t in PROMPTS],
        params=params(),
    )
    response = stub.Generate(request, timeout=60)
    prefix = prefix_of(store, prefix_id)
    tokenizer = Tokenizer.from_file(str(model[0] / "tokenizer.json"))
    for text, got in zip(PROMPTS, response.responses, strict=True):
        assert [t.text for t in got.tokens] == expected_tokens(model, prefix, text), text
        # TGIS: the input length without the prefix's virtual tokens.
        assert got.input_token_count == len(tokenizer.encode(text).ids)


def test_plain_and_prefixed_requests_share_the_batch(
    stub: pb_grpc.GenerationServiceStub, model: tuple[Path, Any], store: Path
) -> None:
    """Concurrent streams with and without prefixes: each gets its own continuation."""

    def stream(prefix_id: str | None) -> Any:
        request = pb.SingleGenerationRequest(
            request=pb.GenerationRequest(text=PROMPTS[0]), params=params()
        )
        if prefix_id is not None:  # set, even empty, it is looked up
            request.prefix_id = prefix_id
        return stub.GenerateStream(request, timeout=60)

    calls = [stream(p) for p in ("sentiment/v1", None, "peft-tuned")]
    texts = [[t.text for m in call for t in m.tokens] for call in calls]
    assert texts[0] == expected_tokens(model, prefix_of(store, "sentiment/v1"), PROMPTS[0])
    assert texts[2] == expected_tokens(model, prefix_of(store, "peft-tuned"), PROMPTS[0])
    assert texts[1] != texts[0]


def test_streamed_input_tokens_count_the_virtual_positions(
    stub: pb_grpc.GenerationServiceStub, model: tuple[Path, Any]
) -> None:
    """TGIS §3.2: the first message's input_token_count excludes the prefix, the
    input-tokens message lists (and counts) the virtual positions first, as the pad token."""
    request = pb.SingleGenerationRequest(
        prefix_id="sentiment/v1",
        request=pb.GenerationRequest(text=PROMPTS[0]),
        params=params(2, input_tokens=True, token_logprobs=True),
    )
    messages = list(stub.GenerateStream(request, timeout=60))
    tokenizer = Tokenizer.from_file(str(model[0] / "tokenizer.json"))
    ids = tokenizer.encode(PROMPTS[0]).ids
    assert messages[0].input_token_count == len(ids)
    inputs = messages[1]
    assert inputs.input_token_count == 5 + len(ids) == len(inputs.input_tokens)
    pad_text = tokenizer.id_to_token(PAD_TOKEN_ID)
    assert [t.text for t in inputs.input_tokens[:5]] == [pad_text] * 5
    assert [t.text for t in inputs.input_tokens[5:]] == [tokenizer.id_to_token(i) for i in ids]


@pytest.mark.parametrize(
    ("prefix_id", "message"),
    [
        (
            "missing",
            "can't retrieve prompt prefix with id 'missing': prefix id \"missing\" not found",
        ),
        (
            "../etc",
            "can't retrieve prompt prefix with id '../etc': Unexpected <class 'Exception'>: "
            "Invalid prefix id ../etc, must contain only alphanumeric, _ and - and /",
        ),
        (
            "bad",
            "can't retrieve prompt prefix with id 'bad': Unexpected <class 'Exception'>: "
            "Invalid prefix embedding tensor",
        ),
        (
            "",
            "can't retrieve prompt prefix with id '': Unexpected <class 'Exception'>: "
            "Invalid prefix id , must contain only alphanumeric, _ and - and /",
        ),
    ],
)
def test_prefix_errors_are_tgis_messages(
    stub: pb_grpc.GenerationServiceStub, prefix_id: str, message: str
) -> None:
    request = pb.BatchedGenerationRequest(
        prefix_id=prefix_id, requests=[pb.GenerationRequest(text="Hi")], params=params(2)
    )
    with pytest.raises(grpc.RpcError) as caught:
        stub.Generate(request, timeout=60)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details() == message


def test_the_prefix_counts_in_the_length_limits(
    stub: pb_grpc.GenerationServiceStub, model: tuple[Path, Any]
) -> None:
    tokenizer = Tokenizer.from_file(str(model[0] / "tokenizer.json"))
    long_text = " ".join(["the"] * 60)
    long_len = len(tokenizer.encode(long_text).ids)
    assert long_len + 7 >= MAX_SEQUENCE_LENGTH
    request = pb.BatchedGenerationRequest(
        prefix_id="peft-tuned", requests=[pb.GenerationRequest(text=long_text)], params=params(2)
    )
    with pytest.raises(grpc.RpcError) as caught:
        stub.Generate(request, timeout=60)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details() == (
        f"input tokens ({long_len}) plus prefix length (7) must be < {MAX_SEQUENCE_LENGTH}"
    )
    # Shorter: max_new_tokens is lowered to fit and the request ends with TOKEN_LIMIT.
    text = " ".join(["the"] * 30)
    length = len(tokenizer.encode(text).ids)
    assert length + 7 + 40 > MAX_SEQUENCE_LENGTH > length + 7
    request.requests[0].text = text
    request.params.stopping.min_new_tokens = MAX_SEQUENCE_LENGTH - length - 7  # no early EOS
    request.params.stopping.max_new_tokens = 40
    (response,) = stub.Generate(request, timeout=60).responses
    assert response.stop_reason == pb.TOKEN_LIMIT
    assert response.generated_token_count == MAX_SEQUENCE_LENGTH - length - 7


def test_prefix_loads_are_measured_once_per_prefix(
    stub: pb_grpc.GenerationServiceStub, server: LauncherProcess
) -> None:
    def counts() -> tuple[float, float]:
        _, body = server.http_get("/metrics")
        text = body.decode()
        loads = re.search(r"^tgi_prompt_load_duration_count (\S+)$", text, re.M)
        failures = re.search(r"^tgi_prompt_load_failure(?:_total)? (\S+)$", text, re.M)
        assert loads and failures, text[:2000]
        return float(loads.group(1)), float(failures.group(1))

    request = pb.BatchedGenerationRequest(
        prefix_id="sentiment/v1", requests=[pb.GenerationRequest(text="Hi")], params=params(1)
    )
    stub.Generate(request, timeout=60)  # cached by now, whatever ran before
    before = counts()
    for _ in range(3):
        stub.Generate(request, timeout=60)
    assert counts() == before  # lengths come from the router's cache
    request.prefix_id = "not-there"
    for _ in range(2):
        with pytest.raises(grpc.RpcError):
            stub.Generate(request, timeout=60)
    assert counts() == (before[0], before[1] + 2)  # failures are not cached


def test_guided_decoding_with_a_prefix(stub: pb_grpc.GenerationServiceStub) -> None:
    """A prompt prefix's output still keeps to the choices."""
    choices = ["alpha", "beta", "gamma"]
    request = pb.BatchedGenerationRequest(
        prefix_id="sentiment/v1",
        requests=[pb.GenerationRequest(text=t) for t in PROMPTS],
        params=pb.Parameters(
            decoding=pb.DecodingParameters(
                choice=pb.DecodingParameters.StringChoices(choices=choices)
            ),
            stopping=pb.StoppingCriteria(max_new_tokens=20),
        ),
    )
    for response in stub.Generate(request, timeout=120).responses:
        assert response.stop_reason == pb.EOS_TOKEN
        assert response.text in choices


def test_openai_model_names_a_prompt_prefix(
    server: LauncherProcess, model: tuple[Path, Any], store: Path
) -> None:
    """Without an adapter store, ``model`` may name a prompt-tuning prefix of the prefix
    store (TGIS's prefix_id): transformers' answer with that prefix; unknown: 404."""
    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{server.http_port}/v1", api_key="-", max_retries=0
    )
    tokenizer = Tokenizer.from_file(str(model[0] / "tokenizer.json"))
    reply = client.completions.create(
        model="sentiment/v1", prompt=PROMPTS[0], max_tokens=NEW_TOKENS, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    want = expected_tokens(model, prefix_of(store, "sentiment/v1"), PROMPTS[0])
    assert reply.choices[0].text == tokenizer.decode([tokenizer.token_to_id(t) for t in want])
    assert reply.usage is not None
    assert reply.usage.prompt_tokens == len(tokenizer.encode(PROMPTS[0]).ids)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="sentiment/v9", prompt="Hi", max_tokens=2)
