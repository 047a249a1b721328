"""OpenAI's presence/frequency penalties and logit bias, vLLM's min-p (``logit_adjustments.py``)
in the sampler's pipeline, against independent references: a per-row float64 loop of OpenAI's
definitions for the penalties and the bias, transformers' ``MinPLogitsWarper`` for min-p."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
from transformers.generation.logits_process import MinPLogitsWarper

from tgis.shard.step.plan import check_sampling
from tgis.shard.step.sampling import SamplingBatch, SamplingRow, process_logits, sample
from tgis.shard_api.messages import SamplingParams

CPU = torch.device("cpu")
VOCAB = 50
EOS = 2


def batch_of(rows: list[SamplingRow]) -> SamplingBatch:
    return SamplingBatch(rows, [EOS], VOCAB, CPU)


def reference_adjustments(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """OpenAI's definitions, one row and one token at a time, in float64."""
    out = logits.double().clone()
    for i, row in enumerate(rows):
        p = row.params
        generated = list(row.token_ids)[len(row.token_ids) - row.num_generated :]
        for token, count in Counter(generated).items():
            out[i, token] -= p.frequency_penalty * count + p.presence_penalty
        for token, bias in p.logit_bias:
            out[i, token] += bias
    return out


def test_penalties_and_bias_equal_openais_definitions() -> None:
    rng = random.Random(4)
    for trial in range(20):
        rows = []
        for _ in range(5):
            prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 8))]
            generated = [rng.randrange(VOCAB) for _ in range(rng.randrange(0, 12))]
            params = SamplingParams(
                presence_penalty=rng.choice([0.0, 0.5, -1.0, 2.0]),
                frequency_penalty=rng.choice([0.0, 0.3, -0.7, 2.0]),
                logit_bias=tuple(
                    (t, rng.uniform(-100, 100)) for t in rng.sample(range(VOCAB), rng.randrange(4))
                ),
            )
            rows.append(SamplingRow(params, prompt + generated, len(generated)))
        logits = torch.randn(5, VOCAB, generator=torch.Generator().manual_seed(trial))
        got = process_logits(logits, batch_of(rows))
        # float32 arithmetic on values up to 100: within float32 rounding of the reference
        torch.testing.assert_close(
            got.double(), reference_adjustments(logits, rows), rtol=1e-6, atol=2e-5
        )


def test_the_prompt_is_not_penalised_and_greedy_rows_follow_the_adjusted_scores() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, 7] = 1.0
    prompt_only = SamplingRow(SamplingParams(presence_penalty=2.0), [7, 7, 7], 0)
    assert int(sample(logits, batch_of([prompt_only]))[0][0]) == 7
    once = SamplingRow(SamplingParams(presence_penalty=2.0), [3, 7], 1)
    assert int(sample(logits, batch_of([once]))[0][0]) != 7
    banned = SamplingRow(SamplingParams(logit_bias=((7, -100.0),)), [3], 0)
    forced = SamplingRow(SamplingParams(logit_bias=((11, 100.0),)), [3], 0)
    tokens, _ = sample(logits.repeat(2, 1), batch_of([banned, forced]))
    assert int(tokens[0]) != 7 and int(tokens[1]) == 11


@pytest.mark.parametrize("min_p", [0.05, 0.2, 0.5, 1.0])
def test_min_p_equals_transformers_warper(min_p: float) -> None:
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(9)) * 3
    rows = [SamplingRow(SamplingParams(temperature=0.7, min_p=min_p, seed=1), [1], 0)] * 4
    got = process_logits(logits, batch_of(rows))
    expected = MinPLogitsWarper(min_p=min_p)(None, logits / 0.7)  # type: ignore[arg-type]
    assert torch.equal(torch.isinf(got), torch.isinf(expected))
    kept = ~torch.isinf(got)
    torch.testing.assert_close(got[kept], expected[kept])


def test_min_p_leaves_greedy_and_other_rows_alone() -> None:
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(2)) * 3
    rows = [
        SamplingRow(SamplingParams(min_p=0.5), [1], 0),  # greedy: min_p unused
        SamplingRow(SamplingParams(temperature=1.0, seed=3), [1], 0),
        SamplingRow(SamplingParams(temperature=1.0, min_p=0.5, seed=3), [1], 0),
    ]
    got = process_logits(logits, batch_of(rows))
    torch.testing.assert_close(got[:2], logits[:2])
    assert torch.isinf(got[2]).any()


def test_a_batch_without_them_stays_plain() -> None:
    plain = SamplingRow(SamplingParams(), [1], 0)
    assert batch_of([plain]).plain
    assert not batch_of([SamplingRow(SamplingParams(logit_bias=((1, 1.0),)), [1], 0)]).plain


@pytest.mark.parametrize(
    ("params", "problem"),
    [
        (SamplingParams(min_p=1.5), "invalid min_p 1.5"),
        (SamplingParams(logit_bias=((VOCAB, 1.0),)), "logit_bias token id 50 out of range"),
        (SamplingParams(presence_penalty=float("nan")), "not finite"),
    ],
)
def test_the_shard_refuses_what_it_cannot_apply(params: SamplingParams, problem: str) -> None:
    found = check_sampling(params, VOCAB)
    assert found is not None and problem in found
