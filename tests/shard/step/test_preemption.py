"""Preemption: a preempted sequence keeps its tokens and sampler, loses its blocks, and a
recompute of every known token resumes it with exactly the output of an uninterrupted run."""

from __future__ import annotations

import pytest
import torch

from tests.shard.driving import NEW_TOKENS, PROMPTS, Preemption, Router, drive, prompt_of
from tests.shard.models import TinyModel
from tgis.shard.config import EngineSettings, ShardConfig
from tgis.shard.errors import InvalidStepError
from tgis.shard.fallback.runner import HfRunner
from tgis.shard.loader import load_runner
from tgis.shard.native.runtime.model_runner import ModelRunner
from tgis.shard.step.plan import PlanLimits, resolve_plan
from tgis.shard.step.runner import Runner
from tgis.shard.step.sequence import Sequence
from tgis.shard_api.messages import (
    DetailOptions,
    SamplingParams,
    ScheduledSequence,
    StepPlan,
    TokenDetail,
)

SEEDED = SamplingParams(
    temperature=0.9, top_k=40, top_p=0.95, seed=1234, repetition_penalty=1.3, min_new_tokens=3
)


def make(engine: str, model: TinyModel) -> Runner:
    config = ShardConfig(
        model_name=str(model.path), kv_cache_blocks=64, engine=EngineSettings(engine)
    )
    runner = load_runner(config)
    assert isinstance(runner, HfRunner if engine == "hf" else ModelRunner)
    return runner


@pytest.mark.parametrize("engine", ["native", "hf"])
@pytest.mark.parametrize(
    "preemption",
    [
        Preemption(2, after_tokens=4, pause_steps=2, chunk=5),
        Preemption(2, after_tokens=6, pause_steps=0, chunk=64),
        Preemption(3, after_tokens=0, pause_steps=1, chunk=5),  # mid-prompt
    ],
)
def test_preempted_greedy_and_seeded_sequences_resume_identically(
    engine: str, preemption: Preemption, tiny_model: TinyModel
) -> None:
    sampling = {2: SEEDED}  # 1 and 3 are greedy
    reference = drive(make(engine, tiny_model), sampling).generated
    assert reference[1] == tiny_model.greedy(PROMPTS[1], NEW_TOKENS)[0]
    assert reference[3] == tiny_model.greedy(PROMPTS[3], NEW_TOKENS)[0]
    for seeded in (SEEDED, SamplingParams(temperature=0.9, seed=77)):
        if seeded is not SEEDED:  # the greedy one preempted, a plain seeded neighbour
            sampling = {1: seeded}
            reference = drive(make(engine, tiny_model), sampling).generated
        preempted = drive(make(engine, tiny_model), sampling, preemption)
        assert preempted.generated == reference
        assert preempted.runner.sequences.keys() == set(PROMPTS)


def test_seeded_output_depends_on_the_kept_seed(
    tiny_model: TinyModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The check above can fail: a resumed sequence with another seed diverges."""
    runner = make("native", tiny_model)
    reference = drive(make("native", tiny_model), {2: SEEDED}).generated
    original = Sequence.preempt

    def preempt_and_reseed(self: Sequence) -> None:
        original(self)
        if self.seed:
            self.seed = 999

    monkeypatch.setattr(Sequence, "preempt", preempt_and_reseed)
    preempted = drive(runner, {2: SEEDED}, Preemption(2, 4, 1, 7)).generated
    assert preempted[2] != reference[2]
    assert preempted[1] == reference[1]


@pytest.mark.parametrize("after_tokens", [0, 3])
def test_input_token_details_are_sent_once(after_tokens: int, tiny_model: TinyModel) -> None:
    details = DetailOptions(input_tokens=True, logprobs=True, ranks=True, top_n=2)
    reference = drive(make("native", tiny_model), {}, details=details)
    preemption = Preemption(2, after_tokens=after_tokens, pause_steps=1, chunk=6)
    preempted = drive(make("native", tiny_model), {}, preemption, details)

    def input_details(router: Router) -> dict[int, list[TokenDetail]]:
        found: dict[int, list[TokenDetail]] = {}
        for out in router.outputs:
            for d in out.input_tokens:
                assert d.request_id not in found, "input-token details sent twice"
                found[d.request_id] = list(d.tokens)
        return found

    got, expected = input_details(preempted), input_details(reference)
    assert sorted(got) == [1, 2, 3]
    for rid, tokens in expected.items():
        assert len(got[rid]) == len(PROMPTS[rid])
        for a, b in zip(got[rid], tokens, strict=True):
            # Chunked differently, so the float sums may differ in the last bits.
            assert (a.token_id, a.rank) == (b.token_id, b.rank)
            assert [t.token_id for t in a.top_tokens] == [t.token_id for t in b.top_tokens]
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4, nan_ok=True)
    assert preempted.generated == reference.generated


def test_preempt_rules(tiny_model: TinyModel) -> None:
    runner = make("native", tiny_model)
    router = Router(runner)  # type: ignore[arg-type]
    router.add(1, PROMPTS[1])
    router.step({1: len(PROMPTS[1])})
    router.decode([1])
    known = len(PROMPTS[1]) + 2
    seq = runner.sequences[1]  # type: ignore[attr-defined]
    assert seq.num_computed == known - 1
    # Too many tokens for a recompute: refused, nothing changes (not even the preemption).
    plan = StepPlan(
        step_id=99,
        scheduled=(ScheduledSequence(1, known + 1, (5, 6)),),
        preempted_request_ids=(1,),
    )
    with pytest.raises(InvalidStepError):
        runner.step(plan)
    assert seq.num_computed == known - 1 and seq.block_table
    # Unknown and finished ids are ignored; preempting twice is preempting once.
    router.preempt(1)
    router._preempted += [1, 12345]
    router.step({})
    assert seq.num_computed == 0 and seq.block_table == [] and len(seq.token_ids) == known
    out = router.step({1: known})
    assert [t.request_id for t in out.tokens] == [1]
    assert router.generated[1] == tiny_model.greedy(PROMPTS[1], 3)[0]


def test_engines_that_cannot_recompute_refuse_to_preempt_generated_sequences() -> None:
    seq = Sequence(1, [5, 6, 7], prompt_len=2, sampling=SamplingParams(), details=DetailOptions(),
                   seed=0, block_table=[0], num_computed=2)  # fmt: skip
    limits = PlanLimits(4096, 8, 16, torch.device("cpu"), resumes_generated=False)
    with pytest.raises(InvalidStepError, match="cannot preempt"):
        resolve_plan(StepPlan(preempted_request_ids=(1,)), {1: seq}, limits)
    seq.token_ids = [5, 6]  # nothing generated yet: a plain restart of the prompt is fine
    resolved = resolve_plan(
        StepPlan(preempted_request_ids=(1,), scheduled=(ScheduledSequence(1, 2, (3,)),)),
        {1: seq},
        limits,
    )
    assert resolved.preempted == (1,)
    assert (resolved.work[0].start, resolved.work[0].block_table) == (0, (3,))


def test_seeded_sampling_is_the_same_alone_and_in_a_batch_of_32(tiny_model: TinyModel) -> None:
    """The counter-based draws depend only on the seed and the position: 31 neighbours
    (greedy and sampled with other seeds, different prompt lengths) change nothing."""
    prompt = PROMPTS[2]
    alone = Router(make("native", tiny_model))  # type: ignore[arg-type]
    alone.add(1, prompt, sampling=SEEDED)
    alone.step({1: len(prompt)})
    for _ in range(NEW_TOKENS - 1):
        alone.decode([1])
    batch = Router(make("native", tiny_model))  # type: ignore[arg-type]
    others = {rid: prompt_of(3 + rid % 17, rid) for rid in range(2, 33)}
    for rid, other in others.items():
        sampling = None if rid % 2 else SamplingParams(temperature=1.1, seed=rid * 31)
        batch.add(rid, other, sampling=sampling)
    batch.add(1, prompt, sampling=SEEDED)
    batch.step({1: len(prompt), **{rid: len(p) for rid, p in others.items()}})
    for _ in range(NEW_TOKENS - 1):
        batch.decode([1, *others])
    assert batch.generated[1] == alone.generated[1]
    assert len(set(alone.generated[1])) > 3  # really sampled
