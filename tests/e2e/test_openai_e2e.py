"""The OpenAI routes on the HTTP port, driven by the real ``openai`` client against a launched
server (the embedded model, float32), with the gRPC API of the same server as the oracle:
greedy text, token counts, stop sequences, seeded sampling and logprobs equal Generate's;
streamed deltas concatenate to the unary text; chat renders the Llama 3 template as
transformers' ``apply_chat_template`` does (no second BOS) and generates transformers'
greedy continuation; every refusal has OpenAI's status and body; a client that leaves a
stream frees its permits at once.
"""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessor, LogitsProcessorList

from tests.e2e.server import LauncherProcess, healthy_launcher
from tgis.embedded_model import MODEL_DIR
from tgis.pb import generation_pb2 as pb
from tgis.pb import generation_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow

MODEL = "tiny"
KEY = "sesame"
TEMPLATE = Path(__file__).parents[1] / "data" / "chat_templates" / "llama3_instruct.jinja"
PROMPTS = ["Once upon a time", "The cat sat on the"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LauncherProcess]:
    args = [
        "--dtype", "float32", "--served-model-name", MODEL, "--chat-template", str(TEMPLATE),
        "--api-key", KEY, "--max-concurrent-requests", "2",
    ]  # fmt: skip
    with healthy_launcher(tmp_path_factory.mktemp("openai"), args) as launcher:
        yield launcher


@pytest.fixture(scope="module")
def client(server: LauncherProcess) -> openai.OpenAI:
    base = f"http://127.0.0.1:{server.http_port}/v1"
    return openai.OpenAI(base_url=base, api_key=KEY, max_retries=0, timeout=60)


def grpc_generate(server: LauncherProcess, texts: list[str], params: pb.Parameters) -> list[Any]:
    with grpc.insecure_channel(server.grpc_target) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        request = pb.BatchedGenerationRequest(
            requests=[pb.GenerationRequest(text=t) for t in texts], params=params
        )
        return list(stub.Generate(request, timeout=60).responses)


def greedy(max_new_tokens: int, **stopping: Any) -> pb.Parameters:
    return pb.Parameters(
        method=pb.GREEDY,
        stopping=pb.StoppingCriteria(max_new_tokens=max_new_tokens, **stopping),
    )


def test_models_lists_the_served_name(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_greedy_completions_equal_generate(client: openai.OpenAI, server: LauncherProcess) -> None:
    got = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=24, temperature=0)
    want = grpc_generate(server, PROMPTS, greedy(24))
    assert [c.text for c in got.choices] == [r.text for r in want]
    assert [c.index for c in got.choices] == [0, 1]
    reasons = {pb.StopReason.MAX_TOKENS: "length", pb.StopReason.EOS_TOKEN: "stop"}
    assert [c.finish_reason for c in got.choices] == [reasons[r.stop_reason] for r in want]
    assert got.usage is not None
    assert got.usage.prompt_tokens == sum(r.input_token_count for r in want)
    assert got.usage.completion_tokens == sum(r.generated_token_count for r in want)
    # Streamed, interleaved by index: the same texts, and the usage chunk last.
    texts = ["", ""]
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=PROMPTS, max_tokens=24, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    for chunk in chunks[:-1]:
        texts[chunk.choices[0].index] += chunk.choices[0].text
    assert texts == [r.text for r in want]
    assert chunks[-1].choices == [] and chunks[-1].usage == got.usage


def test_stop_seed_and_logprobs_equal_generate(
    client: openai.OpenAI, server: LauncherProcess
) -> None:
    stopped = client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=30, temperature=0, stop=[" the"]
    )
    # OpenAI leaves the stop text out; the launcher's gRPC default (TGIS's) keeps it.
    oracle = greedy(30, stop_sequences=[" the"], include_stop_sequence=False)
    want = grpc_generate(server, PROMPTS[:1], oracle)[0]
    assert want.stop_reason == pb.StopReason.STOP_SEQUENCE
    assert stopped.choices[0].text == want.text and stopped.choices[0].finish_reason == "stop"
    sampled = [
        client.completions.create(
            model=MODEL, prompt=PROMPTS[0], max_tokens=16, temperature=0.8, top_p=0.9, seed=42,
            logprobs=2,
        ).choices[0]
        for _ in range(2)
    ]  # fmt: skip
    assert sampled[0].text == sampled[1].text
    params = pb.Parameters(
        method=pb.SAMPLE,
        sampling=pb.SamplingParameters(temperature=0.8, top_p=0.9, seed=42),
        stopping=pb.StoppingCriteria(max_new_tokens=16),
        response=pb.ResponseOptions(generated_tokens=True, token_logprobs=True, top_n_tokens=2),
    )
    want = grpc_generate(server, PROMPTS[:1], params)[0]
    assert sampled[0].text == want.text
    logprobs = sampled[0].logprobs
    assert logprobs is not None and logprobs.token_logprobs is not None
    assert logprobs.token_logprobs == pytest.approx([t.logprob for t in want.tokens], abs=1e-5)
    assert logprobs.top_logprobs is not None
    # A dict by token text: two alternatives that decode alike share one entry.
    for top, token in zip(logprobs.top_logprobs, want.tokens, strict=True):
        alternatives = [t.logprob for t in token.top_tokens]
        assert 1 <= len(top) <= 2
        assert all(min(abs(v - a) for a in alternatives) < 1e-5 for v in top.values())


def test_chat_renders_the_template_as_transformers_does(
    client: openai.OpenAI, server: LauncherProcess
) -> None:
    messages = [
        {"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": "Tell me a story about a cat."},
    ]
    tokenizer = AutoTokenizer.from_pretrained(MODEL_DIR)
    rendered = tokenizer.apply_chat_template(
        messages, chat_template=TEMPLATE.read_text(), add_generation_prompt=True, tokenize=False
    )
    ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
    assert ids.count(tokenizer.bos_token_id) == 1  # the template's own BOS
    model = AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32).eval()
    out = model.generate(
        torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    expected = tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True)
    got = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_completion_tokens=12,
        temperature=0,  # type: ignore[arg-type]
    )
    assert got.usage is not None and got.usage.prompt_tokens == len(ids)  # one BOS, not two
    content = got.choices[0].message.content or ""
    assert got.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=12,
        temperature=0,
        stream=True,  # type: ignore[arg-type]
    )
    deltas = [c.choices[0].delta for c in stream]
    assert deltas[0].role == "assistant"
    assert "".join(d.content or "" for d in deltas) == content
    if got.choices[0].finish_reason == "length":
        assert content == expected
    else:  # stopped at EOS: transformers (no EOS) goes on past it
        assert expected.startswith(content)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"n": 129}, "n"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"extra_body": {"guided_whatever": 1}}, "guided_whatever"),
        ({"logit_bias": {"5": 1000}}, "logit_bias"),
        ({"temperature": 0.01}, None),  # TGIS's own rule, its message
    ],
)
def test_unsupported_fields_are_refused_with_400(
    client: openai.OpenAI, extra: dict[str, Any], param: str | None
) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, **extra)
    body = refused.value.body
    assert isinstance(body, dict) and body["type"] == "invalid_request_error"
    assert body["param"] == param and body["message"]


def test_model_key_and_limits_are_refused_in_openai_shape(
    client: openai.OpenAI, server: LauncherProcess
) -> None:
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="other", prompt="x", max_tokens=2)
    assert missing.value.body["code"] == "model_not_found"  # type: ignore[index]
    wrong = openai.OpenAI(base_url=client.base_url, api_key="guess", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    with pytest.raises(openai.BadRequestError, match="max_new_tokens must be <="):
        client.completions.create(model=MODEL, prompt="x", max_tokens=100000)
    request = urllib.request.Request(
        f"http://127.0.0.1:{server.http_port}/v1/completions",
        data=b"{not json",
        headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as bad_json:
        urllib.request.urlopen(request, timeout=30)
    assert bad_json.value.code == 400
    assert "not valid JSON" in json.loads(bad_json.value.read())["error"]["message"]
    # A body that names no model is for the served one (vLLM's leniency).
    unnamed = urllib.request.Request(
        f"http://127.0.0.1:{server.http_port}/v1/completions",
        data=json.dumps({"prompt": PROMPTS[0], "max_tokens": 2}).encode(),
        headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(unnamed, timeout=30) as reply:
        body = json.loads(reply.read())
    assert body["model"] == MODEL and body["usage"]["completion_tokens"] <= 2


def test_permits_give_429_and_a_closed_stream_frees_them(
    client: openai.OpenAI, server: LauncherProcess
) -> None:
    """Two prompts streaming hold both permits: a third request gets 429; closing the
    stream gives them back at once, and the requests leave the batch."""
    before = requests_counted(server)
    stream = client.completions.create(
        model=MODEL, prompt=PROMPTS, max_tokens=500, temperature=0, stream=True,
        extra_body={"min_tokens": 500},
    )  # fmt: skip
    next(iter(stream))
    with pytest.raises(openai.RateLimitError):
        client.completions.create(model=MODEL, prompt="x", max_tokens=2)
    stream.close()
    deadline = time.monotonic() + 10
    while True:
        try:
            done = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=2)
            break
        except openai.RateLimitError:
            assert time.monotonic() < deadline, "the closed stream kept its permits"
            time.sleep(0.05)
    assert len(done.choices) == 2
    # Three calls at least (the stream, the 429, the last one): the tgi_* series count them.
    assert requests_counted(server) >= before + 3


def requests_counted(server: LauncherProcess) -> float:
    """``tgi_request_count`` summed over its ``kind`` labels."""
    _, body = server.http_get("/metrics")
    lines = body.decode().splitlines()
    return sum(float(x.split()[-1]) for x in lines if x.startswith("tgi_request_count{"))


@pytest.mark.parametrize(
    "message",
    [
        {"role": "user", "content": None},
        {"role": "user"},
        {"role": "system", "content": None},
        {"role": "user", "content": 3},
        {"role": "user", "content": [{"type": "text", "text": None}]},
    ],
    ids=["user-null", "user-absent", "system-null", "number", "part-text-null"],
)
def test_odd_message_contents_are_bad_requests(client: openai.OpenAI, message: Any) -> None:
    """As OpenAI and vLLM answer them (content null was rendered as the text "None")."""
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, messages=[message], max_tokens=4)
    error = refused.value.body
    assert isinstance(error, dict) and error["param"] == "messages"
    assert "content" in error["message"]


def test_an_assistant_message_may_have_null_content(client: openai.OpenAI) -> None:
    """OpenAI allows it (an assistant turn that called tools); it renders as empty text,
    which the reply's prompt token count shows."""
    turns: list[Any] = [{"role": "user", "content": "hi"}, {"role": "user", "content": "and?"}]
    with_null = [turns[0], {"role": "assistant", "content": None}, turns[1]]
    with_empty = [turns[0], {"role": "assistant", "content": ""}, turns[1]]
    replies = [
        client.chat.completions.create(model=MODEL, messages=m, max_tokens=3, temperature=0)
        for m in (with_null, with_empty)
    ]
    usages = [r.usage for r in replies]
    assert usages[0] is not None and usages[1] is not None
    assert usages[0].prompt_tokens == usages[1].prompt_tokens
    assert replies[0].choices[0].message.content == replies[1].choices[0].message.content


def test_a_complete_schema_ends_the_chat_reply_before_min_tokens(client: openai.OpenAI) -> None:
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "t", "schema": {"enum": ["x</s>y"]}}}
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        response_format=fmt,
        extra_body={"min_tokens": 20},
        max_tokens=30,
    )
    assert reply.choices[0].message.content == '"x</s>y"'
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage is not None and reply.usage.completion_tokens < 20


class OpenAIPenalties(LogitsProcessor):
    """OpenAI's presence/frequency penalties and logit bias, for transformers' generate():
    the test's own reference, over the tokens generated after ``prompt_len``."""

    def __init__(self, prompt_len: int, presence: float, frequency: float, bias: dict[int, float]):
        self.prompt_len, self.presence, self.frequency, self.bias = (
            prompt_len, presence, frequency, bias,
        )  # fmt: skip

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        scores = scores.clone()
        for row, ids in enumerate(input_ids.tolist()):
            for token in set(ids[self.prompt_len :]):
                count = ids[self.prompt_len :].count(token)
                scores[row, token] -= self.presence + self.frequency * count
            for token, value in self.bias.items():
                scores[row, token] += value
        return scores  # type: ignore[return-value]


def test_penalties_and_logit_bias_equal_a_reference_generate(client: openai.OpenAI) -> None:
    tokenizer = AutoTokenizer.from_pretrained(MODEL_DIR)
    model = AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32).eval()
    ids = tokenizer(PROMPTS[0])["input_ids"]
    plain = model.generate(torch.tensor([ids]), max_new_tokens=1, do_sample=False, pad_token_id=0)
    first = int(plain[0, len(ids)])
    cases = [
        (0.0, 1.5, {}),
        (1.0, 0.5, {first: -100.0}),
        (-0.5, 0.0, {first: -100.0, 300: 3.0}),
    ]
    for presence, frequency, bias in cases:
        processor = OpenAIPenalties(len(ids), presence, frequency, bias)
        out = model.generate(
            torch.tensor([ids]), max_new_tokens=16, do_sample=False, pad_token_id=0,
            logits_processor=LogitsProcessorList([processor]),
        )  # fmt: skip
        expected = tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True)
        got = client.completions.create(
            model=MODEL, prompt=PROMPTS[0], max_tokens=16, temperature=0,
            presence_penalty=presence, frequency_penalty=frequency,
            logit_bias={str(t): v for t, v in bias.items()},
        )  # fmt: skip
        assert got.choices[0].text == expected, (presence, frequency, bias)


def test_vllm_fields_benchmark_tools_and_agents_send(
    client: openai.OpenAI, server: LauncherProcess
) -> None:
    # ignore_eos (guidellm, vLLM's benchmark_serving): exactly max_tokens
    long = client.completions.create(
        model=MODEL, prompt=PROMPTS[1], max_tokens=40, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert long.usage is not None and long.usage.completion_tokens == 40
    assert long.choices[0].finish_reason == "length"
    # stop_token_ids: the output ends at the first such token, its text kept
    want = grpc_generate(server, PROMPTS[:1], greedy(20))[0]
    tokenizer = AutoTokenizer.from_pretrained(MODEL_DIR)
    generated = tokenizer(want.text, add_special_tokens=False)["input_ids"]
    stop_id = generated[3]
    stopped = client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=20, temperature=0,
        extra_body={"stop_token_ids": [stop_id]},
    )  # fmt: skip
    assert stopped.choices[0].finish_reason == "stop"
    cut = generated[: generated.index(stop_id) + 1]
    assert stopped.choices[0].text == tokenizer.decode(cut)
    # min_p 1 keeps only the most likely token: sampling becomes greedy
    sampled = client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=20, temperature=1.0, seed=3,
        extra_body={"min_p": 1.0},
    )  # fmt: skip
    assert sampled.choices[0].text == want.text
    # guided decoding by vLLM's fields, and "model": "" meaning the served model
    choice = client.completions.create(
        model="", prompt=PROMPTS[0], max_tokens=8, extra_body={"guided_choice": ["yes", "no"]}
    )
    assert choice.choices[0].text in ("yes", "no")
    regex = client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=8,
        extra_body={"structured_outputs": {"regex": "[0-9]{3}"}},
    )  # fmt: skip
    assert re.fullmatch("[0-9]{3}", regex.choices[0].text)


def test_top_p_zero_is_refused_with_a_clear_message(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=MODEL, prompt="x", top_p=0, temperature=1)
    assert "top_p must be greater than 0" in str(refused.value)
