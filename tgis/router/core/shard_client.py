"""The router's connection to the rank-0 shard: gRPC for Info, Health, Reset, PrefixLookup
and AdapterLookup, the step channel (``tgis.shard_api.channel``) for Steps.

The only router module that touches shard protobufs (through ``tgis.shard_api.codec``).
"""

from __future__ import annotations

import asyncio
import enum
import time
from typing import Any

import grpc

from tgis.pb import shard_pb2, shard_pb2_grpc
from tgis.shard_api.channel import StepChannelClient, StepFailed
from tgis.shard_api.codec import adapter_from_pb, info_from_pb, prefix_from_pb
from tgis.shard_api.messages import (
    AdapterInfo,
    PrefixInfo,
    ShardInfo,
    StepErrorCode,
    StepOutput,
    StepPlan,
)

_MAX_MESSAGE_BYTES = 256 * 1024 * 1024
PREFIX_LOOKUP_TIMEOUT_S = 30.0
"""How long a PrefixLookup may take: the shard may have to read the prefix from disk."""
ADAPTER_LOOKUP_TIMEOUT_S = 60.0
"""How long an AdapterLookup may take: the shard reads and loads the adapter's weights."""
# PrefixLookup / AdapterLookup statuses that mean "this item cannot be used" (the client's
# problem), not a broken shard: NOT_FOUND (no such item), INVALID_ARGUMENT (bad id, bad
# tensor or config, unsupported type), FAILED_PRECONDITION (a rank > 0 refused it).
_LOOKUP_REFUSALS = frozenset(
    {
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.FAILED_PRECONDITION,
    }
)


class ShardFailure(enum.Enum):
    """Failure classes, as in TGIS's tgi_batch_inference_failure{reason} (plus ``stale``:
    a step refused because the one it was planned on failed; never counted)."""

    OOM = "oom"
    CONNECTION = "connection"
    ERROR = "error"
    STALE = "stale"


class ShardError(Exception):
    """A failed shard call; `detail` follows `Request failed during generation: ` for clients."""

    def __init__(self, failure: ShardFailure, detail: str) -> None:
        super().__init__(detail)
        self.failure = failure
        self.detail = detail


class LookupRefusedError(Exception):
    """The shard refused an item it was asked to look up; ``message`` is its text."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class PrefixLookupError(LookupRefusedError):
    """The shard refused a prompt prefix; `message` is its text, e.g.
    ``prefix id "<id>" not found`` (clients see it after
    ``can't retrieve prompt prefix with id '<id>': ``)."""


class AdapterLookupError(LookupRefusedError):
    """The shard refused an adapter; `message` is the exact text clients see, e.g.
    ``can't retrieve adapter with id '<id>': directory does not exist``."""


def _grpc_error(err: grpc.aio.AioRpcError) -> ShardError:
    code = err.code()
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return ShardError(ShardFailure.OOM, "GPU out of memory")
    if code == grpc.StatusCode.UNAVAILABLE:
        return ShardError(
            ShardFailure.CONNECTION,
            f"Could not connect to Text Generation server: {err.details()}",
        )
    return ShardError(ShardFailure.ERROR, err.details() or str(code))


def _step_error(err: Exception) -> ShardError:
    if isinstance(err, StepFailed):
        if err.code is StepErrorCode.OUT_OF_MEMORY:
            return ShardError(ShardFailure.OOM, "GPU out of memory")
        if err.code is StepErrorCode.STALE_BASE:
            return ShardError(ShardFailure.STALE, err.message)
        return ShardError(ShardFailure.ERROR, err.message)
    return ShardError(
        ShardFailure.CONNECTION, f"Could not connect to Text Generation server: {err}"
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
        self._steps: StepChannelClient | None = None

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
            raise _grpc_error(err) from err

    async def info(self) -> ShardInfo:
        """The shard's facts; also opens the step channel it names."""
        info = info_from_pb(await self._call(self._stub.Info, shard_pb2.InfoRequest(), 30.0))
        if self._steps is None:
            if not info.step_channel:
                raise ShardError(ShardFailure.CONNECTION, "the shard serves no step channel")
            try:
                self._steps = await StepChannelClient.connect(info.step_channel)
            except OSError as err:
                raise ShardError(
                    ShardFailure.CONNECTION, f"cannot open the step channel: {err}"
                ) from err
        return info

    async def health(self, timeout: float = 10.0) -> None:
        await self._call(self._stub.Health, shard_pb2.HealthRequest(), timeout)

    async def reset(self) -> None:
        await self._call(self._stub.Reset, shard_pb2.ResetRequest(), 30.0)

    async def prefix_info(
        self, prefix_id: str, timeout: float = PREFIX_LOOKUP_TIMEOUT_S
    ) -> PrefixInfo:
        """The number of virtual tokens of prompt prefix ``prefix_id`` and the version of
        its contents; the shard loads it into its prefix cache on the way.

        Raises:
            PrefixLookupError: the shard refused the prefix (missing, invalid id or tensor),
                with the shard's message.
            ShardError: the call itself failed (connection, timeout, internal error).
        """
        request = shard_pb2.PrefixLookupRequest(prefix_id=prefix_id)
        response = await self._lookup(self._stub.PrefixLookup, request, timeout, PrefixLookupError)
        return prefix_from_pb(response)

    async def adapter_info(
        self, adapter_id: str, timeout: float = ADAPTER_LOOKUP_TIMEOUT_S
    ) -> AdapterInfo:
        """The kind of adapter ``adapter_id`` (and a prompt-tuning adapter's number of
        virtual tokens); the shard loads it into its adapter cache on the way.

        Raises:
            AdapterLookupError: the shard refused the adapter (invalid id, missing directory
                or adapter_config.json, unsupported type, malformed), with the shard's
                message, which is the one clients see.
            ShardError: the call itself failed (connection, timeout, internal error).
        """
        request = shard_pb2.AdapterLookupRequest(adapter_id=adapter_id)
        response = await self._lookup(
            self._stub.AdapterLookup, request, timeout, AdapterLookupError
        )
        return adapter_from_pb(response)

    async def _lookup(
        self, method: Any, request: Any, timeout: float, refused: type[LookupRefusedError]
    ) -> Any:
        """A lookup RPC: the shard's refusals raise ``refused`` with its message, other
        failures ShardError."""
        try:
            return await method(request, timeout=timeout)
        except grpc.aio.AioRpcError as err:
            if err.code() in _LOOKUP_REFUSALS:
                raise refused(err.details() or "") from err
            raise _grpc_error(err) from err

    def send_step(self, plan: StepPlan) -> asyncio.Future[StepOutput]:
        """Send ``plan`` now (steps run in the order sent); await the result with
        ``step_result``. Needs ``info()`` first."""
        if self._steps is None:
            raise RuntimeError("the step channel is not open: call info() first")
        return self._steps.send(plan)

    async def step_result(self, sent: asyncio.Future[StepOutput]) -> StepOutput:
        """The output of a sent step; ShardError when it failed."""
        try:
            return await sent
        except (StepFailed, ConnectionError) as err:
            raise _step_error(err) from err

    async def close(self) -> None:
        if self._steps is not None:
            self._steps.close()
        await self._channel.close()
