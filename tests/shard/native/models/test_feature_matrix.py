"""The serving features beyond the family oracle (``test_families.py``: batching, chunked
prefill joining a decode, prompt tuning) on one mixture-of-experts family (Mixtral) and one
sliding-window family (Mistral with a window of 8 keys): preemption and its recompute, a
prefix-cache hit, prompt-lookup and draft-model speculation through the router's own
scheduler, guided decoding, a LoRA adapter and ``--load-format dummy``.

Oracles: transformers' greedy tokens (speculation: the same, so identical to decoding
without it); PEFT's for the adapter; for guided decoding, the greedy choice among the tokens
llguidance allows after each prefix, computed with transformers' logits, and the text in the
grammar's language. Each family is one module-scoped model, with the embedded model's
4096-token vocabulary and tokenizer so that grammars can be compiled for it. README.md's
feature matrix names these tests beside the other modules' (TP, compiled step, backends).
"""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import llguidance
import llguidance.numpy as llg_numpy
import pytest
import torch
from tokenizers import Tokenizer

from tests.guided_tokenizers import embedded_tokenizer_json
from tests.lora_oracle import lora_greedy, save_random_lora
from tests.router.core.test_scheduler import make_state
from tests.shard import driving
from tests.shard.checkpoints.test_dummy_weights import config_only, layout
from tests.shard.driving import Preemption, Router, drive
from tests.shard.families import FAMILIES, LOGPROBS, PROMPTS, prompt_of
from tests.shard.models import EOS, TinyModel
from tests.shard.native.models.test_families import make_runner
from tests.shard.step.test_guided import CASES, in_language
from tests.shard.step.test_speculation import attach_draft
from tgis.embedded_model import MODEL_DIR
from tgis.router.core.batching import SchedulerLimits
from tgis.router.core.request_state import RequestState
from tgis.router.core.scheduler import Scheduler, new_scheduler
from tgis.router.core.speculation import SpeculationConfig
from tgis.router.core.stopping import StopChecker
from tgis.router.intake.guided import grammar_source
from tgis.router.request_types import GuidedRequest
from tgis.shard.native.runtime.model_runner import ModelRunner
from tgis.shard_api.messages import SamplingParams

VOCAB = 4096  # the embedded tokenizer's, for the grammars
FEATURE_FAMILIES = ("mixtral", "mistral-window")
LONG = prompt_of(40, 14)  # five windows, two and a half blocks of 16


@pytest.fixture(scope="module", params=FEATURE_FAMILIES)
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp(request.param)
    hf = FAMILIES[request.param].build(path, vocab_size=VOCAB)
    shutil.copy(MODEL_DIR / "tokenizer.json", path / "tokenizer.json")
    return TinyModel(path, hf)


# ---- preemption and prefix caching ---------------------------------------------------------


@pytest.mark.parametrize(
    "preemption",
    [
        Preemption(2, after_tokens=4, pause_steps=1, chunk=7),  # 27 tokens in chunks of 7
        Preemption(3, after_tokens=0, pause_steps=1, chunk=5),  # mid-prompt
    ],
    ids=["decoding", "mid-prompt"],
)
def test_preempted_sequences_resume_with_transformers_tokens(
    family: TinyModel, preemption: Preemption
) -> None:
    """A sequence preempted, left waiting a step and recomputed in chunks (beside the others
    decoding) goes on with transformers' greedy tokens, as do its neighbours."""
    router = drive(make_runner(family.path), {}, preemption)
    for rid, prompt in driving.PROMPTS.items():
        assert router.generated[rid] == family.greedy(prompt, driving.NEW_TOKENS)[0], rid


def test_a_prefix_cache_hit_matches_hf(family: TinyModel) -> None:
    """A prompt sharing another's first two blocks starts after them, beside its decode."""
    router = Router(make_runner(family.path))
    router.add(1, LONG)
    router.step({1: len(LONG)})
    other = LONG[:32] + prompt_of(11, 15)
    router.add(2, other)
    router.share(2, 1, 2)
    router.step({2: len(other) - 32, 1: 1})
    for _ in range(9):
        router.decode([1, 2])
    assert router.generated[2] == family.greedy(other, 10)[0]
    assert router.generated[1] == family.greedy(LONG, 11)[0]


# ---- speculation through the router's scheduler ---------------------------------------------


def request(request_id: int, prompt: list[int], new_tokens: int) -> RequestState:
    """A greedy request for ``prompt`` that runs to ``new_tokens`` (no EOS stops it)."""
    state = make_state(request_id, len(prompt), new_tokens)
    state.request = replace(state.request, input_ids=tuple(prompt))
    state.stop_checker = StopChecker(state.request.stopping, ())
    return state


def serve(scheduler: Scheduler, runner: ModelRunner, states: list[RequestState]) -> tuple[int, int]:
    """Run ``states`` to the end, one step at a time; (tokens drafted, drafts confirmed)."""
    for state in states:
        scheduler.add(state)
    drafted = accepted = 0
    for _ in range(200):
        step = scheduler.schedule(0.0)
        if not step.plan.has_message:
            assert not scheduler.has_work, "requests left but nothing to do: stuck"
            return drafted, accepted
        output = runner.step(step.plan)
        assert not output.errors, output.errors
        update = scheduler.update(step, output, 0.0)
        drafted += update.drafted_tokens
        accepted += update.accepted_tokens
    pytest.fail("the requests did not end")


REPEATING = prompt_of(7, 16) * 4  # the tiny Mixtral's continuation repeats tokens too


@pytest.mark.parametrize("drafter", ["prompt-lookup", "draft-model"])
def test_speculation_gives_transformers_tokens(family: TinyModel, drafter: str) -> None:
    """``--speculate 3`` with drafts from prompt lookup (the router's n-grams: some right,
    some wrong) or from a draft model on the shard (the target's own weights: every draft
    confirmed): the tokens are transformers' greedy ones, those of decoding without drafts.
    The first prompt ends as it began, so lookup proposes what followed its start (within
    the window's reach, the same continuation). Prompt lookup drafts in every step
    (``--speculate-always``): the policy would soon stop drafting for a random model, whose
    drafts seldom land, and the rejected ones are what this checks beside the confirmed."""
    start = LONG[:20]
    echo = start + family.greedy(start, 12)[0] + start
    runner = make_runner(family.path)
    if drafter == "draft-model":
        attach_draft(runner, make_runner(family.path))
    limits = SchedulerLimits(
        max_batch_size=4, max_batch_prefill_tokens=64, max_batch_total_tokens=1024
    )
    config = SpeculationConfig(tokens=3, always=drafter == "prompt-lookup")
    scheduler = new_scheduler(limits, runner.info, False, config)
    states = [request(1, echo, 32), request(2, REPEATING, 32)]
    drafted, accepted = serve(scheduler, runner, states)
    for state in states:
        expected = family.greedy(state.request.input_ids, 32)[0]
        assert state.generated_ids == expected, state.request_id
    if drafter == "draft-model":
        assert accepted == drafted > 32
    else:
        assert drafted > accepted > 0


# ---- guided decoding ------------------------------------------------------------------------


def constrained_greedy(model: TinyModel, prompt: list[int], guided: GuidedRequest) -> list[int]:
    """Transformers' greedy choice among the tokens llguidance allows, step after step,
    until EOS (the reference's forward on the whole sequence each step)."""
    tokenizer = llguidance.LLTokenizer(embedded_tokenizer_json(), n_vocab=VOCAB, eos_token=EOS)
    matcher = llguidance.LLMatcher(tokenizer, grammar_source(guided))
    bitmask = llg_numpy.allocate_token_bitmask(1, VOCAB)
    ids: list[int] = []
    hf: Any = model.hf
    while not ids or ids[-1] != EOS:
        assert len(ids) < 60, "no EOS"
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + ids])).logits[0, -1:].float().numpy()
        llg_numpy.fill_next_token_bitmask(matcher, bitmask, 0)
        llg_numpy.apply_token_bitmask_inplace(logits, bitmask)
        ids.append(int(logits[0].argmax()))
        assert matcher.consume_token(ids[-1])
    return ids


def test_guided_sequences_are_the_constrained_greedy_choice(family: TinyModel) -> None:
    """A regex and a JSON schema beside an unguided request: each guided sequence is the
    constrained greedy choice and in its language; the unguided one is transformers'."""
    guided = {2: CASES["regex"], 3: CASES["json_schema"]}
    router = Router(make_runner(family.path))
    router.add(1, PROMPTS[2])
    for rid, case in guided.items():
        router.add(rid, PROMPTS[rid], sampling=SamplingParams(grammar=grammar_source(case)))
    out = router.step({rid: len(PROMPTS[rid]) for rid in (1, 2, 3)})
    for _ in range(60):
        live = [r for r in (2, 3) if router.generated[r][-1] != EOS]
        if not live:
            break
        out = router.step(dict.fromkeys([1, *live], 1))
        assert not out.errors, out.errors
    decoder = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))
    for rid, case in guided.items():
        ids = router.generated[rid]
        assert ids == constrained_greedy(family, PROMPTS[rid], case), rid
        assert in_language(case, decoder.decode(ids[:-1])), decoder.decode(ids[:-1])
    assert router.generated[1] == family.greedy(PROMPTS[2], len(router.generated[1]))[0]


# ---- LoRA adapters and dummy weights ---------------------------------------------------------


def test_a_lora_adapter_matches_peft(family: TinyModel, tmp_path: Path) -> None:
    """An adapter on the attention projections (Mixtral's experts are no linear modules
    PEFT targets): PEFT's greedy tokens and logprobs, beside a request without it."""
    adapters = tmp_path / "adapters"
    targets = ["q_proj", "k_proj", "v_proj", "o_proj"]
    save_random_lora(family.path, adapters / "a", seed=1, targets=targets)
    runner = make_runner(family.path, adapter_cache=str(adapters))
    runner.lookup_adapter("a")
    router = Router(runner)
    router.add(1, PROMPTS[3], details=LOGPROBS, adapter_id="a")
    router.add(2, PROMPTS[2], details=LOGPROBS)
    router.step({1: len(PROMPTS[3]), 2: len(PROMPTS[2])})
    for _ in range(5):
        router.decode([1, 2])
    for rid, adapter, prompt in ((1, adapters / "a", PROMPTS[3]), (2, None, PROMPTS[2])):
        tokens, logits = lora_greedy(family.path, adapter, prompt, 6)
        assert router.generated[rid] == tokens, rid
        details = [t.token for o in router.outputs for t in o.tokens if t.request_id == rid]
        for detail, step_logits in zip(details, logits, strict=True):
            expected = torch.log_softmax(step_logits, dim=-1)[detail.token_id].item()
            assert abs(detail.logprob - expected) < 1e-4, rid
    assert router.generated[1] != family.greedy(PROMPTS[3], 6)[0]  # the adapter matters


def test_dummy_weights_have_the_checkpoint_s_layout_and_serve(
    family: TinyModel, tmp_path: Path
) -> None:
    """``--load-format dummy`` from the config alone: the loaded model's tensors and KV
    window, and a prompt longer than the window prefilled in chunks and decoded."""
    loaded = make_runner(family.path)
    created = make_runner(config_only(family.path, tmp_path / "dummy"), load_format="dummy")
    assert layout(created.model) == layout(loaded.model)
    assert created.info.kv_window == loaded.info.kv_window
    router = Router(created)
    router.add(1, LONG)
    for chunk in (13, 27):
        router.step({1: chunk})
    for _ in range(4):
        router.decode([1])
    assert len(router.generated[1]) == 5 and all(0 <= t < VOCAB for t in router.generated[1])
