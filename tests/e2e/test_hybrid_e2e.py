"""Granite 4.0 hybrid (Mamba-2 and attention layers, experts) served by the real launcher,
router and shard: with 2 state slots (``--max-batch-size 2``) a batch of 3 prompts of
different lengths runs 2 at a time, the third waiting for a slot (not failing), and each
output is transformers' greedy continuation of its prompt alone."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from tokenizers import Tokenizer

from tests.e2e.models import PAD_TOKEN_ID, TOKENIZER_FILES, greedy_new_tokens
from tests.e2e.server import LauncherProcess, healthy_launcher
from tests.shard.families import FAMILIES
from tests.shard.families import _randomise as randomise
from tgis.embedded_model import MODEL_DIR as EMBEDDED_MODEL_DIR
from tgis.pb import generation_pb2 as pb
from tgis.pb import generation_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow

NEW_TOKENS = 8
PROMPTS = ("A", "Return the number of items in the list", "Hi there, how are you today?")


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """The family's tiny model with the embedded tokenizer's vocabulary."""
    path = tmp_path_factory.mktemp("granite-hybrid")
    params = dict(FAMILIES["granite-hybrid"].params, pad_token_id=PAD_TOKEN_ID)
    config = transformers.GraniteMoeHybridConfig(
        vocab_size=4096, bos_token_id=1, eos_token_id=2, **params
    )
    torch.manual_seed(0)
    hf = transformers.GraniteMoeHybridForCausalLM(config).eval()
    randomise(hf)
    hf.save_pretrained(path)
    for name in TOKENIZER_FILES:
        shutil.copy(EMBEDDED_MODEL_DIR / name, path / name)
    return path, hf


@pytest.fixture(scope="module")
def server(
    model: tuple[Path, Any], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LauncherProcess]:
    args = ["--model-name", str(model[0]), "--max-sequence-length", "256"]
    with healthy_launcher(
        tmp_path_factory.mktemp("hybrid-e2e"), [*args, "--max-batch-size", "2"]
    ) as launcher:
        yield launcher


def test_three_prompts_on_two_state_slots_match_transformers(
    model: tuple[Path, Any], stub: pb_grpc.GenerationServiceStub
) -> None:
    path, hf = model
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    request = pb.BatchedGenerationRequest(
        requests=[pb.GenerationRequest(text=text) for text in PROMPTS],
        params=pb.Parameters(
            method=pb.GREEDY,
            stopping=pb.StoppingCriteria(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS),
            response=pb.ResponseOptions(generated_tokens=True),
        ),
    )
    responses = stub.Generate(request, timeout=300)
    for text, got in zip(PROMPTS, responses.responses, strict=True):
        ids = tokenizer.encode(text).ids
        new = greedy_new_tokens(hf, ids, NEW_TOKENS, eos_token_id=2, pad_token_id=PAD_TOKEN_ID)
        assert [t.text for t in got.tokens] == [tokenizer.id_to_token(i) for i in new], text
        assert got.generated_token_count == NEW_TOKENS
