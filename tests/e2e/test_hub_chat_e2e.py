"""HF TGI's Messages API (OpenAI's ``/v1/chat/completions``) driven by
``huggingface_hub.InferenceClient.chat_completion`` as TGI's users call it (the client given
the server's URL, which makes it send ``"model": "dummy"``), against the shared embedded
server, with gRPC's Generate on the prompt transformers' ``apply_chat_template`` renders as
the oracle: greedy and seeded texts, token logprobs and alternatives (within 1e-5), finish
reasons, usage, stop sequences, streamed or not; TGI's ``response_format`` forms (``json``
with a schema, ``regex``; OpenAI's ``json_schema``, which the client rewrites into TGI's
``json_object`` with a value) equal gRPC's guided decoding; a named tool's call parses.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from huggingface_hub import InferenceClient
from transformers import AutoTokenizer

from tests.e2e.server import LauncherProcess
from tgis.embedded_model import MODEL_DIR
from tgis.pb import generation_pb2 as pb
from tgis.pb import generation_pb2_grpc as pb_grpc
from tgis.router.intake.tokenization import RouterTokenizer

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        bool(os.environ.get("TGIS_E2E_MODEL")), reason="renders the embedded model's template"
    ),
]

MESSAGES = [
    {"role": "system", "content": "You explain Python."},
    {"role": "user", "content": "What does sorted return?"},
]
FINISH = {
    pb.StopReason.MAX_TOKENS: "length",
    pb.StopReason.TOKEN_LIMIT: "length",
    pb.StopReason.EOS_TOKEN: "stop",
    pb.StopReason.STOP_SEQUENCE: "stop",
}


@pytest.fixture(scope="module")
def hub(embedded_server: LauncherProcess) -> InferenceClient:
    return InferenceClient(model=embedded_server.http_base, timeout=60)


@pytest.fixture(scope="module")
def prompt() -> str:
    """The chat prompt as transformers renders it, less the BOS the template writes (gRPC
    adds its own)."""
    tokenizer = AutoTokenizer.from_pretrained(MODEL_DIR)
    rendered = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert rendered.startswith(tokenizer.bos_token)
    return rendered.removeprefix(tokenizer.bos_token)


@pytest.fixture(scope="module")
def vocabulary() -> Iterator[RouterTokenizer]:
    tokenizer = RouterTokenizer(str(MODEL_DIR / "tokenizer.json"))
    yield tokenizer
    tokenizer.close()


def generate(server: LauncherProcess, text: str, **params: Any) -> Any:
    """Generate's answer for ``text``, with every generated token's logprob and two
    alternatives."""
    response = pb.ResponseOptions(generated_tokens=True, token_logprobs=True, top_n_tokens=2)
    with grpc.insecure_channel(server.grpc_target) as channel:
        request = pb.BatchedGenerationRequest(
            requests=[pb.GenerationRequest(text=text)],
            params=pb.Parameters(response=response, **params),
        )
        return pb_grpc.GenerationServiceStub(channel).Generate(request, timeout=60).responses[0]


def greedy(max_new_tokens: int, **stopping: Any) -> dict[str, Any]:
    stops = pb.StoppingCriteria(max_new_tokens=max_new_tokens, **stopping)
    return {"method": pb.GREEDY, "stopping": stops}


def alone(vocabulary: RouterTokenizer, token: str) -> str:
    """A gRPC token (a vocabulary string) as OpenAI's logprobs name it: decoded alone."""
    token_id = vocabulary.token_to_id(token)
    assert token_id is not None
    return vocabulary.decode([token_id], skip_special_tokens=False)


def assert_logprobs_equal(got: list[Any], want: Any, vocabulary: RouterTokenizer) -> None:
    assert [t.token for t in got] == [alone(vocabulary, t.text) for t in want.tokens]
    assert [t.logprob for t in got] == pytest.approx([t.logprob for t in want.tokens], abs=1e-5)
    for mine, theirs in zip(got, want.tokens, strict=True):
        tops = theirs.top_tokens
        assert [t.token for t in mine.top_logprobs] == [alone(vocabulary, t.text) for t in tops]
        assert [t.logprob for t in mine.top_logprobs] == pytest.approx(
            [t.logprob for t in tops], abs=1e-5
        )


def streamed(hub: InferenceClient, **params: Any) -> tuple[str, list[Any], str | None]:
    """A streamed chat's text, its tokens' logprobs and its finish reason."""
    chunks = list(hub.chat_completion(MESSAGES, stream=True, **params))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    logprobs = [
        t
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.content
    ]
    return text, logprobs, chunks[-1].choices[0].finish_reason


def test_greedy_chat_with_logprobs_equals_generate(
    hub: InferenceClient,
    embedded_server: LauncherProcess,
    prompt: str,
    vocabulary: RouterTokenizer,
) -> None:
    want = generate(embedded_server, prompt, **greedy(12))
    got = hub.chat_completion(MESSAGES, max_tokens=12, temperature=0, logprobs=True, top_logprobs=2)
    (choice,) = got.choices
    assert choice.message.role == "assistant" and choice.message.content == want.text
    assert choice.finish_reason == FINISH[want.stop_reason]
    assert got.usage.prompt_tokens == want.input_token_count
    assert got.usage.completion_tokens == want.generated_token_count
    assert choice.logprobs is not None
    assert_logprobs_equal(choice.logprobs.content, want, vocabulary)
    text, logprobs, finish = streamed(
        hub, max_tokens=12, temperature=0, logprobs=True, top_logprobs=2
    )
    assert (text, finish) == (want.text, FINISH[want.stop_reason])
    assert_logprobs_equal(logprobs, want, vocabulary)
    # Without logprobs: the same text, no logprobs.
    plain = hub.chat_completion(MESSAGES, max_tokens=12, temperature=0)
    assert plain.choices[0].message.content == want.text and plain.choices[0].logprobs is None


def test_seeded_sampling_and_stop_equal_generate(
    hub: InferenceClient,
    embedded_server: LauncherProcess,
    prompt: str,
    vocabulary: RouterTokenizer,
) -> None:
    sampling = pb.SamplingParameters(temperature=0.8, seed=7)
    want = generate(
        embedded_server,
        prompt,
        method=pb.SAMPLE,
        sampling=sampling,
        stopping=pb.StoppingCriteria(max_new_tokens=16),
    )
    params: dict[str, Any] = {"max_tokens": 16, "temperature": 0.8, "seed": 7}
    got = hub.chat_completion(MESSAGES, logprobs=True, top_logprobs=2, **params)
    assert got.choices[0].message.content == want.text
    assert_logprobs_equal(got.choices[0].logprobs.content, want, vocabulary)
    text, _, finish = streamed(hub, **params)
    assert (text, finish) == (want.text, FINISH[want.stop_reason])
    # A stop string from inside the greedy text: left out of the answer, as gRPC's
    # include_stop_sequence false.
    stop = generate(embedded_server, prompt, **greedy(12)).text[4:7]
    want = generate(
        embedded_server,
        prompt,
        **greedy(12, stop_sequences=[stop], include_stop_sequence=False),
    )
    assert want.stop_reason == pb.StopReason.STOP_SEQUENCE
    got = hub.chat_completion(MESSAGES, max_tokens=12, temperature=0, stop=[stop])
    assert got.choices[0].message.content == want.text
    assert got.choices[0].finish_reason == "stop"
    assert streamed(hub, max_tokens=12, temperature=0, stop=[stop])[0] == want.text


SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer", "maximum": 99}, "ok": {"type": "boolean"}},
    "required": ["n", "ok"],
    "additionalProperties": False,
}


@pytest.mark.parametrize(
    ("response_format", "decoding"),
    [
        ({"type": "json", "value": SCHEMA}, {"json_schema": json.dumps(SCHEMA)}),
        ({"type": "regex", "value": "(yes|no), [0-9]{2}"}, {"regex": "(yes|no), [0-9]{2}"}),
        (
            {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}},
            {"json_schema": json.dumps(SCHEMA)},
        ),
    ],
    ids=["tgi-json", "tgi-regex", "openai-json-schema"],
)
def test_response_formats_equal_guided_generate(
    hub: InferenceClient,
    embedded_server: LauncherProcess,
    prompt: str,
    response_format: dict[str, Any],
    decoding: dict[str, str],
) -> None:
    want = generate(
        embedded_server, prompt, decoding=pb.DecodingParameters(**decoding), **greedy(24)
    )
    got = hub.chat_completion(
        MESSAGES, max_tokens=24, temperature=0, response_format=response_format
    )
    content = got.choices[0].message.content
    assert content == want.text
    if "regex" in decoding:
        assert re.fullmatch(decoding["regex"], content)
    elif want.stop_reason == pb.StopReason.EOS_TOKEN:
        answer = json.loads(content)
        assert set(answer) == {"n", "ok"} and isinstance(answer["ok"], bool)


def test_a_named_tool_is_called(hub: InferenceClient) -> None:
    """Forced by guided decoding: the call names the tool and its arguments fit."""
    tool = {
        "type": "function",
        "function": {
            "name": "answer",
            "description": "Answer yes or no",
            "parameters": {
                "type": "object",
                "properties": {"ok": {"type": "boolean"}},
                "required": ["ok"],
                "additionalProperties": False,
            },
        },
    }
    choice = {"type": "function", "function": {"name": "answer"}}
    got = hub.chat_completion(
        MESSAGES, max_tokens=24, temperature=0, tools=[tool], tool_choice=choice
    )
    (call,) = got.choices[0].message.tool_calls
    assert call.type == "function" and call.function.name == "answer"
    assert isinstance(json.loads(call.function.arguments)["ok"], bool)
