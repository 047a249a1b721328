"""Each newer model family served natively by the real launcher, router and shard, as a
user first meets it: a tiny random checkpoint with a tokenizer, ``TGIS_ENGINE=native`` and
otherwise the launcher's defaults (no ``--max-sequence-length``, ``--max-batch-size`` or
``--dtype``), so that what the defaults derive from the config (the sequence length, the
KV cache, the dtype) is exercised. A batched Generate of two prompts of different lengths
(the longer one past the families' 8-key windows), greedy, must give transformers' greedy
tokens for each prompt alone, and the log must say the native engine served it.

One variant per architecture (the shard-level oracle tests, tests/shard/native/models/
test_families.py, cover every variant in-process); Granite 4.0 hybrid has its own module
(test_hybrid_e2e.py). The checkpoints keep their published context lengths (131072 for
Mistral, Mixtral, Gemma 3 and gpt-oss; Phi-3-mini-128k's LongRoPE, whose default stops at
its 4096 original positions), which is what the default --max-sequence-length comes from.
About 4 s a family on two cores, most of it the launcher's start (3 s) and stop.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
import transformers
from tokenizers import Tokenizer

from tests.e2e.models import PAD_TOKEN_ID, TOKENIZER_FILES, greedy_new_tokens
from tests.e2e.server import ISOLATED_ENV
from tests.shard.families import FAMILIES
from tests.shard.families import _randomise as randomise
from tgis.embedded_model import MODEL_DIR as EMBEDDED_MODEL_DIR
from tgis.launcher.local_process import serving, start_launcher
from tgis.pb import generation_pb2 as pb
from tgis.pb import generation_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow

NEW_TOKENS = 8
PROMPTS = ("Hi there", "Return the number of items in the list, sorted by their size")
VARIANTS = (
    "qwen3",
    "olmo2",
    "phi3-longrope",
    "starcoder2-window",
    "mistral-window",
    "mixtral",
    "qwen2-moe",
    "qwen3-moe",
    "granite-moe",
    "gemma2",
    "gemma3",
    "gemma3-conditional",
    "gpt-oss",
)
# Gemma 3's vision-language checkpoint: the ``gemma3`` text model under a tiny vision tower.
TINY_VISION: dict[str, Any] = dict(
    hidden_size=32,
    intermediate_size=32,
    num_hidden_layers=1,
    num_attention_heads=2,
    image_size=28,
    patch_size=14,
)
_TOKENS: dict[str, Any] = dict(
    vocab_size=4096, bos_token_id=1, eos_token_id=2, pad_token_id=PAD_TOKEN_ID
)
# The published context lengths, not the tiny families' 512, so that the launcher's default
# --max-sequence-length is what a user gets: each config class's default (Mistral, Mixtral,
# Gemma 3 and gpt-oss 131072, Qwen3 32768, ...), and Phi-3-mini-128k's LongRoPE.
_CONTEXT: dict[str, dict[str, Any]] = {
    "phi3-longrope": dict(max_position_embeddings=131_072, original_max_position_embeddings=4096)
}


def _params(variant: str) -> dict[str, Any]:
    params = {k: v for k, v in FAMILIES[variant].params.items() if k != "max_position_embeddings"}
    return dict(params, **_CONTEXT.get(variant, {}), **_TOKENS)


def build(variant: str, path: Path) -> Any:
    """Save the variant's tiny random model with the embedded model's tokenizer (its
    vocabulary of 4096) to ``path``; return its transformers twin."""
    if variant == "gemma3-conditional":
        config: Any = transformers.Gemma3Config(
            text_config=_params("gemma3"),
            vision_config=TINY_VISION,
            mm_tokens_per_image=4,
            eos_token_id=2,
            tie_word_embeddings=False,
        )
        model_class: Any = transformers.Gemma3ForConditionalGeneration
    else:
        family = FAMILIES[variant]
        config = getattr(transformers, family.config_class)(**_params(variant))
        model_class = getattr(transformers, family.model_class)
    torch.manual_seed(0)
    model = model_class(config).eval()
    randomise(model)
    model.save_pretrained(path)
    for name in TOKENIZER_FILES:
        shutil.copy(EMBEDDED_MODEL_DIR / name, path / name)
    return model


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_launchers_defaults_serve_transformers_greedy_tokens(
    variant: str, tmp_path: Path
) -> None:
    hf = build(variant, tmp_path / "model")
    tokenizer = Tokenizer.from_file(str(tmp_path / "model" / "tokenizer.json"))
    launcher = start_launcher(
        tmp_path,
        ["--model-name", str(tmp_path / "model")],
        {"TGIS_ENGINE": "native"},
        unset_env=ISOLATED_ENV,
        max_batch_size=None,
    )
    request = pb.BatchedGenerationRequest(
        requests=[pb.GenerationRequest(text=text) for text in PROMPTS],
        params=pb.Parameters(
            method=pb.GREEDY,
            stopping=pb.StoppingCriteria(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS),
            response=pb.ResponseOptions(generated_tokens=True),
        ),
    )
    with serving(launcher), grpc.insecure_channel(launcher.grpc_target) as channel:
        responses = pb_grpc.GenerationServiceStub(channel).Generate(request, timeout=120)
        log = launcher.log_tail(100_000)
    assert "Engine: native paged (TGIS_ENGINE=native" in log
    context = hf.config.get_text_config().max_position_embeddings
    length = 4096 if variant == "phi3-longrope" else context  # LongRoPE's short factors
    assert f"Using model max_sequence_length: {length}\n" in log
    for text, got in zip(PROMPTS, responses.responses, strict=True):
        ids = tokenizer.encode(text).ids
        new = greedy_new_tokens(hf, ids, NEW_TOKENS, eos_token_id=2, pad_token_id=PAD_TOKEN_ID)
        assert [t.text for t in got.tokens] == [tokenizer.id_to_token(i) for i in new], text
        assert got.generated_token_count == NEW_TOKENS
