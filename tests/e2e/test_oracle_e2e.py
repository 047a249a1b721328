"""Greedy output of the real launcher, router and shard equals transformers' `generate`.

The model is a tiny random float32 Llama (``save_tiny_llama``); the oracle is its
transformers twin, run on each prompt alone (no padding), greedy, with ``min_new_tokens =
max_new_tokens`` on both sides so that neither stops early (the server then masks EOS, as
transformers' ``MinNewTokensLengthLogitsProcessor`` does). The server sees the prompts
together: batches of inputs of very different lengths (2 to about 100 tokens with the BOS),
concurrent streams that join and leave the running batch at different steps, and a batch
beside the streams. Compared per request:

* the tokens, as raw vocabulary strings of the ``generated_tokens`` details (the API has no
  token ids; byte-level BPE strings are one to one with ids);
* the text, against the twin's ids decoded by the same tokenizer with
  ``skip_special_tokens=True`` (less a trailing incomplete UTF-8 character, which TGIS
  drops: a random model often ends on a lone lead byte);
* the input and generated token counts and the stop reason.

The other oracle tests (prefixes, adapters) send one short prompt at a time; this module
covers what they do not: mixed lengths in one batch, concurrent streams of different
lengths, several ``max_new_tokens``.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer

from tests.e2e.models import PAD_TOKEN_ID, greedy_new_tokens, save_tiny_llama
from tests.e2e.server import LauncherProcess, healthy_launcher
from tgis.pb import generation_pb2 as pb
from tgis.pb import generation_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow

EOS_TOKEN_ID = 2
MAX_SEQUENCE_LENGTH = 256
# Very different lengths: 2 tokens (BOS and one), a few, tens, about 100.
PROMPTS = (
    "A",
    "Hi there",
    "Return the number of items in the list",
    "Write a function that reads a file, counts the words in every line and returns "
    "the ten most common words with their counts, sorted by count",
    " ".join(
        f"Step {i}: open the next file, parse its header and append the rows to the table."
        for i in range(1, 6)
    ),
)


@dataclass(frozen=True)
class Expected:
    """The twin's greedy continuation of one prompt."""

    input_tokens: int
    tokens: list[str | None]  # raw vocabulary strings
    text: str


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    path = tmp_path_factory.mktemp("oracle-llama")
    return path, save_tiny_llama(path)


@pytest.fixture(scope="module")
def server(
    model: tuple[Path, Any], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LauncherProcess]:
    with healthy_launcher(
        tmp_path_factory.mktemp("oracle-e2e"),
        ["--model-name", str(model[0]), "--max-sequence-length", str(MAX_SEQUENCE_LENGTH)],
    ) as launcher:
        yield launcher


@pytest.fixture(scope="module")
def oracle(model: tuple[Path, Any]) -> Any:
    """``oracle(text, new_tokens)``: the twin's greedy continuation (cached)."""
    path, twin = model
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))

    @cache
    def expected(text: str, new_tokens: int) -> Expected:
        ids = tokenizer.encode(text).ids
        new = greedy_new_tokens(
            twin, ids, new_tokens, eos_token_id=EOS_TOKEN_ID, pad_token_id=PAD_TOKEN_ID
        )
        assert len(new) == new_tokens
        return Expected(
            len(ids),
            [tokenizer.id_to_token(i) for i in new],
            # TGIS drops an incomplete final UTF-8 character (a byte-level token that starts
            # a multi-byte character as the last token): trailing U+FFFD trimmed.
            tokenizer.decode(new, skip_special_tokens=True).rstrip("\ufffd"),
        )

    return expected


def test_prompts_span_one_to_a_hundred_tokens(oracle: Any) -> None:
    lengths = sorted(oracle(text, 1).input_tokens for text in PROMPTS)
    assert lengths[0] == 2 and lengths[-1] >= 90, lengths


def params(new_tokens: int) -> pb.Parameters:
    return pb.Parameters(
        method=pb.GREEDY,
        stopping=pb.StoppingCriteria(max_new_tokens=new_tokens, min_new_tokens=new_tokens),
        response=pb.ResponseOptions(generated_tokens=True),
    )


def check(got: Any, want: Expected, new_tokens: int, label: str) -> None:
    """One response (or a stream's messages merged) against its oracle."""
    assert [t.text for t in got.tokens] == want.tokens, label
    assert got.text == want.text, label
    assert got.input_token_count == want.input_tokens, label
    assert got.generated_token_count == new_tokens, label
    assert got.stop_reason == pb.MAX_TOKENS, label


def generate_batch(
    stub: pb_grpc.GenerationServiceStub, texts: list[str], new_tokens: int
) -> list[Any]:
    request = pb.BatchedGenerationRequest(
        requests=[pb.GenerationRequest(text=t) for t in texts], params=params(new_tokens)
    )
    return list(stub.Generate(request, timeout=300).responses)


def generate_stream(stub: pb_grpc.GenerationServiceStub, text: str, new_tokens: int) -> Any:
    """A stream's messages merged into one GenerationResponse."""
    request = pb.SingleGenerationRequest(
        request=pb.GenerationRequest(text=text), params=params(new_tokens)
    )
    merged = pb.GenerationResponse()
    for message in stub.GenerateStream(request, timeout=300):
        merged.input_token_count = merged.input_token_count or message.input_token_count
        merged.generated_token_count = message.generated_token_count
        merged.text += message.text
        merged.tokens.extend(message.tokens)
        merged.stop_reason = message.stop_reason
    return merged


@pytest.mark.parametrize("new_tokens", [1, 7, 40])
def test_one_batch_of_very_different_lengths(
    stub: pb_grpc.GenerationServiceStub, oracle: Any, new_tokens: int
) -> None:
    """The five prompts in one Generate call, shortest and longest mixed: each equals the
    twin's continuation of that prompt alone."""
    texts = [PROMPTS[i] for i in (2, 0, 4, 1, 3)]
    responses = generate_batch(stub, texts, new_tokens)
    assert len(responses) == len(texts)
    for text, got in zip(texts, responses, strict=True):
        check(got, oracle(text, new_tokens), new_tokens, text[:30])


def test_concurrent_streams_of_different_lengths_and_a_batch(
    stub: pb_grpc.GenerationServiceStub, oracle: Any
) -> None:
    """Ten streams (every prompt, each with two output lengths) and a batch Generate, all
    in flight at once: requests join the running batch at different steps and leave it at
    different steps, and each still equals its lone oracle."""
    streams = [(text, n) for i, text in enumerate(PROMPTS) for n in (3 + 5 * i, 48 - 7 * i)]
    batch_texts, batch_tokens = [PROMPTS[4], PROMPTS[0], PROMPTS[3]], 25
    with ThreadPoolExecutor(len(streams) + 1) as pool:
        batch = pool.submit(generate_batch, stub, batch_texts, batch_tokens)
        results = list(pool.map(lambda s: generate_stream(stub, *s), streams))
        batch_responses = batch.result()
    for (text, n), got in zip(streams, results, strict=True):
        check(got, oracle(text, n), n, f"stream {text[:30]!r} x{n}")
    for text, got in zip(batch_texts, batch_responses, strict=True):
        check(got, oracle(text, batch_tokens), batch_tokens, f"batch {text[:30]!r}")
