"""Prompt prefixes (``prefix_id``) through the router, end to end over real gRPC.

The router is the real one, composed as ``server.py`` does (ShardClient, Engine,
PrefixInfos, GenerationServicer on a gRPC server), on Unix sockets; the shard is a
stand-in ``ShardService`` that knows a few prefix lengths, answers ``PrefixLookup`` with
the statuses and messages of the real shard, and runs Steps on the step channel the way
the real one counts them: a prefix's virtual positions first, then the input's, in every
``num_tokens`` (its input-token details list the prefix positions first, as pad tokens).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import tempfile
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
import pytest

from tests.prometheus_tools import parse_exposition
from tests.router.servicers import make_servicer
from tgis.embedded_model import MODEL_DIR
from tgis.pb import generation_pb2 as pb
from tgis.pb import generation_pb2_grpc, shard_pb2, shard_pb2_grpc
from tgis.router.core.batching import SchedulerLimits
from tgis.router.core.engine import Engine
from tgis.router.core.request_state import OutputRules
from tgis.router.core.scheduler import new_scheduler
from tgis.router.core.shard_client import PrefixLookupError, ShardClient, ShardError, ShardFailure
from tgis.router.intake.adapters import adapter_kinds
from tgis.router.intake.concurrency import ConcurrencyLimiter
from tgis.router.intake.prefixes import PrefixInfos
from tgis.router.intake.tokenization import RouterTokenizer
from tgis.router.intake.validation import ServerLimits
from tgis.router.ops.metrics import Metrics
from tgis.shard_api.channel import StepChannelServer, step_channel_path
from tgis.shard_api.messages import (
    InputTokenDetails,
    NewSequence,
    PrefixInfo,
    SampledToken,
    SequenceError,
    StepOutput,
    StepPlan,
    TokenDetail,
)

MAX_SEQUENCE_LENGTH = 64
MAX_NEW_TOKENS = 40
EOS = 2
PAD = 0  # the embedded tokenizer's <unk>: TGIS shows prefix positions as the pad token
BLOCK_SIZE = 4
PREFIXES = {"sentiment": 6, "long": 40, "nested/prefix": 3}
BAD_TENSOR = "Unexpected <class 'Exception'>: Invalid prefix embedding length of 9"
BAD_ID = "Invalid prefix id {}, must contain only alphanumeric, _ and - and /"


@dataclass
class FakeSequence:
    new: NewSequence
    computed: int = 0
    generated: int = 0
    input_sent: bool = False

    @property
    def known(self) -> int:
        return self.new.prompt_length + self.generated


class PrefixShard(shard_pb2_grpc.ShardServiceServicer):
    """Info, Health, Reset and PrefixLookup over gRPC; ``step`` serves the step channel."""

    def __init__(self, step_channel: str) -> None:
        self.step_channel = step_channel
        self.lookups: list[str] = []
        self.new_sequences: list[NewSequence] = []
        self.chunks: list[tuple[int, int, int]] = []
        """(request id, num_tokens, new blocks) of every scheduled chunk."""
        self.sequences: dict[int, FakeSequence] = {}
        self.versions: dict[str, str] = {}
        """Each prefix's contents now (default ``v-<id>``): a new sequence that names another
        version fails alone, as on the real shard."""
        self._lock = threading.Lock()

    def version(self, prefix_id: str) -> str:
        return self.versions.get(prefix_id, f"v-{prefix_id}")

    async def Info(self, request: Any, context: Any) -> shard_pb2.InfoResponse:
        return shard_pb2.InfoResponse(
            model_kind=shard_pb2.CAUSAL_LM,
            eos_token_ids=[EOS],
            vocab_size=4096,
            block_size=BLOCK_SIZE,
            num_blocks=256,
            world_size=1,
            max_position_embeddings=1024,
            model_type="fake",
            dtype="none",
            device="none",
            attention_backend="none",
            step_channel=self.step_channel,
            prefix_caching=True,
        )

    async def Health(self, request: Any, context: Any) -> shard_pb2.HealthResponse:
        return shard_pb2.HealthResponse()

    async def Reset(self, request: Any, context: Any) -> shard_pb2.ResetResponse:
        return shard_pb2.ResetResponse()

    async def PrefixLookup(
        self, request: shard_pb2.PrefixLookupRequest, context: grpc.aio.ServicerContext
    ) -> shard_pb2.PrefixLookupResponse:
        prefix_id = request.prefix_id
        self.lookups.append(prefix_id)
        if prefix_id == "bad_tensor":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, BAD_TENSOR)
        if prefix_id == "":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, BAD_ID.format(prefix_id))
        if prefix_id == "rank_refused":
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "rank 1 refused it")
        if prefix_id == "store_broken":
            await context.abort(grpc.StatusCode.INTERNAL, "the prefix store is broken")
        if prefix_id not in PREFIXES:
            await context.abort(grpc.StatusCode.NOT_FOUND, f'prefix id "{prefix_id}" not found')
        return shard_pb2.PrefixLookupResponse(
            prefix_length=PREFIXES[prefix_id], version=self.version(prefix_id)
        )

    def step(self, plan: StepPlan) -> StepOutput:
        """Counts as the real shard does (prefix positions included); token 300 + n."""
        with self._lock:
            for rid in plan.finished_request_ids:
                self.sequences.pop(rid, None)
            for rid in plan.preempted_request_ids:
                self.sequences[rid].computed = 0
            tokens: list[SampledToken] = []
            inputs: list[InputTokenDetails] = []
            errors: list[SequenceError] = []
            for new in plan.new_sequences:
                self.new_sequences.append(new)
                if new.prefix_version and new.prefix_version != self.version(new.prefix_id):
                    errors.append(SequenceError(new.request_id, "prefix changed"))
                else:
                    self.sequences[new.request_id] = FakeSequence(new)
            failed = {e.request_id for e in errors}
            for chunk in plan.scheduled:
                if chunk.request_id in failed:
                    continue
                self.chunks.append((chunk.request_id, chunk.num_tokens, len(chunk.new_block_ids)))
                seq = self.sequences[chunk.request_id]
                if not 1 <= chunk.num_tokens <= seq.known - seq.computed:
                    errors.append(SequenceError(chunk.request_id, "bad chunk"))
                    continue
                seq.computed += chunk.num_tokens
                new = seq.new
                if (
                    new.details.input_tokens
                    and not seq.input_sent
                    and seq.computed >= new.prompt_length
                ):
                    seq.input_sent = True
                    details = [TokenDetail(PAD)] * new.prefix_length
                    details += [TokenDetail(t) for t in new.prompt_token_ids]
                    inputs.append(InputTokenDetails(chunk.request_id, tuple(details)))
                if seq.computed == seq.known:
                    tokens.append(SampledToken(chunk.request_id, TokenDetail(300 + seq.generated)))
                    seq.generated += 1
        return StepOutput(plan.step_id, tuple(tokens), tuple(inputs), tuple(errors))


@dataclass
class Stack:
    shard: PrefixShard
    client: ShardClient
    stub: generation_pb2_grpc.GenerationServiceStub
    metrics: Metrics
    tokenizer: RouterTokenizer


@contextlib.asynccontextmanager
async def router_stack(
    prefill_budget: int = 4096, shard_class: Callable[[str], PrefixShard] = PrefixShard
) -> AsyncIterator[Stack]:
    """The fake shard (``shard_class``) and a real router in front of it, composed as
    ``server.py`` does (its adapter cache and ``max_loras`` from the shard's Info), on Unix
    sockets in a short dir."""
    workdir = tempfile.mkdtemp(prefix="tgis-prefix-", dir="/tmp")
    shard_path = os.path.join(workdir, "shard")
    router_path = os.path.join(workdir, "router")
    shard = shard_class(step_channel_path(shard_path))
    channel_server = StepChannelServer(shard.step_channel, shard.step)
    channel_server.start()
    shard_server = grpc.aio.server()
    shard_pb2_grpc.add_ShardServiceServicer_to_server(shard, shard_server)
    shard_server.add_insecure_port(f"unix://{shard_path}")
    await shard_server.start()
    tokenizer = RouterTokenizer(str(MODEL_DIR / "tokenizer.json"))
    client = ShardClient(shard_path)
    info = await client.info()
    metrics = Metrics(
        max_sequence_length=MAX_SEQUENCE_LENGTH, max_new_tokens=MAX_NEW_TOKENS, max_batch_size=8
    )
    engine = Engine(
        shard=client,
        output=OutputRules.for_shard(tokenizer, info),
        scheduler=new_scheduler(
            SchedulerLimits(
                max_batch_size=8,
                max_batch_prefill_tokens=prefill_budget,
                max_loras=info.max_loras or None,
            ),
            info,
            prefix_caching=True,
        ),
        metrics=metrics,
    )
    servicer = make_servicer(
        engine=engine,
        tokenizer=tokenizer,
        limits=ServerLimits.from_args(MAX_SEQUENCE_LENGTH, MAX_NEW_TOKENS),
        limiter=ConcurrencyLimiter(16),
        metrics=metrics,
        default_include_stop_seqs=True,
        is_seq2seq=False,
        prefixes=PrefixInfos(client.prefix_info, metrics),
        adapters=adapter_kinds(info, client.adapter_info),
    )
    router = grpc.aio.server()
    generation_pb2_grpc.add_GenerationServiceServicer_to_server(servicer, router)
    router.add_insecure_port(f"unix://{router_path}")
    engine.start()
    await router.start()
    channel = grpc.aio.insecure_channel(f"unix://{router_path}")
    try:
        yield Stack(
            shard, client, generation_pb2_grpc.GenerationServiceStub(channel), metrics, tokenizer
        )
    finally:
        await channel.close()
        await router.stop(0)
        await engine.stop()
        await client.close()
        await shard_server.stop(0)
        channel_server.close()
        tokenizer.close()
        shutil.rmtree(workdir, ignore_errors=True)


def run(scenario: Callable[[Stack], Awaitable[Any]], **kwargs: Any) -> Any:
    async def main() -> Any:
        async with router_stack(**kwargs) as stack:
            return await asyncio.wait_for(scenario(stack), 30)

    return asyncio.run(main())


def details(input_tokens: bool = False, max_new_tokens: int = 5, **kw: Any) -> pb.Parameters:
    return pb.Parameters(
        response=pb.ResponseOptions(input_tokens=input_tokens, **kw),
        stopping=pb.StoppingCriteria(max_new_tokens=max_new_tokens),
    )


async def refusal(call: Awaitable[Any]) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    return info.value.code(), info.value.details() or ""


async def stream_refusal(call: Any) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for _ in call:
            pass
    return info.value.code(), info.value.details() or ""


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
