"""The embedded model ships a chat template (issue 34), so ``make run`` serves
``/v1/chat/completions``: the reply is what gRPC's Generate gives for the prompt as
transformers' ``apply_chat_template`` renders it. A model without a template still gets the
400 that says how to give one, and its completions still work."""

from __future__ import annotations

import json
import os
import shutil
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from transformers import AutoTokenizer

from tests.e2e.server import LauncherProcess, healthy_launcher
from tgis.embedded_model import MODEL_DIR
from tgis.pb import generation_pb2 as pb
from tgis.pb import generation_pb2_grpc as pb_grpc

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        bool(os.environ.get("TGIS_E2E_MODEL")), reason="checks the embedded model's template"
    ),
]

NO_TEMPLATE = (
    "this model has no chat template: give one with --chat-template (a file or the template "
    "itself), or put chat_template.jinja in the model directory; /v1/completions works "
    "without one"
)


def post(server: LauncherProcess, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    request = urllib.request.Request(
        server.http_base + path,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def generate(server: LauncherProcess, text: str, tokens: int) -> Any:
    with grpc.insecure_channel(server.grpc_target) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        params = pb.Parameters(
            method=pb.GREEDY, stopping=pb.StoppingCriteria(max_new_tokens=tokens)
        )
        request = pb.BatchedGenerationRequest(
            requests=[pb.GenerationRequest(text=text)], params=params
        )
        return stub.Generate(request, timeout=60).responses[0]


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "user", "content": "Say hello"}],
        [
            {"role": "system", "content": "You explain Python."},
            {"role": "user", "content": "What does sorted return?"},
            {"role": "assistant", "content": "A new list."},
            {"role": "user", "content": "And reversed?"},
        ],
    ],
)
def test_chat_on_the_embedded_model(
    embedded_server: LauncherProcess, messages: list[dict[str, str]]
) -> None:
    """No model named, no --chat-template: the README's chat request is served, and its
    greedy reply is Generate's for the prompt transformers renders (whose BOS the template
    writes: gRPC adds its own, so it is given the text after it)."""
    status, body = post(
        embedded_server,
        "/v1/chat/completions",
        {"messages": messages, "max_tokens": 12, "temperature": 0},
    )
    assert status == 200, body
    prompt = AutoTokenizer.from_pretrained(MODEL_DIR).apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert prompt.startswith("<s>[INST] ")
    want = generate(embedded_server, prompt.removeprefix("<s>"), 12)
    (choice,) = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": want.text}
    assert body["usage"]["prompt_tokens"] == want.input_token_count
    assert body["usage"]["completion_tokens"] == want.generated_token_count


@pytest.fixture(scope="module")
def without_template(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LauncherProcess]:
    """The embedded model's files but its chat template, served as a named model."""
    model = tmp_path_factory.mktemp("no-template") / "model"
    shutil.copytree(MODEL_DIR, model, ignore=shutil.ignore_patterns("chat_template.jinja"))
    log_dir = tmp_path_factory.mktemp("no-template-logs")
    with healthy_launcher(log_dir, ["--model-name", str(model)]) as launcher:
        yield launcher


def test_a_model_without_a_template_says_how_to_give_one(
    without_template: LauncherProcess,
) -> None:
    chat = {"messages": [{"role": "user", "content": "Say hello"}], "max_tokens": 4}
    status, body = post(without_template, "/v1/chat/completions", chat)
    assert status == 400
    assert body["error"]["message"] == NO_TEMPLATE
    assert body["error"]["param"] == "messages"
    status, body = post(without_template, "/v1/completions", {"prompt": "Hi", "max_tokens": 4})
    assert status == 200 and body["choices"][0]["text"]
