"""Speculative decoding through the launcher: ``--speculate 4`` gives exactly what the same
server without it gives (greedy, seeded, penalties, min_new_tokens, stop sequences, token
details, batched and streamed, with a LoRA adapter), and greedy text equals transformers'
``generate(prompt_lookup_num_tokens=4)``. Drafts are accepted (the counters say so): the
embedded model (trained, tiny) repeats itself, which is what prompt lookup drafts from; a
random model's text does not.

Both servers run float32, so the oracle (the server without drafts) computes the same
numbers up to the order of sums in a wider batch.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM

from tests.e2e.models import greedy_new_tokens
from tests.e2e.probes import metric_sample
from tests.e2e.server import LauncherProcess, healthy_launcher
from tests.lora_oracle import save_random_lora
from tgis.embedded_model import MODEL_DIR
from tgis.pb import generation_pb2 as pb
from tgis.pb import generation_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow

SPECULATE = 4
NEW_TOKENS = 24
KV_BLOCKS = 40  # 640 tokens: sixteen long prompts at once preempt
PROMPTS = [
    "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return",
    "Return the number of items in the list",
    "the cat sat on the mat. the cat sat on the",
]


@pytest.fixture(scope="module")
def model() -> tuple[Path, Any]:
    twin = AutoModelForCausalLM.from_pretrained(MODEL_DIR, torch_dtype=torch.float32)
    return MODEL_DIR, twin.eval()


@pytest.fixture(scope="module")
def adapters(model: tuple[Path, Any], tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("spec-adapters")
    save_random_lora(model[0], root / "lora", seed=3, r=8, alpha=16)
    return root


def launch(
    model: tuple[Path, Any], adapters: Path, log_dir: Path, *flags: str
) -> Iterator[LauncherProcess]:
    args = ["--model-name", str(model[0]), "--dtype", "float32", "--max-sequence-length", "256"]
    env = {"ADAPTER_CACHE": str(adapters), "TGIS_KV_CACHE_BLOCKS": str(KV_BLOCKS)}
    with healthy_launcher(log_dir, [*args, *flags], env=env) as launcher:
        yield launcher


@pytest.fixture(scope="module")
def speculating(
    model: tuple[Path, Any], adapters: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LauncherProcess]:
    yield from launch(
        model, adapters, tmp_path_factory.mktemp("speculating"), "--speculate", str(SPECULATE)
    )


@pytest.fixture(scope="module")
def plain(
    model: tuple[Path, Any], adapters: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LauncherProcess]:
    yield from launch(model, adapters, tmp_path_factory.mktemp("plain"))


def stub_of(server: LauncherProcess) -> Iterator[pb_grpc.GenerationServiceStub]:
    with grpc.insecure_channel(server.grpc_target) as channel:
        yield pb_grpc.GenerationServiceStub(channel)


DETAILS = pb.ResponseOptions(
    generated_tokens=True, token_logprobs=True, token_ranks=True, top_n_tokens=2
)
PARAMETERS = {
    "greedy": pb.Parameters(
        method=pb.GREEDY,
        stopping=pb.StoppingCriteria(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS),
        response=DETAILS,
    ),
    "greedy-eos": pb.Parameters(
        method=pb.GREEDY, stopping=pb.StoppingCriteria(max_new_tokens=NEW_TOKENS)
    ),
    "seeded": pb.Parameters(
        method=pb.SAMPLE,
        sampling=pb.SamplingParameters(temperature=0.7, top_k=20, top_p=0.9, seed=7),
        stopping=pb.StoppingCriteria(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS),
        response=DETAILS,
    ),
    "penalties": pb.Parameters(
        method=pb.SAMPLE,
        sampling=pb.SamplingParameters(temperature=0.5, seed=3),
        stopping=pb.StoppingCriteria(max_new_tokens=NEW_TOKENS, min_new_tokens=10),
        decoding=pb.DecodingParameters(
            repetition_penalty=1.2,
            length_penalty=pb.DecodingParameters.LengthPenalty(start_index=4, decay_factor=1.3),
        ),
        response=DETAILS,
    ),
    "stop": pb.Parameters(
        method=pb.GREEDY,
        stopping=pb.StoppingCriteria(
            max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, stop_sequences=["a", "e"]
        ),
    ),
}


def generate(server: LauncherProcess, parameters: pb.Parameters, **fields: Any) -> list[Any]:
    request = pb.BatchedGenerationRequest(
        requests=[pb.GenerationRequest(text=t) for t in PROMPTS], params=parameters, **fields
    )
    for stub in stub_of(server):
        return list(stub.Generate(request, timeout=120).responses)
    raise AssertionError


def stream(server: LauncherProcess, text: str, parameters: pb.Parameters) -> list[Any]:
    request = pb.SingleGenerationRequest(request=pb.GenerationRequest(text=text), params=parameters)
    for stub in stub_of(server):
        return list(stub.GenerateStream(request, timeout=120))
    raise AssertionError


def outcome(response: Any) -> tuple[Any, ...]:
    return (
        response.text,
        response.generated_token_count,
        response.stop_reason,
        response.stop_sequence,
        [(t.text, t.rank) for t in response.tokens],
    )


def assert_same(got: list[Any], want: list[Any]) -> None:
    """Equal outcomes; logprobs within float noise (the batches differ), and the top-n
    alternatives equal but for a near tie, which that noise may order either way."""
    assert [outcome(r) for r in got] == [outcome(r) for r in want]
    for g, w in zip(got, want, strict=True):
        for a, b in zip(g.tokens, w.tokens, strict=True):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-3)
            assert len(a.top_tokens) == len(b.top_tokens)
            theirs = {t.text: t.logprob for t in b.top_tokens}
            for k, x in enumerate(a.top_tokens):
                if x.text in theirs:
                    assert x.logprob == pytest.approx(theirs[x.text], abs=1e-3)
                else:  # the last place, taken by the other of two tied tokens
                    assert k == len(a.top_tokens) - 1
                    assert x.logprob == pytest.approx(b.top_tokens[-1].logprob, abs=1e-3)


def accepted(server: LauncherProcess) -> float:
    return metric_sample(server, "tgi_spec_accepted_tokens") or 0.0


def drafted(server: LauncherProcess) -> float:
    return metric_sample(server, "tgi_spec_draft_tokens") or 0.0


@pytest.mark.parametrize("mode", sorted(PARAMETERS))
def test_batched_and_streamed_outputs_equal_plain_decoding(
    speculating: LauncherProcess, plain: LauncherProcess, mode: str
) -> None:
    parameters = PARAMETERS[mode]
    before = drafted(speculating), accepted(speculating)
    assert_same(generate(speculating, parameters), generate(plain, parameters))
    for text in PROMPTS:
        got, want = stream(speculating, text, parameters), stream(plain, text, parameters)
        if parameters.response.generated_tokens:  # one message per token, as TGIS sends
            assert len(got) == len(want)
        assert_same([fold(got)], [fold(want)])
    assert drafted(speculating) > before[0]
    if mode == "greedy":
        assert accepted(speculating) > before[1]
    assert drafted(plain) == 0


def fold(messages: list[Any]) -> Any:
    folded = pb.GenerationResponse()
    for message in messages:
        folded.text += message.text
        folded.tokens.extend(message.tokens)
        folded.generated_token_count = message.generated_token_count
        folded.stop_reason = message.stop_reason
        folded.stop_sequence = message.stop_sequence
    return folded


def test_with_a_lora_adapter(speculating: LauncherProcess, plain: LauncherProcess) -> None:
    parameters = PARAMETERS["greedy"]
    assert_same(
        generate(speculating, parameters, adapter_id="lora"),
        generate(plain, parameters, adapter_id="lora"),
    )


def assert_greedy_text_equals_transformers(
    server: LauncherProcess, model: tuple[Path, Any], **speculation: Any
) -> None:
    """Every prompt's greedy text from ``server`` equals transformers' ``generate`` with
    ``speculation`` (its own speculative decoding) on the same weights."""
    path, twin = model
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    parameters = pb.Parameters(
        method=pb.GREEDY,
        stopping=pb.StoppingCriteria(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS),
    )
    for text, response in zip(PROMPTS, generate(server, parameters), strict=True):
        ids = tokenizer.encode(text).ids
        new = greedy_new_tokens(twin, ids, NEW_TOKENS, **speculation)
        want = tokenizer.decode(new, skip_special_tokens=True)
        assert response.text == want.rstrip("\ufffd")


def test_greedy_text_equals_transformers_prompt_lookup(
    speculating: LauncherProcess, model: tuple[Path, Any]
) -> None:
    assert_greedy_text_equals_transformers(speculating, model, prompt_lookup_num_tokens=SPECULATE)


def test_the_counters_give_the_acceptance_rate(speculating: LauncherProcess) -> None:
    """Each greedy response of NEW_TOKENS tokens took NEW_TOKENS steps minus the drafts
    confirmed for it: the steps that carried drafts, the drafts and the confirmations add
    up."""
    steps = metric_sample(speculating, "tgi_spec_steps") or 0.0
    before = drafted(speculating), accepted(speculating)
    responses = generate(speculating, PARAMETERS["greedy"])
    assert all(r.generated_token_count == NEW_TOKENS for r in responses)
    new_steps = (metric_sample(speculating, "tgi_spec_steps") or 0.0) - steps
    new_drafted = drafted(speculating) - before[0]
    new_accepted = accepted(speculating) - before[1]
    assert 0 < new_accepted <= new_drafted <= SPECULATE * len(PROMPTS) * new_steps
    # The batch decoded NEW_TOKENS - 1 tokens each after its prompt step; every confirmed
    # draft saved one sequence-step.
    assert new_steps <= NEW_TOKENS - 1


def test_preemption_under_a_small_kv_budget(
    speculating: LauncherProcess, plain: LauncherProcess
) -> None:
    """Four prompts of about 200 tokens in one batch in 40 blocks, decoding past block
    boundaries with drafts reserved (few enough sequences for the policy to draft): some
    are preempted and resumed, and every output is the plain one."""
    prompts = [f"Question {i}: " + "say it again and again, " * (26 + i % 2) for i in range(4)]
    parameters = PARAMETERS["greedy"]
    preempted = metric_sample(speculating, "tgi_request_preemption_count") or 0.0
    before = drafted(speculating)
    request = pb.BatchedGenerationRequest(
        requests=[pb.GenerationRequest(text=t) for t in prompts], params=parameters
    )
    responses = []
    for server in (speculating, plain):
        for stub in stub_of(server):
            responses.append(list(stub.Generate(request, timeout=300).responses))
    assert_same(*responses)
    assert (metric_sample(speculating, "tgi_request_preemption_count") or 0.0) > preempted
    assert drafted(speculating) > before


# ---- a draft model (--speculator-name) ----------------------------------------------------------


@pytest.fixture(scope="module")
def drafting(
    model: tuple[Path, Any], adapters: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LauncherProcess]:
    """The embedded model drafting for itself: its greedy drafts are its own choices."""
    yield from launch(
        model, adapters, tmp_path_factory.mktemp("drafting"), "--speculator-name", str(MODEL_DIR)
    )


@pytest.mark.parametrize("mode", ["greedy", "seeded", "penalties"])
def test_a_draft_model_gives_the_plain_outputs(
    drafting: LauncherProcess, plain: LauncherProcess, mode: str
) -> None:
    parameters = PARAMETERS[mode]
    before = drafted(drafting), accepted(drafting)
    assert_same(generate(drafting, parameters), generate(plain, parameters))
    assert_same(
        [fold(stream(drafting, PROMPTS[0], parameters))],
        [fold(stream(plain, PROMPTS[0], parameters))],
    )
    new_drafted, new_accepted = drafted(drafting) - before[0], accepted(drafting) - before[1]
    assert new_drafted > 0
    if mode == "greedy":  # the model's own greedy choices: (nearly) all confirmed
        assert new_accepted >= 0.9 * new_drafted


def test_draft_model_greedy_text_equals_transformers_assisted_generation(
    drafting: LauncherProcess, model: tuple[Path, Any]
) -> None:
    assert_greedy_text_equals_transformers(drafting, model, assistant_model=model[1])
