"""The batch sampler and token details, on crafted and random logits."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from transformers.generation.logits_process import (
    ExponentialDecayLengthPenalty,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

from tgis.shard.step.sampling import (
    SamplingBatch,
    SamplingRow,
    draw_from,
    sample,
    stream_key,
    uniform_draws,
)
from tgis.shard.step.token_details import first_input_detail, token_details
from tgis.shard_api.messages import DetailOptions, LengthPenalty, SamplingParams

CPU = torch.device("cpu")
EOS = 2
VOCAB = 64


def rows_of(*params: SamplingParams, ids=(5, 6, 7), generated: int = 0) -> list[SamplingRow]:
    return [SamplingRow(p, list(ids), generated, p.seed or 0) for p in params]


def run(logits: torch.Tensor, rows: list[SamplingRow]) -> tuple[torch.Tensor, torch.Tensor]:
    return sample(logits, SamplingBatch(rows, [EOS], logits.shape[-1], CPU))


def random_logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 2


def test_same_seed_same_tokens_different_seed_different_tokens() -> None:
    def draws(seed: int) -> list[int]:
        """The first 20 draws of a sequence: one per generated-token count."""
        return [
            int(
                run(torch.zeros(1, VOCAB), rows_of(SamplingParams(1.0, seed=seed), generated=n))[0][
                    0
                ]
            )
            for n in range(20)
        ]

    assert draws(7) == draws(7)
    assert draws(7) != draws(8)
    assert len(set(draws(7))) > 5  # a uniform distribution really is sampled
    # A draw depends only on (seed, tokens generated): the same alone or in any batch.
    batch = rows_of(*(SamplingParams(1.0, seed=s) for s in (8, 7, 9)), generated=4)
    assert int(run(torch.zeros(3, VOCAB), batch)[0][1]) == draws(7)[4]


def test_sampling_follows_the_distribution() -> None:
    """The counter-based noise draws each token with its softmax probability."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0] + [-30.0] * (VOCAB - 4)])
    expected = logits.softmax(-1)[0, :4]
    draws = 4000
    counts = torch.zeros(4)
    for n in range(draws):
        (token,), _ = run(logits, rows_of(SamplingParams(1.0, seed=12345), generated=n))
        counts[int(token)] += 1
    # Within 4 standard deviations of a multinomial count.
    std = (draws * expected * (1 - expected)).sqrt()
    assert ((counts - draws * expected).abs() <= 4 * std + 1).all(), (counts, draws * expected)


def test_uniform_draws_are_a_fixed_function_of_the_key() -> None:
    keys = torch.tensor([stream_key(seed, step) for seed in (3, 2**40 + 3) for step in range(5000)])
    draws = uniform_draws(keys)
    assert draws.dtype == torch.float64 and ((draws > 0) & (draws < 1)).all()
    assert torch.equal(draws[:7], uniform_draws(keys[:7]))
    assert len(set(draws.tolist())) == len(keys)
    assert abs(float(draws.mean()) - 0.5) < 0.01  # U(0, 1): mean 1/2, variance 1/12
    assert abs(float(draws.var()) - 1 / 12) < 0.005


def test_draw_from_inverts_the_cumulative_distribution_across_blocks() -> None:
    """A vocabulary of two full 1,024-token blocks and a tail, with zeros at block edges:
    evenly spaced uniform numbers land on each token in proportion to its probability
    (to within one draw), and never on a zero."""
    vocab = 2 * 1024 + 452
    gen = torch.Generator().manual_seed(4)
    probs = torch.rand(2, vocab, generator=gen) ** 4
    zeros = [0, 1023, 1024, 2047, 2048, vocab - 1, *range(300, 700)]
    probs[:, zeros] = 0.0
    probs[1] *= 7.5  # any total
    draws = 20_000
    uniform = (torch.arange(draws, dtype=torch.float64) + 0.5) / draws
    for row in range(2):
        tokens = draw_from(probs[row : row + 1].expand(draws, vocab), uniform)
        counts = torch.bincount(tokens, minlength=vocab).double()
        expected = probs[row].double() / probs[row].double().sum() * draws
        assert (counts - expected).abs().max() <= 1.0 + 1e-6
        assert counts[zeros].sum() == 0
        assert torch.equal(tokens, tokens.sort().values)  # monotone in u: an inverse CDF


def test_a_token_of_probability_zero_is_never_drawn() -> None:
    """Top-k and top-p leave -inf scores: the draw lands on the kept tokens only, even
    for the largest and smallest uniform numbers."""
    logits = torch.zeros(1, VOCAB)
    logits[0, 40:] = float("-inf")
    seen = set()
    for n in range(400):
        (token,), _ = run(logits, rows_of(SamplingParams(1.0, seed=5), generated=n))
        seen.add(int(token))
    assert seen == set(range(40))


@pytest.mark.parametrize("top_p,wider", [(0.5, 2.0), (0.9, 3.5), (0.99, 4.5)])
def test_top_p_over_a_large_vocabulary_matches_hf(top_p: float, wider: float) -> None:
    """Rows whose nucleus lies in the top 256, in the top 4,096, and only in the whole
    vocabulary (flat logits), beside a row without top-p: HF's warper row by row."""
    vocab = 50_000
    gen = torch.Generator().manual_seed(int(top_p * 100))
    logits = torch.randn(4, vocab, generator=gen)
    logits[0] *= 12.0  # peaked: a nucleus of a few tokens
    logits[1] *= wider  # a nucleus of 256 to 4,096 tokens
    logits[2] *= 0.1  # nearly flat: the nucleus is most of the vocabulary
    params = [SamplingParams(1.0, top_p=top_p, seed=1)] * 3 + [SamplingParams(1.0, seed=2)]
    _, scores = run(logits, rows_of(*params))
    widths = []
    for row in range(3):
        expected = TopPLogitsWarper(top_p)(None, logits[row : row + 1].clone())
        torch.testing.assert_close(scores[row : row + 1], expected)
        widths.append(int(torch.isfinite(expected).sum()))
    assert widths[0] <= 256 < widths[1] <= 4096 < widths[2], widths  # each path taken
    torch.testing.assert_close(scores[3], logits[3])


def test_sampled_row_does_not_disturb_greedy_row() -> None:
    logits = random_logits(2)
    tokens, scores = run(logits, rows_of(SamplingParams(), SamplingParams(temperature=5.0, seed=1)))
    assert int(tokens[0]) == int(logits[0].argmax())
    torch.testing.assert_close(scores[0], logits[0])  # greedy rows get no warper


def test_top_k_one_equals_greedy_and_has_logprob_zero() -> None:
    logits = random_logits(4, seed=3)
    params = SamplingParams(temperature=1.3, top_k=1, seed=11)
    tokens, scores = run(logits, rows_of(*[params] * 4))
    assert tokens.tolist() == logits.argmax(dim=-1).tolist()
    details = token_details(scores, tokens, [DetailOptions(logprobs=True, ranks=True)] * 4)
    assert all(d.logprob == 0.0 and d.rank == 1 for d in details)


def test_min_new_tokens_masks_eos() -> None:
    logits = torch.zeros(2, VOCAB)
    logits[:, EOS] = 10.0
    params = SamplingParams(min_new_tokens=3)
    masked = rows_of(params, generated=2)
    allowed = rows_of(params, generated=3)
    tokens, scores = run(logits.clone(), masked + allowed)
    assert int(tokens[0]) != EOS and scores[0, EOS] == float("-inf")
    assert int(tokens[1]) == EOS


def test_repetition_penalty_pushes_seen_tokens_down() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, 10] = 2.0  # seen, positive: divided
    logits[0, 11] = 1.5  # unseen
    logits[0, 12] = -1.0  # seen, negative: multiplied
    params = SamplingParams(repetition_penalty=2.0)
    tokens, scores = run(logits, rows_of(params, ids=(10, 12, 10)))
    assert scores[0, 10].item() == pytest.approx(1.0)
    assert scores[0, 12].item() == pytest.approx(-2.0)
    assert scores[0, 11].item() == pytest.approx(1.5)
    assert int(tokens[0]) == 11  # 10 was the argmax before the penalty
    tokens, _ = run(logits, rows_of(SamplingParams(), ids=(10, 12, 10)))
    assert int(tokens[0]) == 10


def test_length_penalty_boosts_eos_after_start_index() -> None:
    logits = torch.full((3, VOCAB), 0.0)
    logits[:, EOS] = -2.0
    params = SamplingParams(length_penalty=LengthPenalty(start_index=4, decay_factor=1.5))
    batch = rows_of(params, generated=4) + rows_of(params, generated=6)
    batch += rows_of(
        SamplingParams(min_new_tokens=10, length_penalty=params.length_penalty), generated=6
    )
    _, scores = run(logits, batch)
    assert scores[0, EOS].item() == pytest.approx(-2.0)  # tokens past start = 0: no boost
    assert scores[1, EOS].item() == pytest.approx(-2.0 + 2.0 * (1.5**2 - 1))
    assert scores[2, EOS].item() == float("-inf")  # still in the min phase


def test_processing_matches_hf_processors_row_by_row() -> None:
    logits = random_logits(5, seed=5)
    ids = (3, 9, 9, 40)
    params = [
        SamplingParams(repetition_penalty=1.3),
        SamplingParams(temperature=0.7, top_k=20, top_p=0.9, seed=1),
        SamplingParams(temperature=1.0, typical_p=0.8, seed=2),
        SamplingParams(temperature=1.2, top_p=0.5, repetition_penalty=0.8, seed=3),
        SamplingParams(length_penalty=LengthPenalty(1, 1.2), temperature=0.5, top_k=7, seed=4),
    ]
    generated = 3
    _, scores = run(logits.clone(), rows_of(*params, ids=ids, generated=generated))
    input_ids = torch.tensor([ids])
    for row, p in enumerate(params):
        expected = logits[row : row + 1].clone()
        if p.length_penalty is not None:
            lp = ExponentialDecayLengthPenalty(
                (p.length_penalty.start_index, p.length_penalty.decay_factor),
                EOS,
                input_ids_seq_length=len(ids) - generated,
            )
            expected = lp(input_ids, expected)
        if p.repetition_penalty != 1.0:
            expected = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(input_ids, expected)
        processors: list[Any] = []
        if not p.is_greedy:
            processors.append(TemperatureLogitsWarper(p.temperature))
            if p.top_k:
                processors.append(TopKLogitsWarper(p.top_k))
            if p.top_p < 1:
                processors.append(TopPLogitsWarper(p.top_p))
            if p.typical_p < 1:
                processors.append(TypicalLogitsWarper(p.typical_p))
        for proc in processors:
            expected = proc(input_ids, expected)
        torch.testing.assert_close(scores[row : row + 1], expected, msg=f"row {row}")
    assert (scores[1] > float("-inf")).sum() < 20  # the warpers really filtered


def test_rank_and_top_n_follow_tgis_rules() -> None:
    scores = torch.tensor([[3.0, 5.0, 5.0, 5.0, 1.0, float("-inf")]])
    with_lp = DetailOptions(logprobs=True, ranks=True, top_n=2)
    (d,) = token_details(scores, torch.tensor([4]), [with_lp])
    assert d.rank == 5  # 1 + four strictly greater scores
    assert [t.token_id for t in d.top_tokens] == [1, 2, 3]  # ties with the 2nd best included
    expected = torch.log_softmax(scores[0], dim=-1)
    assert d.logprob == pytest.approx(expected[4].item())
    (d,) = token_details(scores, torch.tensor([2]), [with_lp])
    assert d.rank == 1  # ties share a rank
    # n-th best is -inf: only finite entries; without logprobs: id order and logprob 0.
    (d,) = token_details(scores, torch.tensor([0]), [DetailOptions(top_n=6)])
    assert [t.token_id for t in d.top_tokens] == [0, 1, 2, 3, 4]
    assert all(t.logprob == 0.0 for t in d.top_tokens) and d.logprob == 0.0 and d.rank == 0
    # Capped at 4n entries.
    (d,) = token_details(torch.zeros(1, 20), torch.tensor([0]), [DetailOptions(top_n=1)])
    assert [t.token_id for t in d.top_tokens] == [0, 1, 2, 3]
    # Sorted by logprob, lower id first on ties.
    (d,) = token_details(
        torch.tensor([[1.0, 2.0, 4.0, 2.0]]), torch.tensor([0]), [DetailOptions(True, top_n=3)]
    )
    assert [t.token_id for t in d.top_tokens] == [2, 1, 3]


def test_rows_without_options_get_bare_tokens() -> None:
    scores = random_logits(2)
    details = token_details(scores, torch.tensor([1, 2]), [None, DetailOptions(ranks=True)])
    assert details[0].logprob == 0.0 and details[0].rank == 0 and not details[0].top_tokens
    assert details[1].rank >= 1 and details[1].logprob == 0.0
    assert math.isnan(first_input_detail(5, DetailOptions(logprobs=True)).logprob)
    assert first_input_detail(5, DetailOptions()).logprob == 0.0
