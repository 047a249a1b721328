"""OpenAI bodies to GenerationCalls (``edge/openai_requests.py``): the parameter mapping,
the defaults, and every refusal naming its field."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tgis.router.edge.openai_requests import (
    OpenAIError,
    choice_seeds,
    parse_chat,
    parse_completion,
)
from tgis.router.request_types import GuidedKind, ValidatedRequest

LIMIT = 1000


def completion(**body: Any) -> Any:
    return parse_completion({"model": "m", "prompt": "hi", **body}, max_new_tokens=LIMIT)


def chat(parser: str = "hermes", **body: Any) -> Any:
    messages = body.pop("messages", [{"role": "user", "content": "hi"}])

    def render(msgs: list[Any], tools: list[Any] | None) -> str:
        text = "|".join(f"{m['role']}:{m.get('content')}" for m in msgs)
        return text if tools is None else f"{text}|tools:{json.dumps(tools)}"

    return parse_chat(
        {"model": "m", "messages": messages, **body},
        render,
        max_new_tokens=LIMIT,
        tool_call_parser=parser,
    )


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
        ({"n": 0}, "n"),
        ({"n": 129}, "n"),
        ({"n": True}, "n"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"logit_bias": {"1": 101}}, "logit_bias"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {"-1": 1}}, "logit_bias"),
        ({"logit_bias": {"1": "a"}}, "logit_bias"),
        ({"logit_bias": [1]}, "logit_bias"),
        ({"logit_bias": {str(t): 1 for t in range(301)}}, "logit_bias"),
        ({"top_p": 0}, "top_p"),
        ({"min_p": 1.5}, "min_p"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
        ({"stop_token_ids": [1, -2]}, "stop_token_ids"),
        ({"stop_token_ids": 5}, "stop_token_ids"),
        ({"skip_special_tokens": 1}, "skip_special_tokens"),
        ({"spaces_between_special_tokens": False}, "spaces_between_special_tokens"),
        ({"guided_choice": "a"}, "guided_choice"),
        ({"guided_json": 3}, "guided_json"),
        ({"guided_regex": ["a"]}, "guided_regex"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_regex, guided_choice"),
        ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
        ({"structured_outputs": "json"}, "structured_outputs"),
        ({"structured_outputs": {"regex": 1}}, "structured_outputs.regex"),
        ({"suffix": "x"}, "suffix"),
        ({"best_of": 2}, "best_of"),
        ({"bogus": 1}, "bogus"),
        ({"prompt": [[]]}, "prompt"),
        ({"prompt": [1, "a"]}, "prompt"),
        ({"prompt": [-1]}, "prompt"),
        ({"prompt": [True]}, "prompt"),
        ({"prompt": [[1], ["a"]]}, "prompt"),
        ({"prompt": [1 << 32]}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": None}, "prompt"),
        ({"model": 3}, "model"),
        ({"max_tokens": 0}, "max_tokens"),  # without echo
        ({"max_tokens": -1, "echo": True}, "max_tokens"),
        ({"max_tokens": 0, "echo": True, "min_tokens": 1}, "min_tokens"),
        ({"temperature": 3}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"logprobs": 6}, "logprobs"),
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
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"function_call": "auto"}, "function_call"),
        ({"n": 200}, "n"),
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
            {"response_format": {"type": "json_schema", "json_schema": {"schema": [True]}}},
            "response_format",
        ),
        ({"response_format": {"type": "json"}}, "response_format"),
        ({"response_format": {"type": "json", "value": "{not json"}}, "response_format"),
        ({"response_format": {"type": "json_object", "value": [1]}}, "response_format"),
        ({"response_format": {"type": "regex", "value": ""}}, "response_format"),
        ({"response_format": "json"}, "response_format"),
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


def test_openai_penalties_bias_and_vllm_sampling_fields() -> None:
    request = completion(
        temperature=0.7,
        presence_penalty=0.5,
        frequency_penalty=-0.25,
        logit_bias={"7": -100, " 3": 2.5},
        min_p=0.1,
        top_p=0.9,
    )
    sampling = request.call.params.sampling
    assert (sampling.presence_penalty, sampling.frequency_penalty) == (0.5, -0.25)
    assert sampling.logit_bias == ((3, 2.5), (7, -100.0))
    assert (sampling.min_p, sampling.top_p) == (0.1, 0.9)
    assert completion().call.params.sampling == completion(logit_bias={}).call.params.sampling


def test_ignore_eos_masks_eos_up_to_max_tokens_without_asking_for_them() -> None:
    """The shard masks EOS to the end; the request's own min_new_tokens (checked against
    the context length) stays what min_tokens says."""
    params = completion(max_tokens=50, ignore_eos=True, min_tokens=3).call.params
    assert params.sampling.min_new_tokens == 50
    assert params.stopping.min_new_tokens == 3 and params.stopping.max_new_tokens == 50


def test_vllm_output_fields() -> None:
    params = completion(
        stop_token_ids=[5, 9],
        skip_special_tokens=False,
        include_stop_str_in_output=True,
        spaces_between_special_tokens=True,
        stop=["x"],
    ).call.params
    assert params.stopping.stop_token_ids == (5, 9)
    assert params.stopping.include_stop_sequence
    assert params.response.skip_special_tokens is False
    assert completion().call.params.response.skip_special_tokens is None


@pytest.mark.parametrize(
    ("body", "kind", "text", "choices"),
    [
        ({"guided_json": {"type": "object"}}, GuidedKind.JSON_SCHEMA, '{"type": "object"}', ()),
        ({"guided_json": '{"type": "integer"}'}, GuidedKind.JSON_SCHEMA, '{"type": "integer"}', ()),
        ({"guided_regex": "[a-z]+"}, GuidedKind.REGEX, "[a-z]+", ()),
        ({"guided_choice": ["a", "b"]}, GuidedKind.CHOICE, "", ("a", "b")),
        ({"guided_grammar": "root ::= x"}, GuidedKind.GRAMMAR, "root ::= x", ()),
        (
            {"guided_regex": "a+", "guided_decoding_backend": "xgrammar"},
            GuidedKind.REGEX,
            "a+",
            (),
        ),
        ({"structured_outputs": {"json": {}}}, GuidedKind.JSON_SCHEMA, "{}", ()),
        ({"structured_outputs": {"choice": ["x", "y"]}}, GuidedKind.CHOICE, "", ("x", "y")),
        ({"structured_outputs": {"json_object": True}}, GuidedKind.JSON_OBJECT, "", ()),
    ],
)
def test_vllm_guided_fields(
    body: dict[str, Any], kind: GuidedKind, text: str, choices: tuple[str, ...]
) -> None:
    for request in (completion(**body), chat(**body)):
        guided = request.call.params.guided
        assert guided is not None and guided.kind is kind
        assert (guided.text, guided.choices) == (text, choices)


def test_an_empty_or_absent_model_is_the_served_model() -> None:
    assert completion(model="").model is None
    assert chat(model="").model is None
    assert completion(model="other").model == "other"


def test_n_repeats_each_prompt_in_order() -> None:
    request = completion(prompt=["a", "b"], n=3, temperature=0.5, seed=7)
    assert request.n == 3
    assert request.call.texts == ("a", "a", "a", "b", "b", "b")  # index = p * n + j
    assert chat(n=2).call.texts == ("user:hi", "user:hi")
    assert completion().n == 1


def validated(request: Any) -> list[ValidatedRequest]:
    """The call's inputs as admission gives them (each seeded as validation seeds it)."""
    params = request.call.params
    return [
        ValidatedRequest(text, (1, 2), params, params.stopping, params.sampling.seeded())
        for text in request.call.texts
    ]


def test_choice_seeds_follow_the_request_seed() -> None:
    """Choice j of each prompt gets seed + j (mod 2^64), as vLLM seeds its n samples."""
    request = completion(prompt=["a", "b"], n=3, temperature=0.5, seed=(1 << 64) - 2)
    seeds = [v.sampling.seed for v in choice_seeds(request, validated(request))]
    assert seeds == [(1 << 64) - 2, (1 << 64) - 1, 0] * 2
    # No seed: each keeps the random one validation gave it; greedy: none at all.
    unseeded = completion(n=4, temperature=0.5)
    seeds = [v.sampling.seed for v in choice_seeds(unseeded, validated(unseeded))]
    assert None not in seeds and len(set(seeds)) == 4
    greedy = completion(n=2, temperature=0, seed=5)
    assert [v.sampling.seed for v in choice_seeds(greedy, validated(greedy))] == [None, None]
    single = completion(temperature=0.5, seed=5)
    assert [v.sampling.seed for v in choice_seeds(single, validated(single))] == [5]


def test_echo_with_logprobs_asks_for_the_prompts_details() -> None:
    request = completion(echo=True, logprobs=2, max_tokens=4)
    response = request.call.params.response
    assert request.echo and request.logprobs == 2
    assert response.input_tokens and response.generated_tokens and response.token_logprobs
    assert response.top_n_tokens == 2
    assert not completion(echo=True).call.params.response.input_tokens
    assert not completion(logprobs=2).call.params.response.input_tokens


def test_max_tokens_zero_with_echo_generates_one_token_and_drops_it() -> None:
    request = completion(echo=True, logprobs=0, max_tokens=0)
    assert request.drop_output and request.call.params.stopping.max_new_tokens == 1
    assert not completion(echo=True, max_tokens=1).drop_output


def test_prompts_as_token_ids_are_taken_as_they_are() -> None:
    """lm-eval's local-completions sends token ids: no special tokens are added, and the
    route decodes their texts (for echo) before admission."""
    one = completion(prompt=[5, 6, 7])
    assert one.call.token_ids == ((5, 6, 7),) and not one.call.add_special_tokens
    many = completion(prompt=[[5, 6], [7]], n=2)
    assert many.call.token_ids == ((5, 6), (5, 6), (7,), (7,))
    assert len(many.call.texts) == 4
    assert completion(prompt=["a"]).call.token_ids is None


def test_tgis_response_formats_and_the_hub_clients_model() -> None:
    """What huggingface_hub's InferenceClient.chat_completion sends to a TGI endpoint:
    TGI's ``json`` (a schema or its text) and ``regex`` forms, ``json_object`` with a
    ``value`` (TGI's alias, and the client's rewrite of OpenAI's ``json_schema``), and
    ``"model": "dummy"`` for the server it was given by URL."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    for fmt in (
        {"type": "json", "value": schema},
        {"type": "json", "value": json.dumps(schema)},
        {"type": "json_object", "value": schema},
    ):
        guided = chat(response_format=fmt).call.params.guided
        assert guided.kind is GuidedKind.JSON_SCHEMA and json.loads(guided.text) == schema
    guided = chat(response_format={"type": "regex", "value": "(yes|no)"}).call.params.guided
    assert guided.kind is GuidedKind.REGEX and guided.text == "(yes|no)"
    assert completion(response_format={"type": "json", "value": True}).call.params.guided.text == (
        "true"
    )
    assert chat(model="dummy").model is None and completion(model="dummy").model is None


def test_schema_true_and_false_are_json_schemas_in_response_format() -> None:
    """As gRPC's json_schema and vLLM's guided_json take them: the compiler serves true
    (any JSON value) and refuses false with its own message."""
    for schema, text in ((True, "true"), (False, "false")):
        fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
        guided = chat(response_format=fmt).call.params.guided
        assert guided.kind is GuidedKind.JSON_SCHEMA and guided.text == text
