"""OpenAI bodies to GenerationCalls (``edge/openai_requests.py``): the parameter mapping,
the defaults, and every refusal naming its field."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tgis.router.edge.openai_requests import OpenAIError, parse_chat, parse_completion
from tgis.router.request_types import GuidedKind

LIMIT = 1000


def completion(**body: Any) -> Any:
    return parse_completion({"model": "m", "prompt": "hi", **body}, max_new_tokens=LIMIT)


def chat(**body: Any) -> Any:
    messages = body.pop("messages", [{"role": "user", "content": "hi"}])

    def render(msgs: list[Any]) -> str:
        return "|".join(f"{m['role']}:{m.get('content')}" for m in msgs)

    return parse_chat({"model": "m", "messages": messages, **body}, render, max_new_tokens=LIMIT)


def test_completion_defaults_and_sampling() -> None:
    plain = completion()
    assert plain.call.texts == ("hi",) and plain.call.add_special_tokens
    assert plain.call.params.stopping.max_new_tokens == 16  # OpenAI's default
    assert plain.call.params.sampling.temperature == 1.0  # OpenAI samples by default
    assert not plain.stream and plain.logprobs is None
    greedy = completion(temperature=0, top_p=0.5, top_k=5, seed=3)
    assert greedy.call.params.sampling.is_greedy
    assert greedy.call.params.sampling.seed is None and greedy.call.params.sampling.top_k == 0
    sampled = completion(temperature=0.7, top_p=0.9, top_k=20, seed=-1, repetition_penalty=1.2)
    s = sampled.call.params.sampling
    assert (s.temperature, s.top_p, s.top_k, s.seed) == (0.7, 0.9, 20, (1 << 64) - 1)
    assert s.repetition_penalty == 1.2
    batch = completion(prompt=["a", "b"], stop="x", max_tokens=5, min_tokens=2, logprobs=3)
    st = batch.call.params.stopping
    assert batch.call.texts == ("a", "b") and st.stop_sequences == ("x",)
    assert (st.max_new_tokens, st.min_new_tokens, st.include_stop_sequence) == (5, 2, False)
    assert batch.logprobs == 3 and batch.call.params.response.top_n_tokens == 3
    streamed = completion(stream=True, stream_options={"include_usage": True}, echo=True)
    assert streamed.stream and streamed.include_usage and streamed.echo
    assert plain.model == "m"
    # No model named: the served one (as vLLM takes it); named, checked by the route.
    unnamed = parse_completion({"prompt": "hi"}, max_new_tokens=LIMIT)
    assert unnamed.model is None and unnamed.call.texts == ("hi",)


def test_chat_renders_and_adds_no_special_tokens() -> None:
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    request = chat(messages=[{"role": "user", "content": parts}], logprobs=True, top_logprobs=2)
    assert request.call.texts == ("user:a\nb",) and not request.call.add_special_tokens
    assert request.chat and not completion().chat
    assert request.logprobs == 2 and request.call.params.response.token_logprobs
    assert chat().call.params.stopping.max_new_tokens == LIMIT  # the server's limit
    assert chat(max_tokens=7, max_completion_tokens=9).call.params.stopping.max_new_tokens == 9
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    guided = chat(response_format=fmt).call.params.guided
    assert guided.kind is GuidedKind.JSON_SCHEMA and json.loads(guided.text) == schema
    assert chat(response_format={"type": "json_object"}).call.params.guided.kind is (
        GuidedKind.JSON_OBJECT
    )
    assert chat(response_format={"type": "text"}).call.params.guided is None


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"n": 2}, "n"),
        ({"presence_penalty": 0.1}, "presence_penalty"),
        ({"frequency_penalty": -1}, "frequency_penalty"),
        ({"logit_bias": {"1": 2}}, "logit_bias"),
        ({"suffix": "x"}, "suffix"),
        ({"best_of": 2}, "best_of"),
        ({"bogus": 1}, "bogus"),
        ({"prompt": [1, 2]}, "prompt"),
        ({"prompt": None}, "prompt"),
        ({"model": ""}, "model"),
        ({"model": 3}, "model"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": 3}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"logprobs": 6}, "logprobs"),
        ({"echo": True, "logprobs": 1}, "echo"),
        ({"stop": [1]}, "stop"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"response_format": {"type": "yaml"}}, "response_format"),
    ],
)
def test_completion_refusals_name_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(OpenAIError) as refused:
        completion(**body)
    assert refused.value.status == 400 and refused.value.param == param
    assert refused.value.body()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": [{"type": "function"}]}, "tools"),
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"messages": []}, "messages"),
        ({"messages": [{"content": "no role"}]}, "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"echo": True}, "echo"),  # a completions field
        ({"messages": [{"role": "user", "content": None}]}, "messages"),
        ({"messages": [{"role": "user"}]}, "messages"),
        ({"messages": [{"role": "system", "content": None}]}, "messages"),
        ({"messages": [{"role": "user", "content": 7}]}, "messages"),
        ({"messages": [{"role": "user", "content": {"text": "x"}}]}, "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages"),
        ({"messages": [{"role": "user", "content": ["text"]}]}, "messages"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": True}}},
            "response_format",
        ),
    ],
)
def test_chat_refusals_name_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(OpenAIError) as refused:
        chat(**body)
    assert refused.value.status == 400 and refused.value.param == param


def test_assistant_content_may_be_null() -> None:
    """OpenAI allows a null content in an assistant message (one that called tools); it
    renders as empty text, never as "None"."""
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None},
        {"role": "user", "content": "again"},
    ]
    assert chat(messages=messages).call.texts == ("user:hi|assistant:|user:again",)


def test_a_schema_too_deep_to_serialize_is_refused() -> None:
    schema: dict[str, Any] = {}
    for _ in range(5000):
        schema = {"properties": {"a": schema}}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    with pytest.raises(OpenAIError) as refused:
        chat(response_format=fmt)
    assert refused.value.status == 400 and refused.value.param == "response_format"
    assert "nested too deeply" in refused.value.message
