"""The ``ShardService`` RPC handlers: convert, run on the step thread, convert back.

Steps (and Reset, which must not interleave with one) go through the ``StepExecutor`` the
step channel also uses, on a single worker thread, so the event loop stays free for Health
and Info while a forward pass runs. Its failures (``StepFailed``) answer with the gRPC
status ``tgis.shard_api.channel`` maps their code to (INVALID_PLAN → INVALID_ARGUMENT,
OUT_OF_MEMORY → RESOURCE_EXHAUSTED, STALE_BASE → ABORTED, INTERNAL → INTERNAL), with the
failure's message. PrefixLookup runs on a thread of its
own and answers NOT_FOUND or INVALID_ARGUMENT with TGIS's shard message.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import TypeVar

import grpc

from tgis.pb import shard_pb2, shard_pb2_grpc
from tgis.shard.adapters.store_paths import StoreError, StoreErrorKind
from tgis.shard.errors import InvalidStepError
from tgis.shard.serving.step_executor import StepExecutor
from tgis.shard_api.channel import StepFailed
from tgis.shard_api.codec import (
    adapter_to_pb,
    info_to_pb,
    output_to_pb,
    plan_from_pb,
    prefix_to_pb,
)

log = logging.getLogger(__name__)
T = TypeVar("T")


_STORE_STATUS = {
    StoreErrorKind.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    StoreErrorKind.INVALID: grpc.StatusCode.INVALID_ARGUMENT,
}


class ShardServicer(shard_pb2_grpc.ShardServiceServicer):
    """Serves one Runner (native or transformers engine) over gRPC, through its executor."""

    def __init__(self, executor: StepExecutor, step_channel: str = "") -> None:
        self.executor = executor
        self.step_channel = step_channel
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-step")

    def close(self) -> None:
        """Stop the step thread (after the running step, if any)."""
        self._executor.shutdown(wait=True, cancel_futures=True)

    async def _on_step_thread(self, fn: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn)

    async def Info(
        self, request: shard_pb2.InfoRequest, context: grpc.aio.ServicerContext
    ) -> shard_pb2.InfoResponse:
        """Static facts about the model and the KV cache."""
        return info_to_pb(replace(self.executor.info, step_channel=self.step_channel))

    async def Health(
        self, request: shard_pb2.HealthRequest, context: grpc.aio.ServicerContext
    ) -> shard_pb2.HealthResponse:
        """OK unless the device fails a cheap query."""
        try:
            await asyncio.to_thread(self.executor.health)
        except Exception as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"device unhealthy: {e}")
        return shard_pb2.HealthResponse()

    async def Reset(
        self, request: shard_pb2.ResetRequest, context: grpc.aio.ServicerContext
    ) -> shard_pb2.ResetResponse:
        """Forget every sequence."""
        await self._on_step_thread(self.executor.reset)
        return shard_pb2.ResetResponse()

    async def PrefixLookup(
        self, request: shard_pb2.PrefixLookupRequest, context: grpc.aio.ServicerContext
    ) -> shard_pb2.PrefixLookupResponse:
        """Load a prompt-tuning prefix (off the step thread); NOT_FOUND or INVALID_ARGUMENT
        with TGIS's message when it cannot be used."""
        try:
            prefix = await asyncio.to_thread(self.executor.lookup_prefix, request.prefix_id)
        except StoreError as e:
            code = _STORE_STATUS[e.kind]
            await context.abort(code, e.tgis_message)
        except InvalidStepError as e:  # a rank > 0 refusing it
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        return prefix_to_pb(prefix)

    async def AdapterLookup(
        self, request: shard_pb2.AdapterLookupRequest, context: grpc.aio.ServicerContext
    ) -> shard_pb2.AdapterLookupResponse:
        """Load an adapter from the adapter cache (off the step thread) and say what it is;
        NOT_FOUND or INVALID_ARGUMENT with the client's message when it cannot be used."""
        try:
            info = await asyncio.to_thread(self.executor.lookup_adapter, request.adapter_id)
        except StoreError as e:
            await context.abort(_STORE_STATUS[e.kind], e.message)
        except InvalidStepError as e:  # a rank > 0 refusing it
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        return adapter_to_pb(info)

    async def Step(
        self, request: shard_pb2.StepRequest, context: grpc.aio.ServicerContext
    ) -> shard_pb2.StepResponse:
        """Run one forward pass."""
        plan = plan_from_pb(request)
        try:
            output = await self._on_step_thread(lambda: self.executor.step(plan))
        except StepFailed as e:
            await context.abort(e.grpc_status, e.message)
        return output_to_pb(output)
