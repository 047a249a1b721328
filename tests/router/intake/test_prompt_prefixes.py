"""Prompt prefixes (``prefix_id``) through the router, end to end over real gRPC.

The router is the real one, composed as ``server.py`` does (ShardClient, Engine,
PrefixInfos, GenerationServicer on a gRPC server), on Unix sockets; the shard is a
stand-in ``ShardService`` that knows a few prefix lengths, answers ``PrefixLookup`` with
the statuses and messages of the real shard, and runs Steps on the step channel the way
the real one counts them: a prefix's virtual positions first, then the input's, in every
``num_tokens`` (its input-token details list the prefix positions first, as pad tokens).
Both are tests/router/stack.py's (``router_stack``, ``PrefixShard``).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile

import grpc
import pytest

from tests.prometheus_tools import parse_exposition
from tests.router.stack import (
    BAD_ID,
    BAD_TENSOR,
    BLOCK_SIZE,
    MAX_SEQUENCE_LENGTH,
    Stack,
    details,
    refusal,
    run,
    stream_refusal,
)
from tgis.pb import generation_pb2 as pb
from tgis.router.core.shard_client import PrefixLookupError, ShardClient, ShardError, ShardFailure
from tgis.shard_api.messages import PrefixInfo

# ---- lookup failures (rule 12) -----------------------------------------------------------


def test_an_unknown_prefix_is_refused_with_the_shards_message_verbatim() -> None:
    expected = (
        "can't retrieve prompt prefix with id 'invalid_prefix_id': "
        'prefix id "invalid_prefix_id" not found'
    )

    async def scenario(stack: Stack) -> None:
        request = pb.BatchedGenerationRequest(
            requests=[pb.GenerationRequest(text="hello")], prefix_id="invalid_prefix_id"
        )
        assert await refusal(stack.stub.Generate(request)) == (
            grpc.StatusCode.INVALID_ARGUMENT,
            expected,
        )
        single = pb.SingleGenerationRequest(
            request=pb.GenerationRequest(text="hello"), prefix_id="invalid_prefix_id"
        )
        assert await stream_refusal(stack.stub.GenerateStream(single)) == (
            grpc.StatusCode.INVALID_ARGUMENT,
            expected,
        )
        # Failures are not cached: each request asked the shard.
        assert stack.shard.lookups == ["invalid_prefix_id"] * 2
        assert not stack.shard.new_sequences
        exp = parse_exposition(stack.metrics.render().decode())
        assert exp.value("tgi_prompt_load_failure") == 2
        assert exp.value("tgi_request_failure", err="validation") == 2

    run(scenario)


@pytest.mark.parametrize(
    ("prefix_id", "message"),
    [
        ("bad_tensor", BAD_TENSOR),
        ("rank_refused", "rank 1 refused it"),
        ("store_broken", "the prefix store is broken"),
    ],
)
def test_other_lookup_failures_carry_the_shards_message(prefix_id: str, message: str) -> None:
    async def scenario(stack: Stack) -> None:
        request = pb.BatchedGenerationRequest(
            requests=[pb.GenerationRequest(text="hello")], prefix_id=prefix_id
        )
        assert await refusal(stack.stub.Generate(request)) == (
            grpc.StatusCode.INVALID_ARGUMENT,
            f"can't retrieve prompt prefix with id '{prefix_id}': {message}",
        )

    run(scenario)


def test_an_empty_prefix_id_is_looked_up_too() -> None:
    async def scenario(stack: Stack) -> None:
        present_but_empty = pb.BatchedGenerationRequest(
            requests=[pb.GenerationRequest(text="hello")], prefix_id=""
        )
        assert present_but_empty.HasField("prefix_id")
        assert await refusal(stack.stub.Generate(present_but_empty)) == (
            grpc.StatusCode.INVALID_ARGUMENT,
            f"can't retrieve prompt prefix with id '': {BAD_ID.format('')}",
        )
        absent = pb.BatchedGenerationRequest(requests=[pb.GenerationRequest(text="hello")])
        response = await stack.stub.Generate(absent)
        assert response.responses[0].generated_token_count == 20
        assert stack.shard.lookups == [""]
        (new,) = stack.shard.new_sequences
        assert (new.prefix_id, new.prefix_length) == ("", 0)

    run(scenario)


# ---- a known prefix --------------------------------------------------------------------------


def test_stream_with_a_prefix_counts_it_in_the_input_tokens_message_only() -> None:
    async def scenario(stack: Stack) -> None:
        text = "The quick brown fox"
        ids = stack.tokenizer.encode(text)
        request = pb.SingleGenerationRequest(
            request=pb.GenerationRequest(text=text),
            prefix_id="sentiment",
            params=details(input_tokens=True, max_new_tokens=3),
        )
        messages = [m async for m in stack.stub.GenerateStream(request)]
        header, inputs, *tokens = messages
        assert header.input_token_count == len(ids)  # without the prefix
        assert inputs.input_token_count == len(ids) + 6 == len(inputs.input_tokens)
        assert [t.text for t in inputs.input_tokens[:6]] == ["<unk>"] * 6
        assert [t.text for t in inputs.input_tokens[6:]] == [
            stack.tokenizer.id_to_token(i) for i in ids
        ]
        assert tokens[-1].generated_token_count == 3
        assert tokens[-1].stop_reason == pb.MAX_TOKENS
        (new,) = stack.shard.new_sequences
        assert (new.prefix_id, new.prefix_length) == ("sentiment", 6)
        assert new.prompt_token_ids == tuple(ids)  # the shard adds the virtual tokens
        (first_chunk, *_) = stack.shard.chunks
        # The whole prompt in one chunk: prefix and input, in blocks for both.
        assert first_chunk == (new.request_id, 6 + len(ids), -(-(6 + len(ids)) // BLOCK_SIZE))

    run(scenario)


def test_batch_shares_the_prefix_and_responses_exclude_it() -> None:
    async def scenario(stack: Stack) -> None:
        texts = ["hello", "The quick brown fox jumps"]
        request = pb.BatchedGenerationRequest(
            requests=[pb.GenerationRequest(text=t) for t in texts],
            prefix_id="nested/prefix",
            params=details(input_tokens=True, max_new_tokens=4),
        )
        response = await stack.stub.Generate(request)
        for text, r in zip(texts, response.responses, strict=True):
            length = len(stack.tokenizer.encode(text))
            assert r.input_token_count == length
            assert len(r.input_tokens) == 3 + length
            assert r.generated_token_count == 4 and r.stop_reason == pb.MAX_TOKENS
        assert [(n.prefix_id, n.prefix_length) for n in stack.shard.new_sequences] == [
            ("nested/prefix", 3)
        ] * 2
        # One lookup for the batch; the next request finds the length cached.
        await stack.stub.Generate(request)
        assert stack.shard.lookups == ["nested/prefix"]
        exp = parse_exposition(stack.metrics.render().decode())
        assert exp.value("tgi_prompt_load_duration_count") == 1
        assert exp.value("tgi_prompt_load_failure") == 0
        # tgi_request_input_length leaves the prefix out.
        lengths = sum(len(stack.tokenizer.encode(t)) for t in texts)
        assert exp.value("tgi_request_input_length_sum") == 2 * lengths

    run(scenario)


def test_a_prefix_rewritten_on_the_shard_fails_one_request_then_is_looked_up_again() -> None:
    """The router sends the version it looked up (its prefix cache is on); the shard holds
    other contents now and fails that sequence; the router forgets its answer, so the next
    request looks the prefix up again and runs."""

    async def scenario(stack: Stack) -> None:
        request = pb.BatchedGenerationRequest(
            requests=[pb.GenerationRequest(text="hello")],
            prefix_id="nested/prefix",
            params=details(max_new_tokens=2),
        )
        await stack.stub.Generate(request)
        assert stack.shard.new_sequences[-1].prefix_version == "v-nested/prefix"
        stack.shard.versions["nested/prefix"] = "v2"
        code, message = await refusal(stack.stub.Generate(request))
        assert code == grpc.StatusCode.UNKNOWN
        assert message == "Request failed during generation: prefix changed"
        assert stack.shard.lookups == ["nested/prefix"]
        response = await stack.stub.Generate(request)
        assert response.responses[0].generated_token_count == 2
        assert stack.shard.lookups == ["nested/prefix"] * 2
        assert stack.shard.new_sequences[-1].prefix_version == "v2"

    run(scenario)


def test_the_prefix_counts_in_the_length_limits() -> None:
    async def scenario(stack: Stack) -> None:
        text = "The quick brown fox"  # 10 tokens: 10 + 40 + 30 > 64
        n = len(stack.tokenizer.encode(text))
        request = pb.SingleGenerationRequest(
            request=pb.GenerationRequest(text=text),
            prefix_id="long",
            params=details(max_new_tokens=30),
        )
        messages = [m async for m in stack.stub.GenerateStream(request)]
        assert messages[0].input_token_count == n
        assert messages[-1].stop_reason == pb.TOKEN_LIMIT
        assert messages[-1].generated_token_count == MAX_SEQUENCE_LENGTH - 40 - n
        long_text = " ".join(["word"] * 30)
        m = len(stack.tokenizer.encode(long_text))
        too_long = pb.BatchedGenerationRequest(
            requests=[pb.GenerationRequest(text=long_text)], prefix_id="long"
        )
        assert await refusal(stack.stub.Generate(too_long)) == (
            grpc.StatusCode.INVALID_ARGUMENT,
            f"input tokens ({m}) plus prefix length (40) must be < {MAX_SEQUENCE_LENGTH}",
        )
        min_tokens = pb.BatchedGenerationRequest(
            requests=[pb.GenerationRequest(text=text)],
            prefix_id="long",
            params=pb.Parameters(
                stopping=pb.StoppingCriteria(max_new_tokens=20, min_new_tokens=20)
            ),
        )
        assert await refusal(stack.stub.Generate(min_tokens)) == (
            grpc.StatusCode.INVALID_ARGUMENT,
            f"input tokens ({n}) plus prefix length (40) plus min_new_tokens (20) "
            f"must be <= {MAX_SEQUENCE_LENGTH}",
        )

    run(scenario)


def test_a_prefix_is_chunked_like_any_prompt() -> None:
    async def scenario(stack: Stack) -> None:
        text = "hello"
        n = len(stack.tokenizer.encode(text))
        request = pb.BatchedGenerationRequest(
            requests=[pb.GenerationRequest(text=text)],
            prefix_id="long",
            params=details(input_tokens=True, max_new_tokens=2),
        )
        (response,) = (await stack.stub.Generate(request)).responses
        assert len(response.input_tokens) == 40 + n
        chunks = [c[1] for c in stack.shard.chunks]
        total = 40 + n
        assert chunks == [16] * (total // 16) + ([total % 16] if total % 16 else []) + [1]

    run(scenario, prefill_budget=16)


# ---- the shard client on its own --------------------------------------------------------------


def test_shard_client_prefix_length() -> None:
    async def scenario(stack: Stack) -> None:
        client = stack.client
        assert await client.prefix_info("sentiment") == PrefixInfo(6, "v-sentiment")
        with pytest.raises(PrefixLookupError) as info:
            await client.prefix_info("x")
        assert info.value.message == 'prefix id "x" not found'
        with pytest.raises(PrefixLookupError) as info:
            await client.prefix_info("bad_tensor")
        assert info.value.message == BAD_TENSOR
        with pytest.raises(PrefixLookupError):
            await client.prefix_info("rank_refused")
        with pytest.raises(ShardError) as error:
            await client.prefix_info("store_broken")
        assert error.value.failure is ShardFailure.ERROR
        assert error.value.detail == "the prefix store is broken"

    run(scenario)


def test_shard_client_prefix_length_without_a_shard() -> None:
    async def scenario() -> None:
        workdir = tempfile.mkdtemp(prefix="tgis-prefix-", dir="/tmp")
        client = ShardClient(os.path.join(workdir, "nobody"))
        try:
            with pytest.raises(ShardError) as error:
                await client.prefix_info("p", timeout=5.0)
            assert error.value.failure is ShardFailure.CONNECTION
        finally:
            await client.close()
            shutil.rmtree(workdir, ignore_errors=True)

    asyncio.run(scenario())
