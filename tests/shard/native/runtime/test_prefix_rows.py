"""Prompt-tuning prefixes in the native engine, against transformers ``inputs_embeds``.

The oracle: a tiny random model's greedy continuation of
``generate(inputs_embeds=concat(prefix, embed(ids)))``, which is what TGIS computes for a
``prefix_id``. The shard gets the prefix from a real store directory (``decoder.pt`` or a
PEFT prompt-tuning adapter file) through ``PREFIX_STORE_PATH``'s ShardConfig field.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from tests.prefix_oracle import prefixed_greedy
from tests.shard.driving import Router
from tests.shard.models import EOS, TinyModel
from tgis.shard.adapters.store_paths import StoreError, StoreErrorKind
from tgis.shard.config import ShardConfig
from tgis.shard.loader import load_runner
from tgis.shard.native.runtime.model_runner import ModelRunner
from tgis.shard_api.messages import DetailOptions

HIDDEN = 64
NEW_TOKENS = 6
PROMPT_A = [5, 17, 33, 9, 81, 40, 7]
PROMPT_B = [12, 99, 4, 150, 61]
PROMPT_C = [201, 3, 77, 18, 52, 11, 140, 6, 23]


def random_prefix(length: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(length, HIDDEN, generator=generator) * scale


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A store with a ``decoder.pt`` prefix, a nested one, and a PEFT adapter file."""
    root = tmp_path_factory.mktemp("prefixes")
    (root / "tuned").mkdir()
    torch.save(random_prefix(5, seed=1), root / "tuned" / "decoder.pt")
    (root / "team" / "nested").mkdir(parents=True)
    torch.save(random_prefix(3, seed=2), root / "team" / "nested" / "decoder.pt")
    (root / "peft").mkdir()
    save_file(
        {"prompt_embeddings": random_prefix(20, seed=3)},
        root / "peft" / "adapter_model.safetensors",
    )
    (root / "wide").mkdir()
    torch.save(torch.zeros(4, HIDDEN + 1), root / "wide" / "decoder.pt")
    return root


def prefix_tensor(store: Path, prefix_id: str) -> torch.Tensor:
    item = store / prefix_id
    if (item / "decoder.pt").is_file():
        return torch.load(item / "decoder.pt", weights_only=True)
    from safetensors.torch import load_file

    return load_file(item / "adapter_model.safetensors")["prompt_embeddings"]


def reference(model: TinyModel, prefix: torch.Tensor | None, prompt: list[int], new: int):
    """transformers' greedy tokens and per-step logits for ``prefix`` then ``prompt``."""
    return prefixed_greedy(model.hf, prefix, prompt, new)


def make_runner(model: TinyModel, store: Path | None, **kwargs: Any) -> ModelRunner:
    kwargs.setdefault("kv_cache_blocks", 64)
    return load_runner(
        ShardConfig(
            model_name=str(model.path),
            prefix_store_path=None if store is None else str(store),
            **kwargs,
        )
    )  # type: ignore[return-value]


LOGPROBS = DetailOptions(logprobs=True, generated_tokens=True)


def test_lookup_reports_virtual_tokens(tiny_model: TinyModel, store: Path) -> None:
    runner = make_runner(tiny_model, store)
    assert runner.lookup_prefix("tuned").length == 5
    assert runner.lookup_prefix("team/nested").length == 3
    assert runner.lookup_prefix("peft").length == 20


@pytest.mark.parametrize(
    ("prefix_id", "kind", "message"),
    [
        ("missing", StoreErrorKind.NOT_FOUND, 'prefix id "missing" not found'),
        (
            "../etc",
            StoreErrorKind.INVALID,
            "Unexpected <class 'Exception'>: Invalid prefix id ../etc, must contain only "
            "alphanumeric, _ and - and /",
        ),
        (
            "wide",
            StoreErrorKind.INVALID,
            "Unexpected <class 'Exception'>: Prefix embedding tensor dim 65 does not match "
            "model (64)",
        ),
    ],
)
def test_lookup_errors_carry_tgis_messages(
    tiny_model: TinyModel, store: Path, prefix_id: str, kind: StoreErrorKind, message: str
) -> None:
    runner = make_runner(tiny_model, store)
    with pytest.raises(StoreError) as caught:
        runner.lookup_prefix(prefix_id)
    assert caught.value.kind is kind
    assert caught.value.tgis_message == message


def test_without_a_store_every_prefix_is_not_found(tiny_model: TinyModel) -> None:
    runner = make_runner(tiny_model, None)
    with pytest.raises(StoreError, match='prefix id "tuned" not found'):
        runner.lookup_prefix("tuned")


def test_prefixed_and_plain_sequences_in_one_batch_match_transformers(
    tiny_model: TinyModel, store: Path
) -> None:
    """Three prefixes (``.pt``, nested, PEFT) and a plain prompt prefilled together, the
    PEFT one in chunks that end inside its prefix, then decoded together."""
    runner = make_runner(tiny_model, store)
    router = Router(runner, seed=3)
    cases = {
        1: ("tuned", PROMPT_A),
        2: ("team/nested", PROMPT_B),
        3: ("", PROMPT_C),
        4: ("peft", PROMPT_B),
    }
    for rid, (prefix_id, prompt) in cases.items():
        length = runner.lookup_prefix(prefix_id).length if prefix_id else 0
        router.add(rid, prompt, details=LOGPROBS, prefix_id=prefix_id, prefix_length=length)
    peft_prompt = 20 + len(PROMPT_B)
    # Step 1: everything but the PEFT prompt whole, its first 7 virtual tokens.
    router.step({1: 5 + len(PROMPT_A), 2: 3 + len(PROMPT_B), 3: len(PROMPT_C), 4: 7})
    router.step({1: 1, 2: 1, 3: 1, 4: 10})  # the PEFT chunk ends at position 17 of 20
    router.step({1: 1, 2: 1, 3: 1, 4: peft_prompt - 17})
    for _ in range(NEW_TOKENS - 1):
        router.decode([1, 2, 3, 4])
    for rid, (prefix_id, prompt) in cases.items():
        prefix = prefix_tensor(store, prefix_id) if prefix_id else None
        extra = 0 if rid == 4 else 2  # the others decoded while the PEFT prompt finished
        tokens, logits = reference(tiny_model, prefix, prompt, NEW_TOKENS + extra)
        assert router.generated[rid] == tokens, f"request {rid} ({prefix_id or 'no prefix'})"
        details = [t.token for o in router.outputs for t in o.tokens if t.request_id == rid]
        for detail, step_logits in zip(details, logits, strict=True):
            expected = torch.log_softmax(step_logits, dim=-1)[detail.token_id].item()
            assert abs(detail.logprob - expected) < 1e-4, f"request {rid}"


def test_a_preempted_prefixed_sequence_resumes_exactly(tiny_model: TinyModel, store: Path) -> None:
    runner = make_runner(tiny_model, store)
    router = Router(runner)
    router.add(1, PROMPT_A, prefix_id="tuned", prefix_length=5)
    router.step({1: 5 + len(PROMPT_A)})
    router.decode([1])
    router.preempt(1)
    router.step({1: 5 + len(PROMPT_A) + 2})  # recompute prefix, prompt and both tokens
    for _ in range(NEW_TOKENS - 3):
        router.decode([1])
    expected, _ = reference(tiny_model, prefix_tensor(store, "tuned"), PROMPT_A, NEW_TOKENS)
    assert router.generated[1] == expected


def test_input_token_details_start_with_the_virtual_positions(
    tiny_model: TinyModel, store: Path
) -> None:
    """TGIS lists the prefix positions first, as the pad token, with the model's logprob
    of the pad id there; the input's tokens follow, scored as usual."""
    runner = make_runner(tiny_model, store)
    router = Router(runner)
    details = DetailOptions(logprobs=True, input_tokens=True)
    router.add(1, PROMPT_A, details=details, prefix_id="tuned", prefix_length=5)
    router.step({1: 3})  # a chunk inside the prefix, then the rest
    router.step({1: 2 + len(PROMPT_A)})
    (inputs,) = [d for o in router.outputs for d in o.input_tokens]
    pad = EOS  # the tiny config has no pad_token_id: the placeholder is the EOS id
    assert [t.token_id for t in inputs.tokens] == [pad] * 5 + PROMPT_A
    assert math.isnan(inputs.tokens[0].logprob)
    hf: Any = tiny_model.hf
    with torch.no_grad():
        embeds = hf.get_input_embeddings()(torch.tensor([PROMPT_A]))
        embeds = torch.cat([prefix_tensor(store, "tuned").unsqueeze(0), embeds], dim=1)
        logits = hf(inputs_embeds=embeds).logits[0].float()
    expected = torch.log_softmax(logits, dim=-1)
    targets = [pad] * 5 + PROMPT_A
    for position in range(1, len(targets)):
        want = expected[position - 1, targets[position]].item()
        assert abs(inputs.tokens[position].logprob - want) < 1e-4, position


def test_a_bad_prefix_fails_its_sequence_alone(tiny_model: TinyModel, store: Path) -> None:
    runner = make_runner(tiny_model, store)
    router = Router(runner)
    router.add(1, PROMPT_A, prefix_id="missing", prefix_length=4)
    router.add(2, PROMPT_B, prefix_id="tuned", prefix_length=4)  # the store says 5
    router.add(3, PROMPT_C)
    output = router.step({1: 4 + len(PROMPT_A), 2: 4 + len(PROMPT_B), 3: len(PROMPT_C)})
    errors = {e.request_id: e.message for e in output.errors}
    assert errors[1] == "Error retrieving prompt prefix 'missing': prefix id \"missing\" not found"
    assert errors[2].startswith(
        "prompt prefix 'tuned' has 5 virtual tokens but the router counted 4"
    )
    assert [t.request_id for t in output.tokens] == [3]
    assert router.generated[3] == tiny_model.greedy(PROMPT_C, 1)[0]
