"""Tool calling, ``n`` choices and ``echo`` with logprobs on the OpenAI routes, driven by the
real ``openai`` client against one launched server (the embedded model, float32, a
Hermes-style chat template with tools), with the gRPC API and transformers as oracles:

* named and required tool choices give arguments valid for their schemas (``jsonschema``);
  ``auto`` reads the model's Hermes-format call (made by a guided regex, since the tiny
  random model would not call on its own); streamed deltas reassemble into the unary reply;
  tool turns go through the template as transformers renders them;
* ``n`` sampled choices equal gRPC generations seeded ``seed + j``;
* ``echo`` with ``logprobs`` (and ``max_tokens`` 0 or 1, lm-eval's loglikelihood requests)
  gives gRPC's input token details, and lm-eval's sums and greedy checks agree with
  transformers', the prompt given as text or as token ids.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import jsonschema
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.e2e.server import LauncherProcess, healthy_launcher
from tgis.embedded_model import MODEL_DIR
from tgis.pb import generation_pb2 as pb
from tgis.pb import generation_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow

MODEL = "tiny"
TEMPLATE = Path(__file__).parents[1] / "data" / "chat_templates" / "hermes_tools.jinja"
PROMPTS = ["Once upon a time", "The cat sat on the"]
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Rome", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
ALARM = {
    "type": "object",
    "properties": {"hour": {"type": "integer", "minimum": 0, "maximum": 23}},
    "required": ["hour"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "set_alarm", "parameters": ALARM}},
]
SCHEMAS = {"get_weather": WEATHER, "set_alarm": ALARM}
ASK: list[Any] = [{"role": "user", "content": "What is the weather in Rome this week?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LauncherProcess]:
    args = ["--dtype", "float32", "--served-model-name", MODEL, "--chat-template", str(TEMPLATE)]
    with healthy_launcher(tmp_path_factory.mktemp("openai-choices"), args) as launcher:
        yield launcher


@pytest.fixture(scope="module")
def client(server: LauncherProcess) -> openai.OpenAI:
    base = f"http://127.0.0.1:{server.http_port}/v1"
    return openai.OpenAI(base_url=base, api_key="none", max_retries=0, timeout=60)


def grpc_generate(server: LauncherProcess, texts: list[str], params: pb.Parameters) -> list[Any]:
    with grpc.insecure_channel(server.grpc_target) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        request = pb.BatchedGenerationRequest(
            requests=[pb.GenerationRequest(text=t) for t in texts], params=params
        )
        return list(stub.Generate(request, timeout=60).responses)


def streamed_message(stream: Any) -> tuple[dict[str, Any], str | None]:
    """The message a chat stream's deltas build (content and calls), and its finish."""
    content, calls, finish = "", {}, None
    for chunk in stream:
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for entry in choice.delta.tool_calls or []:
            call = calls.setdefault(entry.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = entry.id or call["id"]
            call["name"] += entry.function.name or ""
            call["arguments"] += entry.function.arguments or ""
        finish = choice.finish_reason or finish
    return {"content": content or None, "calls": [calls[i] for i in sorted(calls)]}, finish


def unary_message(message: Any) -> dict[str, Any]:
    calls = [
        {"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
        for c in message.tool_calls or []
    ]
    return {"content": message.content, "calls": calls}


def same_but_ids(a: dict[str, Any], b: dict[str, Any]) -> bool:
    strip = lambda m: [{**c, "id": None} for c in m["calls"]]  # noqa: E731
    return a["content"] == b["content"] and strip(a) == strip(b)


def chat(client: openai.OpenAI, **body: Any) -> Any:
    return client.chat.completions.create(model=MODEL, messages=ASK, temperature=0, **body)


def test_named_and_required_calls_fit_their_schemas(client: openai.OpenAI) -> None:
    named_choice = {"type": "function", "function": {"name": "get_weather"}}
    named = chat(client, tools=TOOLS, tool_choice=named_choice, max_tokens=60)
    [choice] = named.choices
    assert choice.finish_reason == "stop" and choice.message.content is None
    [call] = choice.message.tool_calls or []
    assert call.id.startswith("call_") and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    stream = chat(client, tools=TOOLS, tool_choice=named_choice, max_tokens=60, stream=True)
    message, finish = streamed_message(stream)
    assert same_but_ids(message, unary_message(choice.message)) and finish == "stop"
    for parallel in (False, True):
        required = chat(
            client, tools=TOOLS, tool_choice="required", parallel_tool_calls=parallel,
            max_tokens=200,
        )  # fmt: skip
        [choice] = required.choices
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        calls = choice.message.tool_calls or []
        assert len(calls) >= 1 and (parallel or len(calls) == 1)
        for call in calls:
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        assert len({c.id for c in calls}) == len(calls)
    stream = chat(client, tools=TOOLS, tool_choice="required", max_tokens=200, stream=True)
    message, finish = streamed_message(stream)
    assert same_but_ids(message, unary_message(choice.message)) and finish == "tool_calls"


HERMES_CALL = (
    r'<tool_call>\{"name": "get_weather", "arguments": '
    r'\{"city": "(Paris|Rome)", "days": [1-7]\}\}</tool_call>'
)


def test_auto_reads_the_models_hermes_calls(client: openai.OpenAI) -> None:
    """The model's own Hermes-format call (forced here by a regex) becomes a tool call."""
    extra = {"structured_outputs": {"regex": HERMES_CALL}}
    reply = chat(client, tools=TOOLS, max_tokens=60, extra_body=extra)
    [choice] = reply.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls or []
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    stream = chat(client, tools=TOOLS, max_tokens=60, extra_body=extra, stream=True)
    message, finish = streamed_message(stream)
    assert same_but_ids(message, unary_message(choice.message)) and finish == "tool_calls"
    # tool_choice none: the same output is text
    plain = chat(client, tools=TOOLS, tool_choice="none", max_tokens=60, extra_body=extra)
    assert plain.choices[0].message.tool_calls is None
    assert (plain.choices[0].message.content or "").startswith("<tool_call>")


def test_tool_turns_go_through_the_template_as_transformers_renders_them(
    client: openai.OpenAI,
) -> None:
    arguments = {"city": "Rome", "days": 3}
    messages: list[Any] = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": json.dumps(arguments)},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 24 C"},
    ]
    tokenizer = AutoTokenizer.from_pretrained(MODEL_DIR)
    theirs = [dict(m) for m in messages]
    theirs[1] = {**theirs[1], "tool_calls": [{**messages[1]["tool_calls"][0]}]}
    theirs[1]["tool_calls"][0]["function"] = {"name": "get_weather", "arguments": arguments}
    rendered = tokenizer.apply_chat_template(
        theirs, tools=TOOLS, chat_template=TEMPLATE.read_text(), add_generation_prompt=True,
        tokenize=False,
    )  # fmt: skip
    ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32).eval()
    out = model.generate(
        torch.tensor([ids]), max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    expected = tokenizer.decode(out[0, len(ids) :], skip_special_tokens=False)
    reply = client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, tool_choice="none", temperature=0,
        max_tokens=10, extra_body={"skip_special_tokens": False},
    )  # fmt: skip
    assert reply.usage is not None and reply.usage.prompt_tokens == len(ids)
    content = reply.choices[0].message.content or ""
    if reply.choices[0].finish_reason == "length":
        assert content == expected
    else:
        assert expected.startswith(content)


def test_n_sampled_choices_equal_seeded_generations(
    client: openai.OpenAI, server: LauncherProcess
) -> None:
    reply = client.completions.create(
        model=MODEL, prompt=PROMPTS, n=3, max_tokens=12, temperature=0.9, seed=42
    )
    assert [c.index for c in reply.choices] == list(range(6))
    for j in range(3):
        params = pb.Parameters(
            method=pb.SAMPLE,
            sampling=pb.SamplingParameters(temperature=0.9, seed=42 + j),
            stopping=pb.StoppingCriteria(max_new_tokens=12),
        )
        want = grpc_generate(server, PROMPTS, params)
        assert [reply.choices[p * 3 + j].text for p in range(2)] == [r.text for r in want]
    assert len({c.text for c in reply.choices[:3]}) > 1  # different seeds, different texts
    assert reply.usage is not None
    assert reply.usage.prompt_tokens == sum(r.input_token_count for r in want)  # once each
    texts = [""] * 6
    stream = client.completions.create(
        model=MODEL, prompt=PROMPTS, n=3, max_tokens=12, temperature=0.9, seed=42, stream=True
    )
    for chunk in stream:
        texts[chunk.choices[0].index] += chunk.choices[0].text
    assert texts == [c.text for c in reply.choices]
    greedy = chat(client, n=2, max_tokens=8)
    assert greedy.choices[0].message.content == greedy.choices[1].message.content


def test_echo_logprobs_equal_grpc_input_details(
    client: openai.OpenAI, server: LauncherProcess
) -> None:
    params = pb.Parameters(
        method=pb.GREEDY,
        stopping=pb.StoppingCriteria(max_new_tokens=1),
        response=pb.ResponseOptions(
            input_tokens=True, generated_tokens=True, token_logprobs=True, top_n_tokens=2
        ),
    )
    want = grpc_generate(server, PROMPTS, params)
    for max_tokens in (0, 1):
        reply = client.completions.create(
            model=MODEL, prompt=PROMPTS, echo=True, logprobs=2, max_tokens=max_tokens,
            temperature=0,
        )  # fmt: skip
        for choice, response in zip(reply.choices, want, strict=True):
            logprobs = choice.logprobs
            assert logprobs is not None and logprobs.token_logprobs is not None
            prompt = list(response.input_tokens)
            expected = [None] + [t.logprob for t in prompt[1:]]
            if max_tokens:
                expected += [t.logprob for t in response.tokens]
                assert choice.text == PROMPTS[choice.index] + response.text
            else:
                assert choice.text == PROMPTS[choice.index]
            assert logprobs.token_logprobs[0] is None and len(logprobs.token_logprobs) == len(
                expected
            )
            assert logprobs.token_logprobs[1:] == pytest.approx(expected[1:], abs=1e-5)
            assert logprobs.top_logprobs is not None and logprobs.top_logprobs[0] is None
            for top, token in zip(logprobs.top_logprobs[1:], prompt[1:], strict=False):
                alternatives = [t.logprob for t in token.top_tokens]
                assert all(min(abs(v - a) for a in alternatives) < 1e-5 for v in top.values())
            assert logprobs.text_offset is not None and logprobs.text_offset[0] == 0
        assert reply.usage is not None
        assert reply.usage.completion_tokens == len(PROMPTS) * max_tokens


def test_lm_eval_loglikelihood(client: openai.OpenAI, server: LauncherProcess) -> None:
    """lm-eval's request for loglikelihood(context, continuation): the whole text echoed
    with max_tokens 1 and logprobs 1; it sums token_logprobs[ctxlen:-1] and calls the
    continuation greedy when each of its tokens is its position's best alternative."""
    tokenizer = AutoTokenizer.from_pretrained(MODEL_DIR)
    context, continuation = "The cat sat on", " the mat"
    ctxlen = len(tokenizer(context)["input_ids"])  # with BOS, as the server encodes it
    reply = client.completions.create(
        model=MODEL, prompt=context + continuation, echo=True, logprobs=1, max_tokens=1,
        temperature=0,
    )  # fmt: skip
    logprobs = reply.choices[0].logprobs
    assert logprobs is not None and logprobs.token_logprobs and logprobs.top_logprobs
    got = sum(logprobs.token_logprobs[ctxlen:-1])  # type: ignore[arg-type]
    is_greedy = all(
        lp >= max(top.values()) - 1e-6
        for lp, top in zip(
            logprobs.token_logprobs[ctxlen:-1], logprobs.top_logprobs[ctxlen:-1], strict=True
        )
    )
    # the oracle: transformers' logits over the same ids
    ids = tokenizer(context + continuation)["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32).eval()
    with torch.no_grad():
        scores = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), dim=-1)
    rows = range(ctxlen, len(ids))
    expected = sum(float(scores[i - 1, ids[i]]) for i in rows)
    greedy = all(int(scores[i - 1].argmax()) == ids[i] for i in rows)
    assert math.isclose(got, expected, abs_tol=1e-4) and is_greedy == greedy
    # lm-eval's default (tokenized_requests): the same request with the prompt as token ids
    as_ids = client.completions.create(
        model=MODEL, prompt=ids, echo=True, logprobs=1, max_tokens=1, temperature=0
    )
    assert as_ids.choices[0].logprobs == logprobs
