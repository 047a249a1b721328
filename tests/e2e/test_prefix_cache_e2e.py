"""Prefix caching through the launcher: the same server with the cache on (the default) and
off (``--disable-prefix-caching``) gives the same output for prompts that share long
beginnings: greedy and seeded, batched and streamed, with a LoRA adapter and with a
prompt prefix, input-token details included, under a KV budget small enough that cached
blocks are evicted and running requests preempted. The cache's counters are checked
against the hits this module computes itself.

Both servers run float32, so the oracle (the server without the cache) computes the same
numbers up to the order of the attention's sums.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from tests.e2e.models import save_tiny_llama
from tests.e2e.probes import metric_sample
from tests.e2e.server import LauncherProcess, healthy_launcher
from tests.lora_oracle import save_random_lora
from tgis.pb import generation_pb2 as pb
from tgis.pb import generation_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow

BLOCK_SIZE = 16  # the CPU engine's
KV_BLOCKS = 40  # 640 tokens: four long prompts at once preempt, new ones evict
SYSTEM = "You are a careful assistant. Answer in one short sentence, and cite the page. " * 3
QUESTIONS = ["What is a block?", "Who computes the keys?", "Why cache?", "How long is it?"]
NEW_TOKENS = 12
HIDDEN = 64


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("cache-llama")
    save_tiny_llama(path)
    return path


@pytest.fixture(scope="module")
def stores(model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    adapters = tmp_path_factory.mktemp("cache-adapters")
    save_random_lora(model, adapters / "lora-a", seed=1, r=8, alpha=16)
    save_random_lora(model, adapters / "lora-b", seed=2, r=8, alpha=16)
    prefixes = tmp_path_factory.mktemp("cache-prefixes")
    (prefixes / "tuned").mkdir()
    embeddings = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(4))
    torch.save(embeddings, prefixes / "tuned" / "decoder.pt")
    return {
        "ADAPTER_CACHE": str(adapters),
        "PREFIX_STORE_PATH": str(prefixes),
        "TGIS_KV_CACHE_BLOCKS": str(KV_BLOCKS),
    }


def launch(
    model: Path, stores: dict[str, str], log_dir: Path, *flags: str
) -> Iterator[LauncherProcess]:
    args = ["--model-name", str(model), "--dtype", "float32", "--max-sequence-length", "256"]
    with healthy_launcher(log_dir, [*args, *flags], env=stores) as launcher:
        yield launcher


@pytest.fixture(scope="module")
def cached(
    model: Path, stores: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LauncherProcess]:
    yield from launch(model, stores, tmp_path_factory.mktemp("cached"))


@pytest.fixture(scope="module")
def uncached(
    model: Path, stores: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LauncherProcess]:
    yield from launch(
        model, stores, tmp_path_factory.mktemp("uncached"), "--disable-prefix-caching"
    )


def stub_of(server: LauncherProcess) -> Iterator[pb_grpc.GenerationServiceStub]:
    with grpc.insecure_channel(server.grpc_target) as channel:
        yield pb_grpc.GenerationServiceStub(channel)


def params(seeded: bool, details: bool = False) -> pb.Parameters:
    stopping = pb.StoppingCriteria(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
    response = pb.ResponseOptions(generated_tokens=True, token_logprobs=True, token_ranks=True)
    if details:
        response = pb.ResponseOptions(
            input_tokens=True, generated_tokens=True, token_logprobs=True, token_ranks=True
        )
    if not seeded:
        return pb.Parameters(method=pb.GREEDY, stopping=stopping, response=response)
    sampling = pb.SamplingParameters(temperature=0.9, top_k=40, seed=21)
    return pb.Parameters(method=pb.SAMPLE, sampling=sampling, stopping=stopping, response=response)


def outcome(response: Any) -> tuple[str, list[int], list[int], int]:
    return (
        response.text,
        [t.rank for t in response.tokens],
        [t.rank for t in response.input_tokens],
        response.generated_token_count,
    )


def generate(server: LauncherProcess, texts: list[str], **fields: Any) -> list[Any]:
    """One batched Generate call; the responses."""
    extra = {k: v for k, v in fields.items() if k in ("adapter_id", "prefix_id")}
    request = pb.BatchedGenerationRequest(
        requests=[pb.GenerationRequest(text=t) for t in texts],
        params=fields.get("params", params(False)),
        **extra,
    )
    for stub in stub_of(server):
        return list(stub.Generate(request, timeout=120).responses)
    raise AssertionError


def stream(server: LauncherProcess, text: str, parameters: pb.Parameters) -> Any:
    """A GenerateStream call folded into one response-like record."""
    request = pb.SingleGenerationRequest(request=pb.GenerationRequest(text=text), params=parameters)
    for stub in stub_of(server):
        messages = list(stub.GenerateStream(request, timeout=120))
        folded = pb.GenerationResponse()
        for message in messages:
            folded.text += message.text
            folded.tokens.extend(message.tokens)
            folded.input_tokens.extend(message.input_tokens)
            folded.generated_token_count = message.generated_token_count
        return folded
    raise AssertionError


def hits(server: LauncherProcess) -> float:
    return metric_sample(server, "tgi_prefix_cache_hits") or 0.0


def assert_same(got: list[Any], want: list[Any]) -> None:
    assert [outcome(r) for r in got] == [outcome(r) for r in want]
    for g, w in zip(got, want, strict=True):
        for a, b in zip(
            list(g.tokens) + list(g.input_tokens),
            list(w.tokens) + list(w.input_tokens),
            strict=True,
        ):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-3, nan_ok=True)


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
@pytest.mark.parametrize(
    "fields",
    [{}, {"adapter_id": "lora-a"}, {"prefix_id": "tuned"}],
    ids=["base", "lora", "prefix"],
)
def test_shared_prompts_give_what_they_give_without_the_cache(
    cached: LauncherProcess, uncached: LauncherProcess, seeded: bool, fields: dict[str, str]
) -> None:
    """Batched, then each prompt again streamed: the second time every prompt finds the
    shared system text (and its own question) cached."""
    texts = [SYSTEM + q for q in QUESTIONS[:2]]
    parameters = params(seeded)
    before = hits(cached)
    for _ in range(2):
        assert_same(
            generate(cached, texts, params=parameters, **fields),
            generate(uncached, texts, params=parameters, **fields),
        )
    for text in texts:
        assert_same([stream(cached, text, parameters)], [stream(uncached, text, parameters)])
    assert hits(cached) > before
    assert hits(uncached) == 0


def test_adapters_and_the_base_model_never_share_blocks(
    cached: LauncherProcess, uncached: LauncherProcess
) -> None:
    """One prompt under two LoRA adapters and none, each twice, interleaved: every run
    equals the uncached server's for the same adapter."""
    text = SYSTEM + "Which adapter answers?"
    for _ in range(2):
        for fields in ({"adapter_id": "lora-a"}, {}, {"adapter_id": "lora-b"}):
            assert_same(generate(cached, [text], **fields), generate(uncached, [text], **fields))


def test_input_token_details_are_computed_not_cached(
    cached: LauncherProcess, uncached: LauncherProcess
) -> None:
    text = SYSTEM + "Details, please."
    generate(cached, [text])  # its blocks are cached now
    before = hits(cached)
    wanted = params(False, details=True)
    got = generate(cached, [text], params=wanted)
    assert_same(got, generate(uncached, [text], params=wanted))
    assert len(got[0].input_tokens) > 3 * BLOCK_SIZE
    assert hits(cached) == before, "a request for input-token details read the cache"


def test_counters_match_the_hits_computed_here(cached: LauncherProcess) -> None:
    """A fresh prompt of n tokens: n queried, none hit; again: n queried, and every whole
    block of its first n - 1 tokens hit."""
    text = "A prompt nobody sent before, counted token by token. " * 4
    for stub in stub_of(cached):
        request = pb.BatchedTokenizeRequest(requests=[pb.TokenizeRequest(text=text)])
        n = stub.Tokenize(request).responses[0].token_count
    queried = metric_sample(cached, "tgi_prefix_cache_queries") or 0.0
    before = hits(cached)
    generate(cached, [text])
    assert metric_sample(cached, "tgi_prefix_cache_queries") == queried + n
    assert hits(cached) == before
    generate(cached, [text])
    assert metric_sample(cached, "tgi_prefix_cache_queries") == queried + 2 * n
    assert hits(cached) == before + (n - 1) // BLOCK_SIZE * BLOCK_SIZE
    cached_blocks = metric_sample(cached, "tgi_prefix_cache_blocks") or 0.0
    assert (n - 1) // BLOCK_SIZE <= cached_blocks <= KV_BLOCKS


def test_eviction_and_preemption_under_a_small_kv_budget(
    cached: LauncherProcess, uncached: LauncherProcess
) -> None:
    """Sixteen prompts in one batch in 40 blocks, of lengths that cross a block boundary
    while they decode (preemption), then new prompts that evict the cached ones, then the
    first ones again: always the uncached server's output."""
    first = [f"Question {i}: " + "say it again " * (10 + i) for i in range(16)]
    later = [f"An unrelated prompt number {i}. " * 9 for i in range(6)]
    preempted = metric_sample(cached, "tgi_request_preemption_count") or 0.0
    for prompts in (first, later, first):
        assert_same(generate(cached, prompts), generate(uncached, prompts))
    assert (metric_sample(cached, "tgi_request_preemption_count") or 0.0) > preempted
    assert (metric_sample(cached, "tgi_kv_cache_used_blocks") or 0.0) == 0


def tokenize_with(server: LauncherProcess, adapter_id: str) -> None:
    """A Tokenize call naming ``adapter_id``: the shard loads the adapter on the way."""
    request = pb.BatchedTokenizeRequest(
        requests=[pb.TokenizeRequest(text="hi")], adapter_id=adapter_id
    )
    for stub in stub_of(server):
        stub.Tokenize(request, timeout=60)


def test_an_adapter_rewritten_in_its_store_never_meets_its_old_blocks(
    cached: LauncherProcess, uncached: LauncherProcess, model: Path, stores: dict[str, str]
) -> None:
    """An adapter is served (its blocks cached), rewritten under the same id, and pushed
    out of the shard's adapter cache by eight others: the next request finds other contents
    than the router looked up and fails alone, saying so; the one after it is served with
    the new contents, exactly as the server without the cache serves them."""
    root = Path(stores["ADAPTER_CACHE"])
    save_random_lora(model, root / "swap", seed=5, r=8, alpha=16)
    text = SYSTEM + "Which version answers?"
    old = generate(cached, [text], adapter_id="swap")
    assert generate(cached, [text], adapter_id="swap")[0].text == old[0].text  # from cache
    save_random_lora(model, root / "swap", seed=6, r=8, alpha=16)
    for i in range(8):  # the shard keeps --max-loras (8) LoRA adapters
        save_random_lora(model, root / f"filler-{i}", seed=10 + i, r=8, alpha=16)
        tokenize_with(cached, f"filler-{i}")
    with pytest.raises(grpc.RpcError) as refused:
        generate(cached, [text], adapter_id="swap")
    assert refused.value.code() == grpc.StatusCode.UNKNOWN
    assert "adapter 'swap' changed in its store" in (refused.value.details() or "")
    new = generate(cached, [text], adapter_id="swap")
    assert_same(new, generate(uncached, [text], adapter_id="swap"))
    assert [t.logprob for t in new[0].tokens] != [t.logprob for t in old[0].tokens]
