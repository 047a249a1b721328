"""gRPC client for the rank-0 shard: StepPlan -> pb -> Step RPC -> pb -> StepOutput.

The only router module that touches shard protobufs.
"""

from __future__ import annotations

import asyncio
import enum
import time
from typing import Any

import grpc

from tgis.pb import shard_pb2, shard_pb2_grpc
from tgis.router.request_types import SamplingParams
from tgis.router.step import (
    NewSequence,
    ShardInfo,
    StepOutput,
    StepPlan,
    TokenDetail,
)

_MAX_MESSAGE_BYTES = 256 * 1024 * 1024


class ShardFailure(enum.Enum):
    """Failure classes, as in TGIS's tgi_batch_inference_failure{reason}."""

    OOM = "oom"
    CONNECTION = "connection"
    ERROR = "error"


class ShardError(Exception):
    """A failed shard call; `detail` follows `Request failed during generation: ` for clients."""

    def __init__(self, failure: ShardFailure, detail: str) -> None:
        super().__init__(detail)
        self.failure = failure
        self.detail = detail


def _shard_error(err: grpc.aio.AioRpcError) -> ShardError:
    code = err.code()
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return ShardError(ShardFailure.OOM, "GPU out of memory")
    if code == grpc.StatusCode.UNAVAILABLE:
        return ShardError(
            ShardFailure.CONNECTION,
            f"Could not connect to Text Generation server: {err.details()}",
        )
    return ShardError(ShardFailure.ERROR, err.details() or str(code))


def _sampling_to_pb(sampling: SamplingParams, min_new_tokens: int) -> shard_pb2.SamplingParams:
    pb = shard_pb2.SamplingParams(
        temperature=sampling.temperature,
        top_k=sampling.top_k,
        top_p=sampling.top_p,
        typical_p=sampling.typical_p if sampling.typical_p > 0 else 1.0,
        repetition_penalty=sampling.repetition_penalty,
        min_new_tokens=min_new_tokens,
    )
    if sampling.seed is not None:
        pb.seed = sampling.seed
    if sampling.length_penalty is not None:
        pb.length_penalty.start_index = sampling.length_penalty.start_index
        pb.length_penalty.decay_factor = sampling.length_penalty.decay_factor
    return pb


def _new_sequence_to_pb(seq: NewSequence) -> shard_pb2.NewSequence:
    d = seq.details
    return shard_pb2.NewSequence(
        request_id=seq.request_id,
        prompt_token_ids=seq.prompt_token_ids,
        sampling=_sampling_to_pb(seq.sampling, seq.min_new_tokens),
        details=shard_pb2.TokenDetailOptions(
            logprobs=d.logprobs,
            ranks=d.ranks,
            top_n=d.top_n,
            input_tokens=d.input_tokens,
            generated_tokens=d.generated_tokens,
        ),
    )


def plan_to_pb(plan: StepPlan) -> shard_pb2.StepRequest:
    return shard_pb2.StepRequest(
        step_id=plan.step_id,
        new_sequences=[_new_sequence_to_pb(s) for s in plan.new_sequences],
        scheduled=[
            shard_pb2.ScheduledSequence(
                request_id=c.request_id, num_tokens=c.num_tokens, new_block_ids=c.new_block_ids
            )
            for c in plan.scheduled
        ],
        finished_request_ids=plan.finished_ids,
        preempted_request_ids=plan.preempted_ids,
    )


def _detail_from_pb(pb: shard_pb2.TokenDetail) -> TokenDetail:
    return TokenDetail(
        token_id=pb.token_id,
        logprob=pb.logprob,
        rank=pb.rank,
        top_tokens=tuple((t.token_id, t.logprob) for t in pb.top_tokens),
    )


def output_from_pb(pb: shard_pb2.StepResponse) -> StepOutput:
    return StepOutput(
        tokens={t.request_id: _detail_from_pb(t.token) for t in pb.tokens},
        input_tokens={
            it.request_id: tuple(_detail_from_pb(t) for t in it.tokens) for it in pb.input_tokens
        },
        errors={e.request_id: e.message for e in pb.errors},
        forward_time_ns=pb.forward_time_ns,
    )


def info_from_pb(pb: shard_pb2.InfoResponse) -> ShardInfo:
    return ShardInfo(
        is_seq2seq=pb.model_kind == shard_pb2.SEQ2SEQ_LM,
        eos_token_ids=frozenset(pb.eos_token_ids),
        vocab_size=pb.vocab_size,
        block_size=pb.block_size,
        num_blocks=pb.num_blocks,
        world_size=pb.world_size,
        max_position_embeddings=pb.max_position_embeddings,
        model_type=pb.model_type,
        dtype=pb.dtype,
        device=pb.device,
        attention_backend=pb.attention_backend,
    )


class ShardClient:
    """Async client of one shard endpoint (rank 0 of the tensor-parallel group)."""

    def __init__(self, uds_path: str) -> None:
        self.address = uds_path if uds_path.startswith("unix:") else f"unix://{uds_path}"
        self._channel = grpc.aio.insecure_channel(
            self.address,
            options=[
                ("grpc.max_send_message_length", _MAX_MESSAGE_BYTES),
                ("grpc.max_receive_message_length", _MAX_MESSAGE_BYTES),
            ],
        )
        self._stub = shard_pb2_grpc.ShardServiceStub(self._channel)

    async def wait_ready(self, timeout: float) -> None:
        """Retry Health until the shard answers or `timeout` seconds pass."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                await self.health(timeout=5.0)
                return
            except ShardError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.2)

    async def _call(self, method: Any, request: Any, timeout: float | None = None) -> Any:
        try:
            return await method(request, timeout=timeout)
        except grpc.aio.AioRpcError as err:
            raise _shard_error(err) from err

    async def info(self) -> ShardInfo:
        return info_from_pb(await self._call(self._stub.Info, shard_pb2.InfoRequest(), 30.0))

    async def health(self, timeout: float = 10.0) -> None:
        await self._call(self._stub.Health, shard_pb2.HealthRequest(), timeout)

    async def reset(self) -> None:
        await self._call(self._stub.Reset, shard_pb2.ResetRequest(), 30.0)

    async def step(self, plan: StepPlan) -> StepOutput:
        return output_from_pb(await self._call(self._stub.Step, plan_to_pb(plan)))

    async def close(self) -> None:
        await self._channel.close()
