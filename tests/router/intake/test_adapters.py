"""Adapters (``adapter_id``, vllm-tgis-adapter's field) through the router, end to end over
real gRPC, and the router's adapter cache on its own.

The stack is tests/router/stack.py's (the real router composed as ``server.py`` does, a
stand-in shard on Unix sockets), with a shard that has an adapter cache: it answers
``AdapterLookup`` with the real shard's statuses and messages, reports ``max_loras`` in
Info, and records which LoRA adapters each step contains.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from typing import Any

import grpc
import pytest

from tests.router.stack import (
    MAX_SEQUENCE_LENGTH,
    PrefixShard,
    Stack,
    details,
    refusal,
    run,
    stream_refusal,
)
from tgis.pb import generation_pb2 as pb
from tgis.pb import shard_pb2
from tgis.router.core.shard_client import AdapterLookupError, ShardError, ShardFailure
from tgis.router.errors import ValidationError
from tgis.router.intake.adapters import AdapterKinds, adapter_kinds
from tgis.router.intake.validation import check_adapter_id
from tgis.shard_api.codec import adapter_to_pb
from tgis.shard_api.messages import (
    AdapterInfo,
    AdapterKind,
    ModelKind,
    ShardInfo,
    StepOutput,
    StepPlan,
)

LORA = AdapterInfo(AdapterKind.LORA)
ADAPTERS = {
    "lora-a": LORA,
    "lora-b": LORA,
    "lora-c": LORA,
    "org/lora_d": LORA,
    "pt/tuned": AdapterInfo(AdapterKind.PROMPT_TUNING, 5),
    "pt-long": AdapterInfo(AdapterKind.PROMPT_TUNING, 40),
}
LORA_IDS = {k for k, v in ADAPTERS.items() if v.is_lora}
DISABLED = "adapter_id supplied but no adapter store was configured"
COMBINED = "prefix_id and a prompt-tuning adapter_id cannot be combined"
MALFORMED = "can't retrieve adapter with id 'malformed': invalid adapter: no lora_A weights"
REFUSALS = {
    "missing": (
        grpc.StatusCode.NOT_FOUND,
        "can't retrieve adapter with id 'missing': directory does not exist",
    ),
    "no-config": (
        grpc.StatusCode.NOT_FOUND,
        "can't retrieve adapter with id 'no-config': invalid adapter: no adapter_config.json found",
    ),
    "ia3": (grpc.StatusCode.INVALID_ARGUMENT, "adapter type IA3 is not currently supported"),
    "malformed": (grpc.StatusCode.INVALID_ARGUMENT, MALFORMED),
    "rank-refused": (grpc.StatusCode.FAILED_PRECONDITION, "rank 1 refused adapter rank-refused"),
}


def invalid_id(adapter_id: str) -> str:
    return f"Invalid adapter id '{adapter_id}', must contain only alphanumeric, _ and - and /"


class AdapterShard(PrefixShard):
    """PrefixShard with an adapter cache holding ``ADAPTERS``; each step takes 2 ms."""

    max_loras = 2

    def __init__(self, step_channel: str) -> None:
        super().__init__(step_channel)
        self.adapter_lookups: list[str] = []
        self.step_loras: list[set[str]] = []
        """The LoRA adapters of the sequences each step computes."""

    async def Info(self, request: Any, context: Any) -> shard_pb2.InfoResponse:
        info = await super().Info(request, context)
        info.adapters_enabled = True
        info.max_loras = self.max_loras
        return info

    async def AdapterLookup(
        self, request: shard_pb2.AdapterLookupRequest, context: grpc.aio.ServicerContext
    ) -> shard_pb2.AdapterLookupResponse:
        adapter_id = request.adapter_id
        self.adapter_lookups.append(adapter_id)
        if adapter_id in REFUSALS:
            await context.abort(*REFUSALS[adapter_id])
        if adapter_id == "broken":
            await context.abort(grpc.StatusCode.INTERNAL, "the adapter cache is broken")
        if adapter_id not in ADAPTERS:
            await context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"can't retrieve adapter with id '{adapter_id}': directory does not exist",
            )
        return adapter_to_pb(ADAPTERS[adapter_id])

    def step(self, plan: StepPlan) -> StepOutput:
        with self._lock:
            adapters = {rid: seq.new.adapter_id for rid, seq in self.sequences.items()}
        adapters.update((n.request_id, n.adapter_id) for n in plan.new_sequences)
        if plan.scheduled:
            scheduled = {adapters.get(c.request_id, "") for c in plan.scheduled}
            self.step_loras.append(scheduled & LORA_IDS)
        time.sleep(0.002)
        return super().step(plan)


class NoLoraShard(AdapterShard):
    """An adapter cache without LoRA support (``max_loras`` 0)."""

    max_loras = 0


def generate(text: str = "hello", **fields: Any) -> pb.BatchedGenerationRequest:
    return pb.BatchedGenerationRequest(requests=[pb.GenerationRequest(text=text)], **fields)


def single(text: str = "hello", **fields: Any) -> pb.SingleGenerationRequest:
    return pb.SingleGenerationRequest(request=pb.GenerationRequest(text=text), **fields)


def tokenize(*texts: str, **fields: Any) -> pb.BatchedTokenizeRequest:
    return pb.BatchedTokenizeRequest(
        requests=[pb.TokenizeRequest(text=t) for t in texts], return_tokens=True, **fields
    )


async def refusals(stack: Stack, **fields: Any) -> set[tuple[grpc.StatusCode, str]]:
    """What Generate, GenerateStream and Tokenize answer to ``fields`` (one answer)."""
    return {
        await refusal(stack.stub.Generate(generate(**fields))),
        await stream_refusal(stack.stub.GenerateStream(single(**fields))),
        await refusal(stack.stub.Tokenize(tokenize("hello", **fields))),
    }


# ---- refusals ----------------------------------------------------------------------------------


def test_an_adapter_without_an_adapter_store_is_refused_before_anything_else() -> None:
    async def scenario(stack: Stack) -> None:
        assert await refusals(stack, adapter_id="lora-a") == {
            (grpc.StatusCode.INVALID_ARGUMENT, DISABLED)
        }
        # Even an invalid id, even with a prefix: nothing is looked up.
        assert await refusals(stack, adapter_id="../x", prefix_id="sentiment") == {
            (grpc.StatusCode.INVALID_ARGUMENT, DISABLED)
        }
        assert not stack.shard.lookups and not stack.shard.new_sequences
        # An empty adapter_id is no adapter (as vllm-tgis-adapter reads it).
        response = await stack.stub.Generate(generate(adapter_id=""))
        assert response.responses[0].generated_token_count == 20
        (new,) = stack.shard.new_sequences
        assert (new.adapter_id, new.prefix_id, new.prefix_length) == ("", "", 0)

    run(scenario)


@pytest.mark.parametrize(
    "adapter_id", ["../x", "a/../b", "/abs", "/", "a b", "a.b", "é$", "x\\y", "a\n"]
)
def test_invalid_ids_are_refused_before_any_lookup(adapter_id: str) -> None:
    async def scenario(stack: Stack) -> None:
        assert await refusals(stack, adapter_id=adapter_id) == {
            (grpc.StatusCode.INVALID_ARGUMENT, invalid_id(adapter_id))
        }
        assert not stack.shard.adapter_lookups

    run(scenario, shard_class=AdapterShard)


def test_the_id_rule() -> None:
    for ok in ("lora-a", "org/lora_d", "a//b", "a/", "é", "x_1-2/y", "9"):
        check_adapter_id(ok)
    for bad in ("", "..", "a/..", "../a", "/a", "a b", "a:b", "a%2e", "a/..b"):
        with pytest.raises(ValidationError) as info:
            check_adapter_id(bad)
        assert info.value.message == invalid_id(bad)


@pytest.mark.parametrize("adapter_id", sorted(REFUSALS))
def test_the_shards_refusals_reach_the_client_verbatim(adapter_id: str) -> None:
    async def scenario(stack: Stack) -> None:
        message = REFUSALS[adapter_id][1]
        # NOT_FOUND and FAILED_PRECONDITION from the shard too: INVALID_ARGUMENT.
        assert await refusals(stack, adapter_id=adapter_id) == {
            (grpc.StatusCode.INVALID_ARGUMENT, message)
        }
        # Failures are not cached: each of the three calls asked the shard.
        assert stack.shard.adapter_lookups == [adapter_id] * 3
        assert not stack.shard.new_sequences

    run(scenario, shard_class=AdapterShard)


def test_a_failed_lookup_call_names_the_adapter() -> None:
    async def scenario(stack: Stack) -> None:
        assert await refusal(stack.stub.Generate(generate(adapter_id="broken"))) == (
            grpc.StatusCode.INVALID_ARGUMENT,
            "can't retrieve adapter with id 'broken': the adapter cache is broken",
        )

    run(scenario, shard_class=AdapterShard)


def test_a_prompt_tuning_adapter_and_a_prefix_cannot_be_combined() -> None:
    async def scenario(stack: Stack) -> None:
        assert await refusals(stack, adapter_id="pt/tuned", prefix_id="sentiment") == {
            (grpc.StatusCode.INVALID_ARGUMENT, COMBINED)
        }
        assert not stack.shard.lookups  # the prefix was never looked up
        assert stack.shard.adapter_lookups == ["pt/tuned"]  # cached after the first call
        # A bad prefix with a LoRA adapter fails as a bad prefix.
        assert await refusals(stack, adapter_id="lora-a", prefix_id="nope") == {
            (
                grpc.StatusCode.INVALID_ARGUMENT,
                "can't retrieve prompt prefix with id 'nope': prefix id \"nope\" not found",
            )
        }

    run(scenario, shard_class=AdapterShard)


def test_a_shard_without_lora_support_refuses_lora_adapters() -> None:
    async def scenario(stack: Stack) -> None:
        assert await refusals(stack, adapter_id="lora-a") == {
            (grpc.StatusCode.INVALID_ARGUMENT, "adapter type LORA is not currently supported")
        }
        response = await stack.stub.Generate(generate(adapter_id="pt/tuned"))
        assert response.responses[0].generated_token_count == 20

    run(scenario, shard_class=NoLoraShard)


# ---- LoRA adapters ------------------------------------------------------------------------------


def test_a_lora_adapter_goes_to_the_shard_with_no_virtual_tokens() -> None:
    async def scenario(stack: Stack) -> None:
        text = "The quick brown fox"
        ids = stack.tokenizer.encode(text)
        response = await stack.stub.Generate(
            generate(text, adapter_id="org/lora_d", params=details(input_tokens=True))
        )
        (r,) = response.responses
        assert r.input_token_count == len(ids) == len(r.input_tokens)
        assert r.generated_token_count == 5
        (new,) = stack.shard.new_sequences
        assert (new.adapter_id, new.prefix_id, new.prefix_length) == ("org/lora_d", "", 0)
        assert new.prompt_token_ids == tuple(ids)
        # The kind is cached: the next request does not ask the shard again.
        messages = [m async for m in stack.stub.GenerateStream(single(adapter_id="org/lora_d"))]
        assert messages[-1].generated_token_count == 20
        assert stack.shard.adapter_lookups == ["org/lora_d"]
        assert [n.adapter_id for n in stack.shard.new_sequences] == ["org/lora_d"] * 2

    run(scenario, shard_class=AdapterShard)


def test_a_lora_adapter_and_a_prefix_go_together() -> None:
    async def scenario(stack: Stack) -> None:
        text = "hello"
        n = len(stack.tokenizer.encode(text))
        response = await stack.stub.Generate(
            generate(text, adapter_id="lora-a", prefix_id="sentiment", params=details(True))
        )
        (r,) = response.responses
        assert r.input_token_count == n and len(r.input_tokens) == 6 + n
        (new,) = stack.shard.new_sequences
        assert (new.adapter_id, new.prefix_id, new.prefix_length) == ("lora-a", "sentiment", 6)
        assert (stack.shard.lookups, stack.shard.adapter_lookups) == (["sentiment"], ["lora-a"])

    run(scenario, shard_class=AdapterShard)


def test_no_step_holds_more_than_max_loras_adapters() -> None:
    async def scenario(stack: Stack) -> None:
        params = pb.Parameters(stopping=pb.StoppingCriteria(max_new_tokens=30))
        first = [
            asyncio.ensure_future(stack.stub.Generate(generate(adapter_id=a, params=params)))
            for a in ("lora-a", "lora-b")
        ]
        while len(stack.shard.new_sequences) < 2:
            await asyncio.sleep(0.001)
        later = [
            asyncio.ensure_future(stack.stub.Generate(generate(adapter_id=a, params=params)))
            for a in ("lora-c", "pt/tuned", "lora-a")
        ]
        for response in await asyncio.gather(*first, *later):
            assert response.responses[0].generated_token_count == 30
        steps = stack.shard.step_loras
        assert max(len(loras) for loras in steps) == 2
        first_c = next(i for i, loras in enumerate(steps) if "lora-c" in loras)
        assert {"lora-a", "lora-b"} in steps[:first_c]  # a and b ran together before c

    run(scenario, shard_class=AdapterShard)


# ---- prompt-tuning adapters ----------------------------------------------------------------------


def test_a_prompt_tuning_adapter_counts_as_a_prefix() -> None:
    async def scenario(stack: Stack) -> None:
        text = "The quick brown fox"
        ids = stack.tokenizer.encode(text)
        request = single(text, adapter_id="pt/tuned", params=details(True, max_new_tokens=3))
        header, inputs, *tokens = [m async for m in stack.stub.GenerateStream(request)]
        assert header.input_token_count == len(ids)  # without the virtual tokens
        assert inputs.input_token_count == len(ids) + 5 == len(inputs.input_tokens)
        assert tokens[-1].generated_token_count == 3
        (new,) = stack.shard.new_sequences
        assert (new.adapter_id, new.prefix_id, new.prefix_length) == ("pt/tuned", "", 5)
        assert new.prompt_token_ids == tuple(ids)
        first_chunk = stack.shard.chunks[0]
        assert first_chunk == (new.request_id, 5 + len(ids), -(-(5 + len(ids)) // 4))
        assert not stack.shard.lookups  # no prefix lookup

    run(scenario, shard_class=AdapterShard)


def test_a_prompt_tuning_adapter_counts_in_the_length_limits() -> None:
    async def scenario(stack: Stack) -> None:
        text = "The quick brown fox"
        n = len(stack.tokenizer.encode(text))
        request = single(text, adapter_id="pt-long", params=details(max_new_tokens=30))
        messages = [m async for m in stack.stub.GenerateStream(request)]
        assert messages[0].input_token_count == n
        assert messages[-1].stop_reason == pb.TOKEN_LIMIT
        assert messages[-1].generated_token_count == MAX_SEQUENCE_LENGTH - 40 - n
        long_text = " ".join(["word"] * 30)
        m = len(stack.tokenizer.encode(long_text))
        assert await refusal(stack.stub.Generate(generate(long_text, adapter_id="pt-long"))) == (
            grpc.StatusCode.INVALID_ARGUMENT,
            f"input tokens ({m}) plus prefix length (40) must be < {MAX_SEQUENCE_LENGTH}",
        )
        min_tokens = generate(
            text,
            adapter_id="pt-long",
            params=pb.Parameters(
                stopping=pb.StoppingCriteria(max_new_tokens=20, min_new_tokens=20)
            ),
        )
        assert await refusal(stack.stub.Generate(min_tokens)) == (
            grpc.StatusCode.INVALID_ARGUMENT,
            f"input tokens ({n}) plus prefix length (40) plus min_new_tokens (20) "
            f"must be <= {MAX_SEQUENCE_LENGTH}",
        )

    run(scenario, shard_class=AdapterShard)


# ---- Tokenize ----------------------------------------------------------------------------------


def test_tokenize_checks_the_adapter_and_counts_the_texts_tokens_only() -> None:
    async def scenario(stack: Stack) -> None:
        texts = ("hello", "The quick brown fox")
        plain = await stack.stub.Tokenize(tokenize(*texts))
        for fields in (
            {"adapter_id": "lora-a"},
            {"adapter_id": "pt/tuned"},
            {"adapter_id": "lora-a", "prefix_id": "sentiment"},
            {"prefix_id": "sentiment"},
        ):
            assert await stack.stub.Tokenize(tokenize(*texts, **fields)) == plain
        assert stack.shard.adapter_lookups == ["lora-a", "pt/tuned"]
        assert stack.shard.lookups == ["sentiment"]
        assert await refusal(stack.stub.Tokenize(tokenize("x", prefix_id="nope"))) == (
            grpc.StatusCode.INVALID_ARGUMENT,
            "can't retrieve prompt prefix with id 'nope': prefix id \"nope\" not found",
        )

    run(scenario, shard_class=AdapterShard)


# ---- the shard client and the cache on their own ------------------------------------------


def test_shard_client_adapter_info() -> None:
    async def scenario(stack: Stack) -> None:
        client = stack.client
        assert await client.adapter_info("lora-a") == LORA
        assert await client.adapter_info("pt/tuned") == ADAPTERS["pt/tuned"]
        for adapter_id, (_, message) in REFUSALS.items():
            with pytest.raises(AdapterLookupError) as info:
                await client.adapter_info(adapter_id)
            assert info.value.message == message
        with pytest.raises(ShardError) as error:
            await client.adapter_info("broken")
        assert error.value.failure is ShardFailure.ERROR
        assert error.value.detail == "the adapter cache is broken"

    run(scenario, shard_class=AdapterShard)


class FakeLookup:
    """Answers from ``ADAPTERS`` after ``gate`` opens; a missing id fails as the shard does."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.gate = asyncio.Event()
        self.gate.set()

    async def __call__(self, adapter_id: str) -> AdapterInfo:
        self.calls.append(adapter_id)
        await self.gate.wait()
        if adapter_id not in ADAPTERS:
            raise AdapterLookupError(f"can't retrieve adapter with id '{adapter_id}': nope")
        return ADAPTERS[adapter_id]


def test_the_adapter_cache_hits_forgets_failures_and_shares_misses() -> None:
    async def scenario() -> None:
        lookup = FakeLookup()
        cache = AdapterKinds(lookup)
        assert [await cache.get("pt/tuned") for _ in range(3)] == [ADAPTERS["pt/tuned"]] * 3
        assert lookup.calls == ["pt/tuned"] and cache.cached("pt/tuned") == ADAPTERS["pt/tuned"]
        for _ in range(2):
            with pytest.raises(AdapterLookupError):
                await cache.get("gone")
        assert lookup.calls == ["pt/tuned", "gone", "gone"] and cache.cached("gone") is None
        lookup.gate.clear()
        waiters = [asyncio.ensure_future(cache.get("lora-b")) for _ in range(4)]
        await asyncio.sleep(0)
        lookup.gate.set()
        assert await asyncio.gather(*waiters) == [LORA] * 4
        assert lookup.calls.count("lora-b") == 1
        lookup.gate.clear()
        failing = [asyncio.ensure_future(cache.get("gone")) for _ in range(3)]
        await asyncio.sleep(0)
        lookup.gate.set()
        results = await asyncio.gather(*failing, return_exceptions=True)
        assert all(isinstance(r, AdapterLookupError) for r in results)
        assert lookup.calls.count("gone") == 3  # two before, one shared by these three

    asyncio.run(scenario())


def test_the_adapter_cache_follows_the_shards_info() -> None:
    info = ShardInfo(
        model_kind=ModelKind.CAUSAL_LM,
        eos_token_ids=(2,),
        vocab_size=10,
        block_size=4,
        num_blocks=8,
        world_size=1,
        max_position_embeddings=64,
        model_type="x",
        dtype="x",
        device="x",
        attention_backend="x",
    )
    lookup = FakeLookup()
    assert adapter_kinds(info, lookup) is None  # the defaults: adapters disabled
    cache = adapter_kinds(replace(info, adapters_enabled=True, max_loras=4), lookup)
    assert cache is not None and cache.lora_supported
    cache = adapter_kinds(replace(info, adapters_enabled=True, max_loras=0), lookup)
    assert cache is not None and not cache.lora_supported
