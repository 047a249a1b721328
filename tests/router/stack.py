"""The real router in process, composed as ``server.py`` does (ShardClient, Engine,
PrefixInfos and AdapterKinds from the shard's Info, GenerationServicer on a gRPC server), in
front of a stand-in shard (``PrefixShard``), on Unix sockets; and the helpers that call it.

``PrefixShard`` knows a few prefix lengths, answers ``PrefixLookup`` with the statuses and
messages of the real shard, and runs Steps on the step channel the way the real one counts
them: a prefix's virtual positions first, then the input's, in every ``num_tokens`` (its
input-token details list the prefix positions first, as pad tokens). Used by
intake/test_prompt_prefixes.py, and by intake/test_adapters.py with a subclass that has an
adapter cache.
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

from tests.router.servicers import make_servicer
from tgis.embedded_model import MODEL_DIR
from tgis.pb import generation_pb2 as pb
from tgis.pb import generation_pb2_grpc, shard_pb2, shard_pb2_grpc
from tgis.router.core.batching import SchedulerLimits
from tgis.router.core.engine import Engine
from tgis.router.core.request_state import OutputRules
from tgis.router.core.scheduler import new_scheduler
from tgis.router.core.shard_client import ShardClient
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
