"""The ``ShardService`` RPC handlers: convert, run on the step thread, convert back.

Steps (and Reset, which must not interleave with one) run one at a time on a single worker
thread, so the event loop stays free for Health and Info while a forward pass runs.
Errors map to status codes: InvalidStepError → INVALID_ARGUMENT, CUDA out-of-memory →
RESOURCE_EXHAUSTED, anything else → INTERNAL with the exception's message.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import grpc
import torch

from tgis.pb import shard_pb2, shard_pb2_grpc
from tgis.shard.errors import InvalidStepError
from tgis.shard.pb_convert import info_to_pb, plan_from_pb, step_output_to_pb
from tgis.shard.runner import Runner

log = logging.getLogger(__name__)
T = TypeVar("T")


class ShardServicer(shard_pb2_grpc.ShardServiceServicer):
    """Serves one Runner (native or transformers engine) over gRPC."""

    def __init__(self, runner: Runner) -> None:
        self.runner = runner
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
        return info_to_pb(self.runner.info)

    async def Health(
        self, request: shard_pb2.HealthRequest, context: grpc.aio.ServicerContext
    ) -> shard_pb2.HealthResponse:
        """OK unless the device fails a cheap query."""
        try:
            await asyncio.to_thread(self.runner.health)
        except Exception as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"device unhealthy: {e}")
        return shard_pb2.HealthResponse()

    async def Reset(
        self, request: shard_pb2.ResetRequest, context: grpc.aio.ServicerContext
    ) -> shard_pb2.ResetResponse:
        """Forget every sequence."""
        await self._on_step_thread(self.runner.reset)
        return shard_pb2.ResetResponse()

    async def Step(
        self, request: shard_pb2.StepRequest, context: grpc.aio.ServicerContext
    ) -> shard_pb2.StepResponse:
        """Run one forward pass."""
        plan = plan_from_pb(request)
        try:
            output = await self._on_step_thread(lambda: self.runner.step(plan))
        except InvalidStepError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except torch.cuda.OutOfMemoryError as e:
            log.error("step %d ran out of GPU memory: %s", request.step_id, e)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except Exception as e:
            log.exception("step %d failed", request.step_id)
            await context.abort(grpc.StatusCode.INTERNAL, str(e) or type(e).__name__)
        return step_output_to_pb(output)
