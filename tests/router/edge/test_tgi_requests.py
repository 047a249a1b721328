"""TGI bodies to GenerationCalls (``edge/tgi_requests.py``): the parameter mapping (TGI's
sampling rule, its defaults, stop sequences kept), and every refusal as a 422 of TGI's
shape naming its field."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tgis.router.edge.tgi_requests import (
    DEFAULT_MAX_NEW_TOKENS,
    TGIError,
    parse_generate,
    parse_tokenize,
)
from tgis.router.request_types import GuidedKind

LIMIT = 1000
MAX_INPUT = 63


def generate(stream: bool | None = False, body: Any = None, **parameters: Any) -> Any:
    if body is None:
        body = {"inputs": "hi", "parameters": parameters}
    return parse_generate(body, stream=stream, max_new_tokens=LIMIT, max_input_tokens=MAX_INPUT)


def refusal(stream: bool | None = False, body: Any = None, **parameters: Any) -> TGIError:
    with pytest.raises(TGIError) as refused:
        generate(stream, body, **parameters)
    assert refused.value.status == 422 and refused.value.error_type == "validation"
    assert refused.value.body() == {"error": refused.value.message, "error_type": "validation"}
    assert refused.value.message.startswith("Input validation error: ")
    return refused.value


def test_defaults_are_tgis() -> None:
    plain = generate()
    params = plain.call.params
    assert plain.call.texts == ("hi",) and plain.call.add_special_tokens
    assert params.sampling.is_greedy and params.sampling.repetition_penalty == 1.0
    assert params.stopping.max_new_tokens == DEFAULT_MAX_NEW_TOKENS == 100
    assert params.stopping.include_stop_sequence  # TGI keeps the stop text
    assert params.truncate_input_tokens == 0 and params.guided is None
    assert not (plain.stream or plain.details or plain.return_full_text)
    # No details asked: the shard computes none.
    assert not params.response.generated_tokens and not params.response.token_logprobs
    # Below the default, the server's limit; null asks for the server's limit.
    small = parse_generate({"inputs": "hi"}, stream=None, max_new_tokens=7, max_input_tokens=9)
    assert small.call.params.stopping.max_new_tokens == 7 and not small.stream
    assert generate(max_new_tokens=None).call.params.stopping.max_new_tokens == LIMIT
    # Every field null is the same as absent (TGI's own client sends them all).
    nulls = dict.fromkeys(
        ["best_of", "seed", "temperature", "top_k", "top_p", "truncate", "typical_p",
         "top_n_tokens", "grammar", "repetition_penalty", "frequency_penalty", "adapter_id",
         "watermark", "details", "do_sample", "stop", "return_full_text",
         "decoder_input_details"]
    )  # fmt: skip
    assert generate(**nulls).call.params.sampling.is_greedy
    assert generate(body={"inputs": "x", "parameters": None}).call.texts == ("x",)


def test_sampling_follows_tgis_rule() -> None:
    # do_sample, or any warper set, samples; TGI's defaults (temperature 1) do not.
    assert generate(temperature=1.0).call.params.sampling.is_greedy
    assert not generate(do_sample=True).call.params.sampling.is_greedy
    warped = generate(temperature=0.7, top_k=20, top_p=0.9, typical_p=0.8, seed=7)
    s = warped.call.params.sampling
    assert (s.temperature, s.top_k, s.top_p, s.typical_p, s.seed) == (0.7, 20, 0.9, 0.8, 7)
    for warper in ({"top_k": 3}, {"top_p": 0.5}, {"typical_p": 0.5}):
        sampling = generate(**warper).call.params.sampling
        assert not sampling.is_greedy and sampling.temperature == 1.0, warper
    greedy = generate(repetition_penalty=1.3, seed=5).call.params.sampling
    assert greedy.is_greedy and greedy.repetition_penalty == 1.3 and greedy.seed is None
    assert generate(do_sample=True, seed=(1 << 64) - 1).call.params.sampling.seed == (1 << 64) - 1


def test_details_stop_truncate_grammar_and_adapter() -> None:
    detailed = generate(
        details=True, decoder_input_details=True, top_n_tokens=3, stop=["\n", "."],
        truncate=10, return_full_text=True, adapter_id="lora/a", max_new_tokens=9,
    )  # fmt: skip
    p = detailed.call.params
    assert detailed.details and detailed.decoder_input_details and detailed.return_full_text
    assert p.response.generated_tokens and p.response.token_logprobs
    assert p.response.input_tokens and p.response.top_n_tokens == 3
    assert p.stopping.stop_sequences == ("\n", ".") and p.stopping.max_new_tokens == 9
    assert p.truncate_input_tokens == 10 and detailed.call.adapter_id == "lora/a"
    # decoder_input_details without details: nothing to put the prefill in.
    assert not generate(decoder_input_details=True).call.params.response.input_tokens
    # A stream always carries each token (id, text, logprob); details only on its last.
    streamed = generate(stream=True, top_n_tokens=2)
    assert streamed.stream and streamed.call.params.response.generated_tokens
    assert streamed.call.params.response.top_n_tokens == 2 and not streamed.details
    # POST /: the body's stream chooses; the routes' choice wins over it.
    assert generate(None, {"inputs": "x", "stream": True}).stream
    assert not generate(False, {"inputs": "x", "stream": True}).stream
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    for value in (schema, json.dumps(schema)):
        guided = generate(grammar={"type": "json", "value": value}).call.params.guided
        assert guided.kind is GuidedKind.JSON_SCHEMA and json.loads(guided.text) == schema
    regex = generate(grammar={"type": "regex", "value": "[0-9]+"}).call.params.guided
    assert regex.kind is GuidedKind.REGEX and regex.text == "[0-9]+"
    no_specials = generate(body={"inputs": "<s>x", "add_special_tokens": False})
    assert not no_specials.call.add_special_tokens


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        ({"best_of": 2}, "`best_of` > 1 is not supported"),
        ({"best_of": 0}, "`best_of` must be >= 1. Given: 0"),
        ({"watermark": True}, "`watermark` is not supported"),
        ({"frequency_penalty": 0.5}, "`frequency_penalty` is not supported"),
        ({"frequency_penalty": 3}, "`frequency_penalty` must be >= -2.0 and <= 2.0"),
        ({"temperature": 0}, "`temperature` must be strictly positive"),
        ({"temperature": "hot"}, "`temperature` must be a number"),
        ({"top_k": 0}, "`top_k` must be strictly positive"),
        ({"top_k": 1 << 31}, "`top_k` must be <= 2147483647"),
        ({"top_p": 1.0}, "`top_p` must be > 0.0 and < 1.0"),
        ({"typical_p": 0}, "`typical_p` must be > 0.0 and < 1.0"),
        ({"repetition_penalty": 0}, "`repetition_penalty` must be strictly positive"),
        ({"max_new_tokens": 0}, "`max_new_tokens` must be strictly positive"),
        ({"max_new_tokens": 1.5}, "`max_new_tokens` must be an integer"),
        ({"seed": -1}, "`seed` must be >= 0"),
        ({"stop": "x"}, "`stop` must be a list of strings"),
        ({"truncate": 0}, "`truncate` must be strictly positive and at most 63"),
        ({"truncate": 64}, "Given: 64"),
        ({"top_n_tokens": -1}, "`top_n_tokens` must be >= 0. Given: -1"),
        ({"details": "yes"}, "`details` must be a boolean"),
        ({"grammar": {"type": "ebnf", "value": "x"}}, "`grammar.type` must be `json` or `regex`"),
        ({"grammar": {"type": "regex", "value": ""}}, "`value` must be a non-empty string"),
        ({"grammar": {"type": "json", "value": "{"}}, "must be a JSON schema"),
        ({"grammar": {"type": "json", "value": [1]}}, "must be a JSON schema"),
        ({"adapter_id": 3}, "`adapter_id` must be a string"),
        ({"n": 2}, "unknown field `parameters.n`"),
    ],
)
def test_refusals_name_the_parameter(parameters: dict[str, Any], message: str) -> None:
    assert message in refusal(**parameters).message


def test_body_refusals() -> None:
    assert "a JSON object" in refusal(body=[1]).message
    assert "`inputs` must be a string" in refusal(body={"parameters": {}}).message
    assert "`inputs` cannot be empty" in refusal(body={"inputs": ""}).message
    assert (
        "`parameters` must be an object" in refusal(body={"inputs": "x", "parameters": 1}).message
    )
    assert "unknown field `prompt`" in refusal(body={"inputs": "x", "prompt": "y"}).message
    assert "`stream` must be a boolean" in refusal(None, {"inputs": "x", "stream": 1}).message
    # Streams: the prompt's details and best_of are refused, as TGI refuses them.
    streamed = refusal(True, decoder_input_details=True)
    assert "`decoder_input_details` == true is not supported when streaming" in streamed.message
    assert "not supported when streaming" in refusal(True, best_of=2).message


def test_tokenize_bodies() -> None:
    parsed = parse_tokenize(
        {"inputs": "a b", "parameters": {"truncate": 2}, "add_special_tokens": False},
        max_input_tokens=MAX_INPUT,
    )
    assert (parsed.inputs, parsed.truncate, parsed.add_special_tokens) == ("a b", 2, False)
    assert parse_tokenize({"inputs": "a"}, max_input_tokens=MAX_INPUT).add_special_tokens
    with pytest.raises(TGIError, match="`inputs` cannot be empty"):
        parse_tokenize({"inputs": ""}, max_input_tokens=MAX_INPUT)
