"""The shard's half of speculative decoding: a decode step with drafted tokens returns
exactly the tokens (and token details) plain decoding returns, however good or bad the
drafts; a plan that misuses drafts is refused. Oracle: the same sequences decoded one token
per step."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.shard.driving import Router
from tests.shard.models import NUM_BLOCKS, TinyModel, build_tiny_llama
from tgis.shard.checkpoints.model_config import ModelConfig
from tgis.shard.config import EngineSettings, ShardConfig
from tgis.shard.errors import InvalidStepError, StartupError
from tgis.shard.loader import load_runner
from tgis.shard.native.attention.selection import start_attention_backend
from tgis.shard.native.graphs.cuda_graphs import DecodeGraphs, graph_buckets
from tgis.shard.native.runtime.model_runner import ModelRunner
from tgis.shard.native.speculation.draft_loading import LoadedDraft, load_draft
from tgis.shard.native.speculation.draft_model import DraftModel
from tgis.shard.parallel.group import SINGLE, TensorParallel
from tgis.shard.step.plan import WorkItem
from tgis.shard.step.sequence import Sequence
from tgis.shard.step.speculation import accepted_run, verify_drafts
from tgis.shard_api.messages import (
    DetailOptions,
    LengthPenalty,
    ModelKind,
    SamplingParams,
    ScheduledSequence,
    ShardInfo,
    StepPlan,
)

DETAILS = DetailOptions(logprobs=True, ranks=True, top_n=3, generated_tokens=True)
MODES = {
    "greedy": SamplingParams(),
    "seeded": SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=11),
    "penalties": SamplingParams(
        temperature=0.7,
        seed=5,
        repetition_penalty=1.3,
        length_penalty=LengthPenalty(start_index=3, decay_factor=1.2),
    ),
    "min_new_tokens": SamplingParams(min_new_tokens=12, repetition_penalty=1.1),
}
PROMPTS = {1: [5, 9, 13, 5, 9, 13, 5, 9], 2: list(range(30, 51)), 3: [7, 7, 7]}
NEW_TOKENS = 14
CPU = torch.device("cpu")
Drafter = Callable[[int, list[int], random.Random], list[int]]


@pytest.fixture(scope="module")
def other_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Another tiny random Llama of the same vocabulary (a draft model that guesses badly)."""
    path = tmp_path_factory.mktemp("draft-llama")
    build_tiny_llama(path, seed=7)
    return path


def prefilled(runner: ModelRunner, sampling: SamplingParams) -> Router:
    """A router whose PROMPTS have been computed in one step (each has its first token)."""
    router = Router(runner)
    for rid, prompt in PROMPTS.items():
        router.add(rid, prompt, sampling, DETAILS)
    router.step({rid: len(p) for rid, p in PROMPTS.items()})
    return router


def plain(runner: ModelRunner, sampling: SamplingParams) -> dict[int, list[object]]:
    """Every sequence's generated token details, one decode step at a time."""
    router = prefilled(runner, sampling)
    for _ in range(NEW_TOKENS - 1):
        router.decode(PROMPTS)
    return details_by_request(router)


def details_by_request(router: Router) -> dict[int, list[object]]:
    result: dict[int, list[object]] = {rid: [] for rid in PROMPTS}
    for output in router.outputs:
        for sampled in output.tokens:
            result[sampled.request_id].append(sampled.token)
    return result


def speculated(
    runner: ModelRunner,
    sampling: SamplingParams,
    draft: Drafter,
) -> tuple[dict[int, list[object]], int, int]:
    """The same sequences with drafts from ``draft(rid, generated so far, rng)`` at every
    decode step, until each has at least NEW_TOKENS tokens; (details, drafted, accepted)."""
    rng = random.Random(3)
    router = prefilled(runner, sampling)
    drafted = accepted = 0
    while live := [r for r in PROMPTS if len(router.generated[r]) < NEW_TOKENS]:
        drafts = {rid: draft(rid, router.generated[rid], rng) for rid in live}
        before = {rid: len(router.generated[rid]) for rid in live}
        router.speculate(drafts)
        for rid in live:
            got = len(router.generated[rid]) - before[rid]
            assert 1 <= got <= len(drafts[rid]) + 1
            drafted += len(drafts[rid])
            accepted += got - 1
    return details_by_request(router), drafted, accepted


def assert_same(got: dict[int, list[object]], want: dict[int, list[object]]) -> None:
    for rid in PROMPTS:
        common = min(len(got[rid]), len(want[rid]))
        assert common >= NEW_TOKENS
        a, b = got[rid][:common], want[rid][:common]
        assert [t.token_id for t in a] == [t.token_id for t in b], rid  # type: ignore[attr-defined]
        for x, y in zip(a, b, strict=True):
            assert x.logprob == pytest.approx(y.logprob, abs=1e-4)  # type: ignore[attr-defined]
            assert x.rank == y.rank  # type: ignore[attr-defined]
            assert [t.token_id for t in x.top_tokens] == [t.token_id for t in y.top_tokens]  # type: ignore[attr-defined]


def oracle_drafts(want: dict[int, list[object]]) -> Drafter:
    """Drafts of the true next tokens (``want``'s), one of them replaced now and then, 0 to
    4 of them."""
    future = {rid: [t.token_id for t in tokens] for rid, tokens in want.items()}  # type: ignore[attr-defined]

    def oracle(rid: int, generated: list[int], rng: random.Random) -> list[int]:
        k = rng.choice([0, 1, 3, 4])
        drafts = future[rid][len(generated) : len(generated) + k]
        if drafts and rng.random() < 0.4:
            drafts[rng.randrange(len(drafts))] = rng.randrange(3, 200)
        return drafts

    return oracle


def noise(rid: int, generated: list[int], rng: random.Random) -> list[int]:
    """1 to 4 random drafts."""
    return [rng.randrange(3, 200) for _ in range(rng.choice([1, 2, 4]))]


@pytest.mark.parametrize("mode", sorted(MODES))
def test_drafts_right_wrong_or_mixed_give_the_plain_tokens(
    make_runner: Callable[..., ModelRunner], mode: str
) -> None:
    sampling = MODES[mode]
    runner = make_runner()
    want = plain(runner, sampling)
    oracle = oracle_drafts(want)
    for draft in (oracle, noise):
        runner.reset()
        got, drafted, accepted = speculated(runner, sampling, draft)
        assert_same(got, want)
        if draft is oracle:
            assert accepted > drafted // 3, (accepted, drafted)


def test_accepted_run() -> None:
    assert accepted_run([4, 9, 2], [4, 9]) == 3  # both drafts confirmed, plus the bonus
    assert accepted_run([4, 9, 2], [4, 8]) == 2
    assert accepted_run([5, 9, 2], [4, 9]) == 1  # the first token differs from draft 1
    assert accepted_run([7], []) == 1


class DirectReplay:
    """A captured CUDA graph's stand-in on the CPU: a replay runs the forward over the
    graphs' static buffers, which is what the captured kernels compute (on a GPU the
    start-up check, ``DecodeGraphs.verify``, compares the two)."""

    def __init__(self, graphs: DecodeGraphs, bucket: int, replays: list[tuple[int, int]]):
        self.graphs, self.bucket, self.replays = graphs, bucket, replays

    def replay(self) -> None:
        self.replays.append((self.graphs.width, self.bucket))
        self.graphs.outputs[self.bucket] = self.graphs._run_forward(self.bucket)


@pytest.fixture(scope="module")
def one_layer_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with one decoder layer, for the steps staged for graphs: on the CPU
    Triton's interpreter runs each layer's attention kernels program by program in Python,
    and a second layer (the same staging, the same buffers) doubled their time."""
    path = tmp_path_factory.mktemp("one-layer-llama")
    build_tiny_llama(path, num_hidden_layers=1)
    return path


@pytest.mark.parametrize("mode", ["greedy", "penalties"])
def test_verify_steps_staged_for_graphs_give_the_plain_tokens(
    one_layer_model: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """Decode and verify steps staged into the graphs' static buffers (each sequence's rows
    padded to 1 + 4, Triton's kernels interpreted on the CPU) give the tokens and details
    of the plain, eager decoding."""
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    config = ShardConfig(
        model_name=str(one_layer_model),
        kv_cache_blocks=NUM_BLOCKS,
        engine=EngineSettings(attention_backend="triton_paged"),
    )
    runner = load_runner(config)
    assert isinstance(runner, ModelRunner)
    assert runner.info.attention_backend == "triton_paged"
    want = plain(runner, MODES[mode])
    replays: list[tuple[int, int]] = []
    sets = []
    for width in (1, 5):
        graphs = DecodeGraphs(
            runner.forward,
            runner.kv_cache,
            CPU,
            graph_buckets(4),
            256,
            runner.info.vocab_size,
            width,
        )
        graphs.graphs = {b: DirectReplay(graphs, b, replays) for b in graphs.buckets}  # type: ignore[misc]
        sets.append(graphs)
    runner.graph_sets = tuple(sets)
    for draft in (oracle_drafts(want), noise):
        runner.reset()
        got, _, _ = speculated(runner, MODES[mode], draft)
        assert_same(got, want)
    # Three sequences replay bucket 4, fewer once some have finished.
    assert (5, 4) in replays and {bucket for _, bucket in replays} <= {1, 2, 4}
    assert {width for width, _ in replays} == {1, 5}  # steps without drafts: decode graphs


def test_misused_drafts_are_refused(router: Router, runner: ModelRunner) -> None:
    router.add(1, [5, 6, 7])
    plan = StepPlan(1, tuple(router.pending), (ScheduledSequence(1, 3, (0,), 0, (8,)),))
    with pytest.raises(InvalidStepError, match="the sequence is not decoding"):
        runner.step(plan)
    router.step({1: 3})
    for scheduled, message in [
        (ScheduledSequence(1, 3, (), 0, (8,)), "num_tokens 3 is not 1 \\+ 1 drafts"),
        (ScheduledSequence(1, 2, (), 0, (10**6,)), "a draft id is out of range"),
    ]:
        with pytest.raises(InvalidStepError, match=message):
            runner.step(StepPlan(router.step_id + 1, (), (scheduled,)))
    assert router.decode([1]).tokens  # nothing changed: decoding goes on


# ---- unseeded sampling keeps the distribution ------------------------------------------------

CHI_SQUARE_99_9 = {9: 27.877}
"""The 99.9th percentile of the chi-square distribution with 9 degrees of freedom."""


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_unseeded_sampling_with_drafts_keeps_the_target_distribution() -> None:
    """Vocabulary of 10, fixed logits per position, a draft of token 3 after the last known
    token, 20,000 sequences each with its own random seed (what an unseeded request gets):
    the first token follows the first position's distribution, and the second (there when
    the draft was confirmed) the second position's."""
    vocab, count = 10, 20_000
    generator = torch.Generator().manual_seed(0)
    first_logits, second_logits = torch.randn(2, vocab, generator=generator) * 1.5
    sampling = SamplingParams(temperature=1.0)
    rng = random.Random(1)
    items = []
    for rid in range(count):
        seq = Sequence(rid, [1, 2, 7], 2, sampling, DetailOptions(), seed=rng.getrandbits(63))
        items.append(WorkItem.plan(seq, 2, start=2, drafts=(3,)))
    logits = torch.stack([first_logits, second_logits]).repeat(count, 1)
    info = ShardInfo(
        ModelKind.CAUSAL_LM, (99,), vocab, 16, 1, 1, 64, "test", "float32", "cpu", "none"
    )
    verified, errors = verify_drafts(logits, items, info)
    assert not errors
    first = torch.tensor([tokens[0].token_id for tokens in verified.values()])
    second = torch.tensor([tokens[1].token_id for tokens in verified.values() if len(tokens) > 1])
    assert len(second) == int((first == 3).sum())  # confirmed exactly when token 1 was 3
    for tokens, position_logits in ((first, first_logits), (second, second_logits)):
        counts = torch.bincount(tokens, minlength=vocab).double()
        statistic = chi_square(counts, position_logits.double().softmax(-1))
        assert statistic < CHI_SQUARE_99_9[9], statistic


# ---- a draft model on the shard ----------------------------------------------------------------


def other_runner(path: Path) -> ModelRunner:
    runner = load_runner(ShardConfig(model_name=str(path), kv_cache_blocks=NUM_BLOCKS))
    assert isinstance(runner, ModelRunner)
    return runner


def attach_draft(runner: ModelRunner, draft_runner: ModelRunner) -> None:
    """Give ``runner`` ``draft_runner``'s model as its draft model, with a KV cache of
    ``runner``'s number of blocks."""
    cache = draft_runner.kv_cache
    assert cache.num_blocks == runner.kv_cache.num_blocks
    runner.attach_draft(DraftModel(draft_runner.model, cache, runner.attention, runner.device))


@pytest.mark.parametrize("draft", ["same", "other"])
@pytest.mark.parametrize("mode", ["greedy", "seeded", "penalties"])
def test_a_draft_model_gives_the_plain_tokens(
    make_runner: Callable[..., ModelRunner],
    other_model: Path,
    draft: str,
    mode: str,
) -> None:
    """The target itself as its draft model (greedy drafts are its own greedy choices:
    nearly all confirmed) and another random model (few confirmed): the plain tokens and
    details either way, the draft cache kept up across steps, preemption and resumption."""
    sampling = MODES[mode]
    runner = make_runner()
    want = plain(runner, sampling)
    runner.reset()
    helper = make_runner() if draft == "same" else other_runner(other_model)
    attach_draft(runner, helper)
    assert runner.info.draft_model
    rng = random.Random(5)
    router = prefilled(runner, sampling)
    drafted = accepted = 0
    preempted = False
    while live := [r for r in PROMPTS if len(router.generated[r]) < NEW_TOKENS]:
        if not preempted and len(router.generated[1]) >= 5:
            preempted = True
            router.preempt(1)  # recomputed below; its draft cache must be too
            known = len(PROMPTS[1]) + len(router.generated[1])
            router.step({1: known - 1})
            continue
        asked = {rid: rng.choice([1, 2, 4]) for rid in live}
        before = {rid: len(router.generated[rid]) for rid in live}
        router.speculate(asked)
        for rid in live:
            drafted += asked[rid]
            accepted += len(router.generated[rid]) - before[rid] - 1
    assert_same(details_by_request(router), want)
    if draft == "same" and mode == "greedy":
        assert accepted == drafted  # its own greedy choices, every one confirmed
    assert 0 <= accepted <= drafted


def test_a_draft_model_must_share_the_tokenizer_and_split_over_the_ranks(
    tiny_model: TinyModel, tmp_path: Path
) -> None:
    target = ModelConfig.from_dir(tiny_model.path)
    attention = start_attention_backend(CPU, 16, torch.float32)

    def load(name: str, tp: TensorParallel = SINGLE) -> object:
        config = ShardConfig(model_name=str(tiny_model.path), speculator_name=name)
        return load_draft(config, target, attention, CPU, torch.float32, tp)

    assert load("") is None
    loaded = load(str(tiny_model.path))
    assert isinstance(loaded, LoadedDraft) and loaded.spec.num_layers == 2
    assert loaded.spec.num_kv_heads == 2
    # With tensor parallelism each rank holds its slice: one of the two KV heads.
    second_rank = load(str(tiny_model.path), TensorParallel(rank=1, world_size=2))
    assert isinstance(second_rank, LoadedDraft) and second_rank.spec.num_kv_heads == 1
    with pytest.raises(StartupError, match=r"speculator .*not divisible by the number of shards"):
        load(str(tiny_model.path), TensorParallel(rank=0, world_size=3))
    wide = tmp_path / "wide"
    build_tiny_llama(wide, vocab_size=target.vocab_size + 64)
    with pytest.raises(StartupError, match="must share the model's tokenizer"):
        load(str(wide))
    first, second = tmp_path / "first", tmp_path / "second"
    for path, text in ((first, '{"model": {"vocab": {"a": 0}}}'), (second, '{"model": {}}')):
        build_tiny_llama(path)
        (path / "tokenizer.json").write_text(text)
    config = ShardConfig(model_name=str(first), speculator_name=str(second))
    with pytest.raises(StartupError, match=r"tokenizer\.json differs"):
        load_draft(config, ModelConfig.from_dir(first), attention, CPU, torch.float32)
    with pytest.raises(StartupError, match="speculator /nowhere"):
        load("/nowhere")
