"""Guided decoding on the shard: the token masks, the sampler's order, the runner.

Oracles: llguidance's own bitmask application (``llguidance.numpy``) for the masks; for what
a grammar lets through, the text decoded by the `tokenizers` library checked with
``re.fullmatch``, ``jsonschema`` and set membership, and the ids replayed through a fresh
llguidance matcher; for everything else, the same runner without the grammar.
"""

from __future__ import annotations

import json
import random
import re
import shutil
from pathlib import Path

import jsonschema
import llguidance
import llguidance.numpy as llg_numpy
import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from tests.guided_tokenizers import embedded_tokenizer_json, llama_style_tokenizer_json
from tests.shard.driving import Router
from tests.shard.models import build_tiny_llama
from tgis.embedded_model import MODEL_DIR
from tgis.router.intake.guided import grammar_source
from tgis.router.request_types import GuidedKind, GuidedRequest
from tgis.shard.config import EngineSettings, ShardConfig
from tgis.shard.loader import load_runner
from tgis.shard.native.runtime.model_runner import ModelRunner
from tgis.shard.step.guided import Grammars, Guide
from tgis.shard_api.messages import DetailOptions, SamplingParams

EOS = 2
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "ok"],
    "additionalProperties": False,
}
GRAMMAR = 'root ::= "SELECT " [a-z] [a-z]? [a-z]? " FROM " tables\ntables ::= [a-z] [a-z]?'
CASES = {
    "regex": GuidedRequest(GuidedKind.REGEX, "[a-z]{2,5}-[0-9]{1,3}"),
    "json_schema": GuidedRequest(GuidedKind.JSON_SCHEMA, json.dumps(SCHEMA)),
    "choice": GuidedRequest(GuidedKind.CHOICE, choices=("yes", "no", "maybe so")),
    "grammar": GuidedRequest(GuidedKind.GRAMMAR, GRAMMAR),
}


def in_language(request: GuidedRequest, text: str) -> bool:
    """The independent check of ``text`` against what ``request`` asked for."""
    if request.kind is GuidedKind.REGEX:
        return re.fullmatch(request.text, text) is not None
    if request.kind is GuidedKind.CHOICE:
        return text in request.choices
    if request.kind is GuidedKind.GRAMMAR:
        return re.fullmatch("SELECT [a-z]{1,3} FROM [a-z]{1,2}", text) is not None
    jsonschema.validate(json.loads(text), json.loads(request.text))
    return True


TOKENIZERS = {"byte-level": embedded_tokenizer_json, "llama-style": llama_style_tokenizer_json}


def grammars_for(tokenizer_json: str, vocab_size: int | None = None) -> Grammars:
    size = vocab_size or Tokenizer.from_str(tokenizer_json).get_vocab_size()
    return Grammars(lambda: tokenizer_json, size, [EOS])


@pytest.mark.parametrize("tokenizer", TOKENIZERS)
@pytest.mark.parametrize("case", CASES)
def test_random_walks_through_the_masks_stay_in_the_language(tokenizer: str, case: str) -> None:
    """Pick any allowed token, step after step, until EOS: the decoded text is in the
    language, for byte-level BPE and for Metaspace with byte fallback alike."""
    text = TOKENIZERS[tokenizer]()
    request = CASES[case]
    grammars = grammars_for(text)
    decoder = Tokenizer.from_str(text)
    rng = random.Random(7)
    for _ in range(5):
        guide = grammars.guide(grammar_source(request))
        ids: list[int] = []
        for _ in range(200):
            masks = grammars.start_masks([guide], torch.device("cpu")).result()
            assert not masks.errors
            allowed = masks.allowed[0].nonzero()[:, 0].tolist()
            token = rng.choice(allowed)
            if token == EOS:
                break
            ids.append(token)
            guide.consume(token)
        else:
            pytest.fail("no EOS within 200 tokens")
        assert in_language(request, decoder.decode(ids)), decoder.decode(ids)


def test_masks_apply_as_llguidance_applies_them() -> None:
    """Rows with a grammar get llguidance's own masking, other rows stay as they were."""
    text = embedded_tokenizer_json()
    vocab = 4100  # wider than the tokenizer (padded embeddings): the tail is never allowed
    grammars = grammars_for(text, vocab)
    guides: list[Guide | None] = [
        None,
        grammars.guide(grammar_source(CASES["json_schema"])),
        None,
        grammars.guide(grammar_source(CASES["regex"])),
    ]
    masks = grammars.start_masks(guides, torch.device("cpu")).result()
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(0))
    got = logits.clone()
    masks.apply_(got)

    tokenizer = llguidance.LLTokenizer(text, n_vocab=vocab, eos_token=EOS)
    expected = logits.numpy().copy()
    for row in (1, 3):
        guide = guides[row]
        assert guide is not None
        fresh = llguidance.LLMatcher(
            tokenizer, grammar_source(CASES[["", "json_schema", "", "regex"][row]])
        )
        bitmask = llg_numpy.allocate_token_bitmask(1, vocab)
        llg_numpy.fill_next_token_bitmask(fresh, bitmask, 0)
        llg_numpy.apply_token_bitmask_inplace(expected[row : row + 1], bitmask)
    assert torch.equal(got, torch.from_numpy(expected))
    assert torch.equal(got[[0, 2]], logits[[0, 2]])
    assert masks.eos_only == (False, False, False, False)
    assert not bool(masks.allowed[:, 4096:].any())


def test_eos_only_when_the_grammar_is_complete() -> None:
    grammars = grammars_for(embedded_tokenizer_json())
    guide = grammars.guide(grammar_source(GuidedRequest(GuidedKind.CHOICE, choices=("ab", "cd"))))
    tokenizer = Tokenizer.from_str(embedded_tokenizer_json())
    for token in tokenizer.encode("ab").ids:
        guide.consume(token)
    masks = grammars.start_masks([guide, None], torch.device("cpu")).result()
    assert masks.eos_only == (True, False)
    assert masks.allowed[0].nonzero()[:, 0].tolist() == [EOS]


def test_a_grammar_the_shard_cannot_compile_fails_its_sequence_alone() -> None:
    grammars = grammars_for(embedded_tokenizer_json())
    bad = grammars.guide(llguidance.LLMatcher.grammar_from_lark("start: nowhere"))
    good = grammars.guide(grammar_source(CASES["regex"]))
    masks = grammars.start_masks([bad, good], torch.device("cpu")).result()
    assert list(masks.errors) == [0]
    assert masks.errors[0].startswith("guided decoding: ")
    assert "nowhere" in masks.errors[0]


# ---- the runner: a tiny Llama with the embedded tokenizer -----------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("guided-llama")
    build_tiny_llama(path, vocab_size=4096)
    shutil.copy(MODEL_DIR / "tokenizer.json", path / "tokenizer.json")
    return path


@pytest.fixture
def runner(model_dir: Path) -> ModelRunner:
    made = load_runner(ShardConfig(model_name=str(model_dir), kv_cache_blocks=64))
    assert isinstance(made, ModelRunner)
    return made


PROMPTS = {1: [5, 77, 300, 12, 9], 2: [400, 401, 402], 3: [17, 18, 19, 20, 21, 22, 23]}
DETAILS = DetailOptions(logprobs=True, ranks=True, top_n=3, generated_tokens=True)


def run(
    runner: ModelRunner,
    sampling: dict[int, SamplingParams],
    steps: int = 24,
    preempt_at: int | None = None,
) -> Router:
    """Prefill every prompt, then decode ``steps`` steps (a sequence that sampled EOS stops);
    with ``preempt_at``, request 2 is preempted after that step and recomputed at once."""
    router = Router(runner)
    for rid, prompt in PROMPTS.items():
        router.add(rid, prompt, sampling=sampling.get(rid), details=DETAILS)
    out = router.step({rid: len(p) for rid, p in PROMPTS.items()})
    assert not out.errors
    for step in range(steps):
        live = [r for r in PROMPTS if not router.generated[r] or router.generated[r][-1] != EOS]
        if not live:
            break
        schedule = dict.fromkeys(live, 1)
        if preempt_at == step and 2 in live:
            router.preempt(2)
            schedule[2] = len(PROMPTS[2]) + len(router.generated[2])
        out = router.step(schedule)
        assert not out.errors, out.errors
    return router


def details_of(router: Router, rid: int) -> list[object]:
    return [t.token for out in router.outputs for t in out.tokens if t.request_id == rid]


@pytest.mark.parametrize("case", ["regex", "json_schema", "choice"])
@pytest.mark.parametrize("mode", ["greedy", "seeded"])
def test_guided_sequence_beside_unguided_ones(runner: ModelRunner, case: str, mode: str) -> None:
    """The guided sequence ends with EOS, in its language (replayed through a fresh matcher);
    its neighbours' tokens and details are those of the same batch without the grammar,
    bit for bit."""
    request = CASES[case]
    base = SamplingParams() if mode == "greedy" else SamplingParams(temperature=1.0, seed=11)
    guided = SamplingParams(
        temperature=base.temperature, seed=base.seed, grammar=grammar_source(request)
    )
    plain = run(runner, {1: base, 2: base, 3: base}, steps=60)
    runner.reset()
    constrained = run(runner, {1: base, 2: guided, 3: base}, steps=60)
    for rid in (1, 3):
        assert constrained.generated[rid] == plain.generated[rid]
        assert details_of(constrained, rid) == details_of(plain, rid)
    ids = constrained.generated[2]
    assert ids[-1] == EOS, "the grammar completes within the steps"
    text = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json")).decode(ids[:-1])
    assert in_language(request, text), text
    fresh = llguidance.LLMatcher(
        llguidance.LLTokenizer(embedded_tokenizer_json(), n_vocab=4096, eos_token=EOS),
        grammar_source(request),
    )
    assert fresh.validate_tokens(ids) == len(ids)
    # Token details come from the masked scores: the chosen token is always allowed there.
    # and a forbidden token is never among the top-n.
    details = details_of(constrained, 2)
    assert all(detail.logprob > float("-inf") for detail in details)
    assert all(t.logprob > float("-inf") for d in details for t in d.top_tokens)


def test_min_new_tokens_never_leaves_the_language(runner: ModelRunner) -> None:
    """min_new_tokens masks EOS while the grammar can go on, and gives way once the grammar
    allows only EOS."""
    choice = GuidedRequest(GuidedKind.CHOICE, choices=("yes", "no"))
    sampling = SamplingParams(min_new_tokens=20, grammar=grammar_source(choice))
    router = run(runner, {2: sampling})
    ids = router.generated[2]
    assert ids[-1] == EOS and len(ids) < 20
    text = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json")).decode(ids[:-1])
    assert text in choice.choices


def test_preempted_guided_sequence_resumes_identically(runner: ModelRunner) -> None:
    sampling = {2: SamplingParams(temperature=0.8, seed=5, grammar=grammar_source(CASES["regex"]))}
    straight = run(runner, sampling, steps=40)
    runner.reset()
    preempted = run(runner, sampling, steps=40, preempt_at=2)
    assert preempted.generated[2] == straight.generated[2]
    assert straight.generated[2][-1] == EOS


def test_an_unknown_shard_grammar_fails_only_its_sequence(runner: ModelRunner) -> None:
    router = Router(runner)
    router.add(1, PROMPTS[1])
    router.add(2, PROMPTS[2], sampling=SamplingParams(grammar="start: nowhere"))
    out = router.step({1: len(PROMPTS[1]), 2: len(PROMPTS[2])})
    assert [e.request_id for e in out.errors] == [2]
    assert "nowhere" in out.errors[0].message and out.errors[0].constraint
    assert [t.request_id for t in out.tokens] == [1]


def test_a_matcher_that_cannot_go_on_fails_with_a_short_message() -> None:
    grammars = grammars_for(embedded_tokenizer_json())
    guide = grammars.guide(grammar_source(GuidedRequest(GuidedKind.REGEX, "ab")))
    guide.consume(Tokenizer.from_str(embedded_tokenizer_json()).encode("zz").ids[0])
    masks = grammars.start_masks([guide], torch.device("cpu")).result()
    message = masks.errors[0]
    assert message.startswith("guided decoding: ") and "satisfy the grammar" in message
    assert "<state>" not in message and len(message) < 700


@pytest.mark.parametrize("literal", ["x</s>y", "<s>", "<unk><pad>"])
def test_special_token_text_is_generated_as_text(runner: ModelRunner, literal: str) -> None:
    """Greedy and sampled: the grammar's text, in ordinary tokens, then EOS."""
    grammar = grammar_source(GuidedRequest(GuidedKind.REGEX, re.escape(literal)))
    samplings = {
        1: SamplingParams(grammar=grammar),
        2: SamplingParams(temperature=1.0, seed=3, grammar=grammar),
    }
    router = run(runner, samplings, steps=30)
    tokenizer = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))
    for rid in samplings:
        ids = router.generated[rid]
        assert ids[-1] == EOS and not {0, 1, 3} & set(ids)
        assert tokenizer.decode(ids[:-1], skip_special_tokens=False) == literal


def test_masks_are_bits_of_the_vocabulary() -> None:
    """The unpacked mask is llguidance's bitmask, bit i of word w being token 32 w + i."""
    grammars = grammars_for(embedded_tokenizer_json())
    guide = grammars.guide(grammar_source(CASES["choice"]))
    masks = grammars.start_masks([guide], torch.device("cpu")).result()
    bitmask = llg_numpy.allocate_token_bitmask(1, 4096)
    fresh = llguidance.LLMatcher(
        llguidance.LLTokenizer(embedded_tokenizer_json(), n_vocab=4096, eos_token=EOS),
        grammar_source(CASES["choice"]),
    )
    llg_numpy.fill_next_token_bitmask(fresh, bitmask, 0)
    words = bitmask[0].astype(np.uint32)
    expected = [(int(words[t // 32]) >> (t % 32)) & 1 == 1 for t in range(4096)]
    assert masks.allowed[0].tolist() == expected


@pytest.mark.slow
def test_the_compiled_step_stays_in_use_and_agrees(tmp_path: Path) -> None:
    """With the compiled forward (``TGIS_COMPILE=1``), a guided sequence beside unguided
    ones gets the eager step's tokens: the mask is applied outside the compiled graph. On a
    one-layer twin of the module's model: the mask comes after the forward whatever its
    layers, and a second layer doubled the compilation."""
    from tgis.shard.native.graphs.compiled import CompiledForward

    build_tiny_llama(tmp_path, vocab_size=4096, num_hidden_layers=1)
    shutil.copy(MODEL_DIR / "tokenizer.json", tmp_path / "tokenizer.json")
    sampling = {
        1: SamplingParams(),
        2: SamplingParams(grammar=grammar_source(CASES["json_schema"])),
        3: SamplingParams(temperature=0.8, seed=3, grammar=grammar_source(CASES["regex"])),
    }
    runner = load_runner(ShardConfig(model_name=str(tmp_path), kv_cache_blocks=64))
    assert isinstance(runner, ModelRunner)
    eager = run(runner, sampling, steps=60)
    config = ShardConfig(
        model_name=str(tmp_path), kv_cache_blocks=64, engine=EngineSettings(compile="1")
    )
    compiled_runner = load_runner(config)
    assert isinstance(compiled_runner, ModelRunner)
    assert isinstance(compiled_runner.forward, CompiledForward)
    compiled = run(compiled_runner, sampling, steps=60)
    assert compiled.generated == eager.generated
    assert eager.generated[2][-1] == EOS and eager.generated[3][-1] == EOS
