"""HF TGI's REST API on the HTTP port, driven by TGI's real clients, HF's ``text-generation``
(``text_generation.Client``) and ``huggingface_hub.InferenceClient.text_generation``,
against a launched server (the embedded model, float32), with the gRPC API of the same
server as the oracle: texts, token ids (the vocabulary strings gRPC reports), logprobs,
prefill and top tokens, finish reasons and counts equal Generate's with the same
parameters, greedy, seeded sampling, stop sequences, truncation and grammars alike; the
streams add up to the unary answers; refusals reach the clients as TGI's errors;
``/info``, ``/tokenize`` and CORS (``--cors-allow-origin``, forwarded by the launcher).
"""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
import text_generation
from huggingface_hub import InferenceClient
from huggingface_hub import errors as hub_errors
from text_generation.types import Grammar, GrammarType

from tests.e2e.server import LauncherProcess, healthy_launcher
from tgis.embedded_model import MODEL_DIR
from tgis.pb import generation_pb2 as pb
from tgis.pb import generation_pb2_grpc as pb_grpc
from tgis.router.intake.tokenization import RouterTokenizer

pytestmark = [
    pytest.mark.slow,
    # text-generation 0.7.0 calls pydantic's deprecated .dict(): its concern, not ours
    pytest.mark.filterwarnings("ignore:The `dict` method is deprecated:DeprecationWarning"),
]

ORIGIN = "https://ui.example"
PROMPT = "Once upon a time"
FINISH = {
    pb.StopReason.MAX_TOKENS: "length",
    pb.StopReason.TOKEN_LIMIT: "length",
    pb.StopReason.EOS_TOKEN: "eos_token",
    pb.StopReason.STOP_SEQUENCE: "stop_sequence",
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LauncherProcess]:
    args = ["--dtype", "float32", "--cors-allow-origin", ORIGIN]
    with healthy_launcher(tmp_path_factory.mktemp("tgi"), args) as launcher:
        yield launcher


@pytest.fixture(scope="module")
def client(server: LauncherProcess) -> text_generation.Client:
    return text_generation.Client(server.http_base, timeout=60)


@pytest.fixture(scope="module")
def vocabulary() -> Iterator[RouterTokenizer]:
    tokenizer = RouterTokenizer(str(MODEL_DIR / "tokenizer.json"))
    yield tokenizer
    tokenizer.close()


def grpc_generate(server: LauncherProcess, params: pb.Parameters, text: str = PROMPT) -> Any:
    with grpc.insecure_channel(server.grpc_target) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        request = pb.BatchedGenerationRequest(
            requests=[pb.GenerationRequest(text=text)], params=params
        )
        return stub.Generate(request, timeout=60).responses[0]


def detailed(top_n: int = 0, input_tokens: bool = False, **params: Any) -> pb.Parameters:
    """Parameters asking for every generated token with its logprob, as TGI's details."""
    response = pb.ResponseOptions(
        generated_tokens=True, token_logprobs=True, top_n_tokens=top_n, input_tokens=input_tokens
    )
    return pb.Parameters(response=response, **params)


def greedy(max_new_tokens: int, **stopping: Any) -> dict[str, Any]:
    stops = pb.StoppingCriteria(max_new_tokens=max_new_tokens, **stopping)
    return {"method": pb.GREEDY, "stopping": stops}


def assert_tokens_equal(got: list[Any], want: Any, vocabulary: RouterTokenizer) -> None:
    """TGI's tokens (ids) against gRPC's (vocabulary strings), with their logprobs."""
    assert [vocabulary.id_to_token(t.id) for t in got] == [t.text for t in want]
    assert [t.logprob for t in got] == pytest.approx([t.logprob for t in want], abs=1e-5)


def test_text_generation_greedy_details_equal_generate(
    client: text_generation.Client, server: LauncherProcess, vocabulary: RouterTokenizer
) -> None:
    got = client.generate(PROMPT, max_new_tokens=20, decoder_input_details=True, top_n_tokens=2)
    want = grpc_generate(server, detailed(2, True, **greedy(20)))
    details = got.details
    assert got.generated_text == want.text
    assert details.finish_reason.value == FINISH[want.stop_reason]
    assert details.generated_tokens == want.generated_token_count and details.seed is None
    assert_tokens_equal(details.tokens, want.tokens, vocabulary)
    # The prompt's tokens: the first has no logprob (gRPC's NaN).
    assert [vocabulary.id_to_token(t.id) for t in details.prefill] == [
        t.text for t in want.input_tokens
    ]
    assert details.prefill[0].logprob is None
    assert [t.logprob for t in details.prefill[1:]] == pytest.approx(
        [t.logprob for t in want.input_tokens[1:]], abs=1e-5
    )
    assert details.top_tokens is not None
    for tops, token in zip(details.top_tokens, want.tokens, strict=True):
        assert [vocabulary.id_to_token(t.id) for t in tops] == [t.text for t in token.top_tokens]
        assert [t.logprob for t in tops] == pytest.approx(
            [t.logprob for t in token.top_tokens], abs=1e-5
        )
    # The stream: one event per token, the same tokens, the text and details on the last.
    events = list(client.generate_stream(PROMPT, max_new_tokens=20, top_n_tokens=2))
    assert_tokens_equal([e.token for e in events], want.tokens, vocabulary)
    assert all(e.generated_text is None and e.details is None for e in events[:-1])
    assert events[-1].generated_text == want.text
    assert events[-1].details is not None
    assert events[-1].details.finish_reason.value == FINISH[want.stop_reason]
    assert events[-1].details.generated_tokens == want.generated_token_count
    assert all(e.top_tokens is not None and len(e.top_tokens) == 2 for e in events)
    texts = "".join(e.token.text for e in events if not e.token.special)
    assert texts == want.text


def test_text_generation_sampling_stops_and_truncation_equal_generate(
    client: text_generation.Client, server: LauncherProcess, vocabulary: RouterTokenizer
) -> None:
    sampled = client.generate(
        PROMPT, do_sample=True, seed=42, temperature=0.8, top_p=0.9, top_k=20,
        repetition_penalty=1.1, max_new_tokens=16,
    )  # fmt: skip
    sampling = pb.SamplingParameters(temperature=0.8, top_p=0.9, top_k=20, seed=42)
    want = grpc_generate(
        server,
        detailed(
            method=pb.SAMPLE,
            sampling=sampling,
            stopping=pb.StoppingCriteria(max_new_tokens=16),
            decoding=pb.DecodingParameters(repetition_penalty=1.1),
        ),
    )
    assert sampled.generated_text == want.text and sampled.details.seed == 42
    assert_tokens_equal(sampled.details.tokens, want.tokens, vocabulary)
    # A stop sequence stays in the text, as TGI keeps it (gRPC: include_stop_sequence).
    stopped = client.generate(PROMPT, max_new_tokens=30, stop_sequences=[" the"])
    oracle = grpc_generate(
        server, detailed(**greedy(30, stop_sequences=[" the"], include_stop_sequence=True))
    )
    assert oracle.stop_reason == pb.StopReason.STOP_SEQUENCE
    assert stopped.generated_text == oracle.text and stopped.generated_text.endswith(" the")
    assert stopped.details.finish_reason.value == "stop_sequence"
    # truncate keeps the prompt's last tokens, as truncate_input_tokens.
    long_prompt = "The cat sat on the mat and the dog sat on the log"
    cut = client.generate(long_prompt, max_new_tokens=8, truncate=4, decoder_input_details=True)
    want = grpc_generate(
        server, detailed(input_tokens=True, truncate_input_tokens=4, **greedy(8)), long_prompt
    )
    assert cut.generated_text == want.text and len(cut.details.prefill) == 4
    assert [vocabulary.id_to_token(t.id) for t in cut.details.prefill] == [
        t.text for t in want.input_tokens
    ]


def test_text_generation_grammars_equal_generate(
    client: text_generation.Client, server: LauncherProcess
) -> None:
    regex = "(yes|no), [0-9]{2}"
    got = client.generate(
        "Answer:", max_new_tokens=12, grammar=Grammar(type=GrammarType.Regex, value=regex)
    )
    want = grpc_generate(
        server, pb.Parameters(decoding=pb.DecodingParameters(regex=regex)), "Answer:"
    )
    assert re.fullmatch(regex, got.generated_text) and got.generated_text == want.text
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "maximum": 99}},
        "required": ["n"],
        "additionalProperties": False,
    }
    got = client.generate(
        "JSON:", max_new_tokens=20, grammar=Grammar(type=GrammarType.Json, value=schema)
    )
    want = grpc_generate(
        server, detailed(decoding=pb.DecodingParameters(json_schema=json.dumps(schema))), "JSON:"
    )
    assert got.generated_text == want.text
    if got.details.finish_reason.value == "eos_token":
        assert isinstance(json.loads(got.generated_text)["n"], int)


def test_inference_client_text_generation_equals_generate(
    server: LauncherProcess, vocabulary: RouterTokenizer
) -> None:
    hub = InferenceClient(model=server.http_base, timeout=60)
    want = grpc_generate(server, detailed(**greedy(12)))
    assert hub.text_generation(PROMPT, max_new_tokens=12) == want.text
    full = hub.text_generation(PROMPT, max_new_tokens=12, details=True, return_full_text=True)
    assert full.generated_text == PROMPT + want.text
    assert full.details is not None
    assert full.details.finish_reason == FINISH[want.stop_reason]
    assert full.details.generated_tokens == want.generated_token_count
    assert_tokens_equal(full.details.tokens, want.tokens, vocabulary)
    # Streamed without details: each token's text (a special token's own: </s>).
    texts = list(hub.text_generation(PROMPT, max_new_tokens=12, stream=True))
    eos = "</s>" if want.stop_reason == pb.StopReason.EOS_TOKEN else ""
    assert "".join(texts) == want.text + eos
    events = list(hub.text_generation(PROMPT, max_new_tokens=12, stream=True, details=True))
    assert_tokens_equal([e.token for e in events], want.tokens, vocabulary)
    last = events[-1]
    assert last.generated_text == want.text and last.details is not None
    assert last.details.finish_reason == FINISH[want.stop_reason]
    assert last.details.input_length == want.input_token_count


def test_refusals_reach_the_clients_as_tgis_errors(
    client: text_generation.Client, server: LauncherProcess
) -> None:
    with pytest.raises(text_generation.errors.ValidationError, match="`watermark` is not"):
        client.generate(PROMPT, watermark=True)
    with pytest.raises(text_generation.errors.ValidationError, match="`best_of` > 1"):
        client.generate(PROMPT, best_of=2, do_sample=True)
    with pytest.raises(text_generation.errors.ValidationError, match="frequency_penalty"):
        client.generate(PROMPT, frequency_penalty=0.5)
    with pytest.raises(text_generation.errors.ValidationError, match="max_new_tokens must be"):
        client.generate(PROMPT, max_new_tokens=100_000)  # TGIS's own rule
    hub = InferenceClient(model=server.http_base, timeout=60)
    with pytest.raises(hub_errors.ValidationError, match="`truncate` must be strictly"):
        hub.text_generation(PROMPT, truncate=100_000)
    status, body = post(
        server,
        "/generate_stream",
        {"inputs": PROMPT, "parameters": {"decoder_input_details": True}},
    )
    assert status == 422 and body["error_type"] == "validation"
    status, body = post(server, "/generate", {"inputs": PROMPT, "parameters": {"n": 2}})
    assert (status, body) == (
        422,
        {
            "error": "Input validation error: unknown field `parameters.n`",
            "error_type": "validation",
        },
    )


def post(server: LauncherProcess, path: str, body: Any) -> tuple[int, Any]:
    request = urllib.request.Request(
        server.http_base + path, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_info_tokenize_and_cors(server: LauncherProcess) -> None:
    status, raw = server.http_get("/info")
    info = json.loads(raw)
    with grpc.insecure_channel(server.grpc_target) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        model = stub.ModelInfo(pb.ModelInfoRequest(), timeout=30)
        tokenized = stub.Tokenize(
            pb.BatchedTokenizeRequest(
                requests=[pb.TokenizeRequest(text=PROMPT)], return_tokens=True, return_offsets=True
            ),
            timeout=30,
        ).responses[0]
    assert status == 200 and info["model_dtype"] == "float32"
    assert info["model_device_type"] == "cpu" and info["router"] == "text-generation-router"
    assert info["max_total_tokens"] == model.max_sequence_length
    assert info["max_new_tokens"] == model.max_new_tokens and info["max_best_of"] == 1
    status, tokens = post(server, "/tokenize", {"inputs": PROMPT})
    assert status == 200
    vocabulary = RouterTokenizer(str(MODEL_DIR / "tokenizer.json"))
    assert [vocabulary.id_to_token(t["id"]) for t in tokens] == list(tokenized.tokens)
    assert [(t["start"], t["stop"]) for t in tokens] == [
        (o.start, o.end) for o in tokenized.offsets
    ]
    assert "".join(t["text"] for t in tokens) == PROMPT
    vocabulary.close()
    # CORS, forwarded by the launcher: a preflight, and the header on a stream.
    preflight = urllib.request.Request(
        server.http_base + "/generate_stream",
        method="OPTIONS",
        headers={"Origin": ORIGIN, "Access-Control-Request-Method": "POST"},
    )
    with urllib.request.urlopen(preflight, timeout=30) as response:
        assert response.status == 204
        assert response.headers["Access-Control-Allow-Origin"] == ORIGIN
    stream = urllib.request.Request(
        server.http_base + "/generate_stream",
        json.dumps({"inputs": PROMPT, "parameters": {"max_new_tokens": 2}}).encode(),
        {"Content-Type": "application/json", "Origin": ORIGIN},
    )
    with urllib.request.urlopen(stream, timeout=60) as response:
        assert response.headers["Access-Control-Allow-Origin"] == ORIGIN
        events = [line for line in response.read().decode().split("\n\n") if line]
    assert len(events) == 2 and json.loads(events[-1].removeprefix("data:"))["generated_text"]
