"""Prompt-tuning prefixes on the transformers fallback engine (``HfRunner``).

Decoder-only models (a tiny Llama forced onto the fallback with ``TGIS_ENGINE=hf``, and a
tiny GPT-2, which only the fallback runs) against ``tests/prefix_oracle.py``'s
``generate(inputs_embeds=concat(prefix, embed(ids)))``; encoder-decoder models (tiny T5
and BART) against a greedy loop of transformers forwards with ``inputs_embeds`` =
``concat(encoder.pt, embed(ids))`` and ``decoder_inputs_embeds`` =
``concat(decoder.pt, embed(decoder start), embed(generated))``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.prefix_oracle import prefixed_greedy
from tests.shard.driving import Router
from tests.shard.fallback.hf_models import HIDDEN, prompt_of, random_causal, random_seq2seq
from tests.shard.models import TinyModel
from tgis.shard.adapters.store_paths import StoreError, StoreErrorKind
from tgis.shard.config import EngineSettings, ShardConfig
from tgis.shard.fallback.runner import HfRunner
from tgis.shard.loader import load_runner
from tgis.shard_api.messages import DetailOptions, ModelKind

NEW_TOKENS = 6
LOGPROBS = DetailOptions(logprobs=True, generated_tokens=True)


PROMPT_A, PROMPT_B, PROMPT_C = prompt_of(7, 1), prompt_of(5, 2), prompt_of(9, 3)


def random_prefix(length: int, seed: int) -> torch.Tensor:
    return torch.randn(length, HIDDEN, generator=torch.Generator().manual_seed(seed))


def _save_prefix(root: Path, prefix_id: str, **tensors: torch.Tensor) -> None:
    (root / prefix_id).mkdir(parents=True)
    for name, tensor in tensors.items():
        torch.save(tensor, root / prefix_id / f"{name}.pt")


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Decoder-only prefixes, encoder/decoder prefixes (even lengths) and an odd one."""
    root = tmp_path_factory.mktemp("fallback-prefixes")
    _save_prefix(root, "tuned", decoder=random_prefix(5, seed=1))
    _save_prefix(root, "team/nested", decoder=random_prefix(3, seed=2))
    _save_prefix(root, "long", decoder=random_prefix(20, seed=3))
    _save_prefix(root, "enc", encoder=random_prefix(4, seed=4))
    _save_prefix(root, "dec", decoder=random_prefix(2, seed=5))
    _save_prefix(root, "both", encoder=random_prefix(6, seed=6), decoder=random_prefix(4, seed=7))
    _save_prefix(root, "odd", encoder=random_prefix(3, seed=8))
    return root


def stored(store: Path, prefix_id: str, name: str = "decoder") -> torch.Tensor | None:
    path = store / prefix_id / f"{name}.pt"
    return torch.load(path, weights_only=True) if path.is_file() else None


def _saved(model: Any, path: Path) -> TinyModel:
    model.eval()
    model.save_pretrained(path)
    model.generation_config.eos_token_id = None  # the reference never stops early
    return TinyModel(path, model)


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    return _saved(random_causal("gpt2"), tmp_path_factory.mktemp("gpt2"))


@pytest.fixture(params=["llama", "gpt2"])
def causal(request: pytest.FixtureRequest, tiny_model: TinyModel) -> TinyModel:
    """A decoder-only model on the fallback: the tiny Llama forced onto it (``make_runner``
    asks for the fallback), and GPT-2."""
    if request.param == "llama":
        return tiny_model
    model: TinyModel = request.getfixturevalue("gpt2")
    return model


@pytest.fixture(scope="module", params=["t5", "bart"])
def seq2seq(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    """A tiny T5 (relative decoder positions) and BART (absolute ones)."""
    return _saved(random_seq2seq(request.param), tmp_path_factory.mktemp(request.param))


def make_runner(model: TinyModel, store: Path | None) -> HfRunner:
    runner = load_runner(
        ShardConfig(
            model_name=str(model.path),
            prefix_store_path=None if store is None else str(store),
            kv_cache_blocks=64,
            engine=EngineSettings(engine="hf"),  # TGIS_ENGINE=hf: every model here
        )
    )
    assert isinstance(runner, HfRunner)
    return runner


def seq2seq_greedy(
    hf: Any,
    encoder: torch.Tensor | None,
    decoder: torch.Tensor | None,
    ids: list[int],
    new_tokens: int,
) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens and step logits of an encoder-decoder model with ``encoder`` rows
    before the input's embeddings and ``decoder`` rows before the decoder start."""
    embed = hf.get_input_embeddings()
    start = hf.generation_config.decoder_start_token_id
    if start is None:
        start = hf.config.decoder_start_token_id
    tokens: list[int] = []
    logits: list[torch.Tensor] = []
    with torch.no_grad():
        enc = embed(torch.tensor([ids]))
        if encoder is not None:
            enc = torch.cat([encoder[None].to(enc.dtype), enc], dim=1)
        dec = embed(torch.tensor([[start]]))
        if decoder is not None:
            dec = torch.cat([decoder[None].to(dec.dtype), dec], dim=1)
        for _ in range(new_tokens):
            step = hf(inputs_embeds=enc, decoder_inputs_embeds=dec).logits[0, -1].float()
            token = int(step.argmax())
            tokens.append(token)
            logits.append(step)
            dec = torch.cat([dec, embed(torch.tensor([[token]]))], dim=1)
    return tokens, logits


def assert_logprobs(router: Router, rid: int, logits: list[torch.Tensor]) -> None:
    details = [t.token for o in router.outputs for t in o.tokens if t.request_id == rid]
    for detail, step_logits in zip(details, logits, strict=False):
        expected = torch.log_softmax(step_logits, dim=-1)[detail.token_id].item()
        assert abs(detail.logprob - expected) < 1e-4, f"request {rid}"


# ---- decoder-only ---------------------------------------------------------------------------


@pytest.mark.parametrize("ratio", [0, 1000], ids=["split-forwards", "one-padded-forward"])
def test_causal_prefixed_and_plain_batch_matches_transformers(
    causal: TinyModel, store: Path, ratio: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prefixed and plain prompts prefilled together, one in chunks ending inside its
    prefix while the others decode, then all decoded together."""
    monkeypatch.setattr("tgis.shard.fallback.causal.MAX_PADDING_RATIO", ratio)
    runner = make_runner(causal, store)
    assert runner.info.model_kind is ModelKind.CAUSAL_LM
    router = Router(runner, seed=3)
    cases = {
        1: ("tuned", PROMPT_A),
        2: ("team/nested", PROMPT_B),
        3: ("", PROMPT_C),
        4: ("long", PROMPT_B),
    }
    for rid, (prefix_id, prompt) in cases.items():
        length = runner.lookup_prefix(prefix_id).length if prefix_id else 0
        router.add(rid, prompt, details=LOGPROBS, prefix_id=prefix_id, prefix_length=length)
    assert runner.lookup_prefix("long").length == 20
    router.step({1: 5 + len(PROMPT_A), 2: 3 + len(PROMPT_B), 3: len(PROMPT_C), 4: 7})
    router.step({1: 1, 2: 1, 3: 1, 4: 10})  # the chunk ends at position 17 of 20
    router.step({1: 1, 2: 1, 3: 1, 4: 20 + len(PROMPT_B) - 17})
    for _ in range(NEW_TOKENS - 1):
        router.decode([1, 2, 3, 4])
    for rid, (prefix_id, prompt) in cases.items():
        prefix = stored(store, prefix_id) if prefix_id else None
        extra = 0 if rid == 4 else 2  # the others decoded while request 4's prompt finished
        tokens, logits = prefixed_greedy(causal.hf, prefix, prompt, NEW_TOKENS + extra)
        assert router.generated[rid] == tokens, f"request {rid} ({prefix_id or 'no prefix'})"
        assert_logprobs(router, rid, logits)
    # The prefix matters: the same input without it continues otherwise.
    assert router.generated[4] != prefixed_greedy(causal.hf, None, PROMPT_B, NEW_TOKENS)[0]


def test_causal_preempted_prefixed_sequence_resumes_exactly(causal: TinyModel, store: Path) -> None:
    router = Router(make_runner(causal, store))
    router.add(1, PROMPT_A, prefix_id="tuned", prefix_length=5)
    router.add(2, PROMPT_C)
    router.step({1: 5 + len(PROMPT_A), 2: len(PROMPT_C)})
    router.decode([1, 2])
    router.preempt(1)
    router.step({1: 5 + len(PROMPT_A) + 2, 2: 1})  # recompute prefix, prompt, both tokens
    for _ in range(NEW_TOKENS - 3):
        router.decode([1, 2])
    expected, _ = prefixed_greedy(causal.hf, stored(store, "tuned"), PROMPT_A, NEW_TOKENS)
    assert router.generated[1] == expected
    assert router.generated[2] == prefixed_greedy(causal.hf, None, PROMPT_C, NEW_TOKENS)[0]


def test_causal_bad_prefix_fails_its_sequence_alone(causal: TinyModel, store: Path) -> None:
    router = Router(make_runner(causal, store))
    router.add(1, PROMPT_A, prefix_id="missing", prefix_length=4)
    router.add(2, PROMPT_B, prefix_id="tuned", prefix_length=4)  # the store says 5
    router.add(3, PROMPT_C, prefix_id="tuned", prefix_length=5)
    output = router.step({1: 4 + len(PROMPT_A), 2: 4 + len(PROMPT_B), 3: 5 + len(PROMPT_C)})
    errors = {e.request_id: e.message for e in output.errors}
    assert errors[1] == "Error retrieving prompt prefix 'missing': prefix id \"missing\" not found"
    assert errors[2].startswith("prompt prefix 'tuned' has 5 virtual tokens but the router")
    assert [t.request_id for t in output.tokens] == [3]
    expected, _ = prefixed_greedy(causal.hf, stored(store, "tuned"), PROMPT_C, 1)
    assert router.generated[3] == expected


def test_without_a_store_every_prefix_is_not_found(gpt2: TinyModel) -> None:
    runner = make_runner(gpt2, None)
    with pytest.raises(StoreError, match='prefix id "tuned" not found'):
        runner.lookup_prefix("tuned")


# ---- encoder-decoder ------------------------------------------------------------------------


def _eos(model: TinyModel) -> int:
    return int(model.hf.config.eos_token_id)


def test_seq2seq_prefixes_match_transformers(seq2seq: TinyModel, store: Path) -> None:
    """Encoder-only, decoder-only and both prefixes with a plain prompt, started in one
    step (decoder prefixes of three lengths), one prompt chunked, one joining late."""
    runner = make_runner(seq2seq, store)
    assert runner.info.model_kind is ModelKind.SEQ2SEQ_LM
    eos = _eos(seq2seq)
    cases = {
        1: ("enc", [*PROMPT_A, eos]),
        2: ("dec", [*PROMPT_B, eos]),
        3: ("both", [*PROMPT_C, eos]),
        4: ("", [*PROMPT_B, eos]),
        5: ("both", [*PROMPT_A, eos]),
    }
    lengths = {rid: runner.lookup_prefix(p).length if p else 0 for rid, (p, _) in cases.items()}
    assert [lengths[r] for r in (1, 2, 3)] == [4, 2, 10]
    router = Router(runner, seed=5)
    for rid in (1, 2, 3, 4):
        prefix_id, prompt = cases[rid]
        router.add(rid, prompt, details=LOGPROBS, prefix_id=prefix_id, prefix_length=lengths[rid])
    total = {rid: lengths[rid] + len(prompt) for rid, (_, prompt) in cases.items()}
    router.step({1: total[1], 2: total[2], 3: 7, 4: total[4]})  # 3 stops inside its prefix
    router.step({1: 1, 2: 1, 3: total[3] - 7, 4: 1})
    router.add(5, cases[5][1], details=LOGPROBS, prefix_id="both", prefix_length=lengths[5])
    router.step({1: 1, 2: 1, 3: 1, 4: 1, 5: total[5]})
    while any(len(router.generated[r]) < NEW_TOKENS for r in cases):
        router.decode([r for r in cases if len(router.generated[r]) < NEW_TOKENS])
    for rid, (prefix_id, prompt) in cases.items():
        encoder = stored(store, prefix_id, "encoder") if prefix_id else None
        decoder = stored(store, prefix_id, "decoder") if prefix_id else None
        tokens, logits = seq2seq_greedy(seq2seq.hf, encoder, decoder, prompt, NEW_TOKENS)
        assert router.generated[rid] == tokens, f"request {rid} ({prefix_id or 'no prefix'})"
        assert_logprobs(router, rid, logits)
    # Each prefix matters: the same inputs without it continue otherwise.
    plain = {
        rid: seq2seq_greedy(seq2seq.hf, None, None, cases[rid][1], NEW_TOKENS)[0] for rid in (1, 3)
    }
    assert router.generated[1] != plain[1] and router.generated[3] != plain[3]
    assert router.generated[2] != router.generated[4]


def test_seq2seq_odd_length_prefix_is_refused(seq2seq: TinyModel, store: Path) -> None:
    runner = make_runner(seq2seq, store)
    with pytest.raises(StoreError) as caught:
        runner.lookup_prefix("odd")
    assert caught.value.kind is StoreErrorKind.INVALID
    assert caught.value.tgis_message == (
        "Unexpected <class 'Exception'>: Encoder/decoder prefix tensor must be of even length"
    )
    # A decoder-only prefix of odd length is refused too (TGIS checks every tensor).
    with pytest.raises(StoreError, match="even length"):
        runner.lookup_prefix("tuned")


def test_seq2seq_bad_prefix_fails_its_sequence_alone(seq2seq: TinyModel, store: Path) -> None:
    eos = _eos(seq2seq)
    router = Router(make_runner(seq2seq, store))
    router.add(1, [*PROMPT_A, eos], prefix_id="odd", prefix_length=3)
    router.add(2, [*PROMPT_B, eos], prefix_id="both", prefix_length=8)  # the store says 10
    router.add(3, [*PROMPT_C, eos], prefix_id="both", prefix_length=10)
    output = router.step({1: 3 + len(PROMPT_A) + 1, 2: 8 + len(PROMPT_B) + 1, 3: 10 + 10})
    errors = {e.request_id: e.message for e in output.errors}
    assert errors[1] == (
        "Error retrieving prompt prefix 'odd': Unexpected <class 'Exception'>: "
        "Encoder/decoder prefix tensor must be of even length"
    )
    assert errors[2].startswith("prompt prefix 'both' has 10 virtual tokens but the router")
    assert [t.request_id for t in output.tokens] == [3]
    expected, _ = seq2seq_greedy(
        seq2seq.hf,
        stored(store, "both", "encoder"),
        stored(store, "both", "decoder"),
        [*PROMPT_C, eos],
        1,
    )
    assert router.generated[3] == expected
