"""The model runner against Hugging Face's LlamaForCausalLM: batching, chunking, details."""

from __future__ import annotations

import math
import random

import pytest
import torch

from tests.shard.driving import Router
from tests.shard.models import EOS, TinyModel
from tgis.shard_api.messages import DetailOptions, SamplingParams

NEW_TOKENS = 12


def prompt_of(length: int, seed: int) -> list[int]:
    """A random prompt of token ids (avoiding the EOS id)."""
    rng = random.Random(seed)
    return [rng.randrange(3, 256) for _ in range(length)]


PROMPTS = {1: prompt_of(3, 1), 2: prompt_of(11, 2), 3: prompt_of(29, 3)}
LOGPROBS = DetailOptions(logprobs=True, ranks=True, generated_tokens=True)


def test_batched_greedy_matches_hf_token_for_token(router: Router, tiny_model: TinyModel) -> None:
    for rid, prompt in PROMPTS.items():
        router.add(rid, prompt, details=LOGPROBS)
    out = router.step({rid: len(p) for rid, p in PROMPTS.items()})
    assert sorted(t.request_id for t in out.tokens) == [1, 2, 3]
    assert out.forward_time_ns > 0
    for _ in range(NEW_TOKENS - 1):
        router.decode(PROMPTS)

    for rid, prompt in PROMPTS.items():
        expected, logits = tiny_model.greedy(prompt, NEW_TOKENS)
        assert router.generated[rid] == expected, f"request {rid}"
        details = [t.token for o in router.outputs for t in o.tokens if t.request_id == rid]
        for detail, step_logits in zip(details, logits, strict=True):
            ref = torch.log_softmax(step_logits, dim=-1)[detail.token_id].item()
            assert abs(detail.logprob - ref) < 1e-4
            assert detail.rank == 1  # greedy picks the best-scored token


def test_sequence_joining_mid_decode_matches_hf(router: Router, tiny_model: TinyModel) -> None:
    router.add(1, PROMPTS[1])
    router.add(2, PROMPTS[2])
    router.step({1: len(PROMPTS[1]), 2: len(PROMPTS[2])})
    for _ in range(4):
        router.decode([1, 2])
    # Request 3 prefills in the same step as 1 and 2 decode.
    router.add(3, PROMPTS[3])
    out = router.step({1: 1, 2: 1, 3: len(PROMPTS[3])})
    assert len(out.tokens) == 3
    while len(router.generated[3]) < NEW_TOKENS:
        active = [rid for rid in (1, 2, 3) if len(router.generated[rid]) < NEW_TOKENS]
        router.decode(active)
    for rid, prompt in PROMPTS.items():
        assert router.generated[rid] == tiny_model.greedy(prompt, NEW_TOKENS)[0], f"request {rid}"


def test_freed_blocks_are_reused_without_stale_state(router: Router, tiny_model: TinyModel) -> None:
    router.add(1, PROMPTS[3])
    router.step({1: len(PROMPTS[3])})
    for _ in range(5):
        router.decode([1])
    router.finish(1)
    # Same request id again after it was finished, on recycled blocks.
    router.add(1, PROMPTS[2])
    router.step({1: len(PROMPTS[2])})
    for _ in range(NEW_TOKENS - 1):
        router.decode([1])
    assert router.generated[1] == tiny_model.greedy(PROMPTS[2], NEW_TOKENS)[0]
    assert set(router.runner.sequences) == {1}


def test_chunked_prefill_matches_one_shot(router: Router, tiny_model: TinyModel) -> None:
    prompt = PROMPTS[3]  # 29 tokens in chunks of 10, 10 and 9
    router.add(2, PROMPTS[2])
    router.step({2: len(PROMPTS[2])})
    router.add(3, prompt)
    for chunk in (10, 10):
        out = router.step({2: 1, 3: chunk})
        assert [t.request_id for t in out.tokens] == [2]  # mid-prompt: no token for 3
    out = router.step({2: 1, 3: 9})
    assert sorted(t.request_id for t in out.tokens) == [2, 3]
    for _ in range(NEW_TOKENS - 1):
        router.decode([3])
    assert router.generated[3] == tiny_model.greedy(prompt, NEW_TOKENS)[0]
    assert router.generated[2] == tiny_model.greedy(PROMPTS[2], NEW_TOKENS)[0][:4]


def test_input_token_details_match_hf_and_survive_chunking(
    make_runner, tiny_model: TinyModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Logits of prompt positions are materialised 4 rows at a time: exercise the seams.
    monkeypatch.setattr("tgis.shard.native.runtime.model_runner.INPUT_DETAIL_ROWS", 4)
    prompt = PROMPTS[3]
    options = DetailOptions(logprobs=True, ranks=True, top_n=3, input_tokens=True)
    results = []
    for chunks in ([29], [7, 16, 6]):
        router = Router(make_runner())
        router.add(5, prompt, details=options)
        for i, chunk in enumerate(chunks):
            out = router.step({5: chunk})
            assert bool(out.input_tokens) == (i == len(chunks) - 1)
        (details,) = out.input_tokens
        assert details.request_id == 5
        results.append(details.tokens)
    one_shot, chunked = results
    assert len(one_shot) == len(prompt)
    assert [d.token_id for d in one_shot] == prompt
    assert math.isnan(one_shot[0].logprob) and one_shot[0].rank == 0
    assert not one_shot[0].top_tokens
    logits = tiny_model.prompt_logits(prompt)
    logprobs = torch.log_softmax(logits, dim=-1)
    for i in range(1, len(prompt)):
        detail = one_shot[i]
        assert abs(detail.logprob - logprobs[i - 1, prompt[i]].item()) < 1e-4
        assert detail.rank == 1 + int((logits[i - 1] > logits[i - 1, prompt[i]]).sum())
        expected_top = logprobs[i - 1].topk(3).indices.tolist()
        assert [t.token_id for t in detail.top_tokens] == expected_top
    for a, b in zip(one_shot[1:], chunked[1:], strict=True):
        assert a.token_id == b.token_id and a.rank == b.rank
        assert abs(a.logprob - b.logprob) < 1e-5
        assert [t.token_id for t in a.top_tokens] == [t.token_id for t in b.top_tokens]


def test_seeded_sampling_is_reproducible_and_batch_independent(make_runner) -> None:
    sampled = SamplingParams(temperature=1.0, seed=1234)

    def run(seed_params: SamplingParams, with_neighbour: bool) -> list[int]:
        router = Router(make_runner())
        router.add(1, PROMPTS[2], sampling=seed_params)
        schedule = {1: len(PROMPTS[2])}
        if with_neighbour:
            router.add(2, PROMPTS[3], sampling=SamplingParams(temperature=0.7, seed=99))
            schedule[2] = len(PROMPTS[3])
        router.step(schedule)
        for _ in range(NEW_TOKENS - 1):
            router.decode(schedule)
        return router.generated[1]

    alone = run(sampled, with_neighbour=False)
    assert run(sampled, with_neighbour=True) == alone
    other = run(SamplingParams(temperature=1.0, seed=4321), with_neighbour=False)
    assert other != alone


def test_min_new_tokens_and_top_n_through_the_runner(router: Router) -> None:
    # Make EOS the likeliest token via a huge length penalty, but forbid it for 3 tokens.
    from tgis.shard_api.messages import LengthPenalty

    params = SamplingParams(
        min_new_tokens=3, length_penalty=LengthPenalty(start_index=0, decay_factor=1e6)
    )
    router.add(
        1, PROMPTS[2], sampling=params, details=DetailOptions(top_n=2, generated_tokens=True)
    )
    router.step({1: len(PROMPTS[2])})
    for _ in range(4):
        router.decode([1])
    tokens = router.generated[1]
    assert EOS not in tokens[:3]
    assert tokens[4] == EOS  # boosted once past the min phase (generated - start_index > 0)
    first = router.outputs[0].tokens[0].token
    # top_n without logprobs: ids in ascending order, logprob 0.
    ids = [t.token_id for t in first.top_tokens]
    assert len(ids) == 2 and ids == sorted(ids)
    assert all(t.logprob == 0.0 for t in first.top_tokens)
