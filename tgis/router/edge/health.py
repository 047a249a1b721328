"""Is generation working? Backs HTTP GET /health and the gRPC grpc.health.v1 service.

Like TGIS: when the last step succeeded, a cheap shard Health call is enough; otherwise
a real one-token generation ("liveness") goes through the engine and must succeed.
"""

from __future__ import annotations

import asyncio
import logging
import time

from tgis.router.core.engine import Engine
from tgis.router.core.request_state import TokenEvent
from tgis.router.core.shard_client import ShardClient, ShardError
from tgis.router.request_types import (
    GenerationParams,
    ResponseOptions,
    SamplingParams,
    StoppingParams,
    ValidatedRequest,
)

log = logging.getLogger(__name__)

LIVENESS_TEXT = "liveness"
HEALTH_TIMEOUT_S = 60.0


class HealthTimeoutError(Exception):
    pass


class GenerationHealth:
    def __init__(self, engine: Engine, shard: ShardClient, liveness_ids: tuple[int, ...]) -> None:
        self.engine = engine
        self.shard = shard
        stopping = StoppingParams(max_new_tokens=1)
        sampling = SamplingParams()
        self._liveness = ValidatedRequest(
            text=LIVENESS_TEXT,
            input_ids=liveness_ids,
            params=GenerationParams(sampling, stopping, ResponseOptions()),
            stopping=stopping,
            sampling=sampling,
        )

    async def check(self, timeout: float = HEALTH_TIMEOUT_S) -> bool:
        """True when the shard answers and generation works; raises HealthTimeoutError."""
        try:
            return await asyncio.wait_for(self._check(), timeout)
        except TimeoutError as err:
            raise HealthTimeoutError from err

    async def _check(self) -> bool:
        if self.engine.generation_healthy:
            try:
                await self.shard.health()
                return True
            except ShardError as err:
                log.warning("health: shard check failed: %s", err.detail)
                return False
        return await self.generate_one_token()

    async def generate_one_token(self) -> bool:
        state = self.engine.submit(self._liveness, time.monotonic())
        try:
            event = await state.events.get()
        finally:
            self.engine.abort(state)
        if isinstance(event, TokenEvent) and event.generated_token_count == 1:
            return True
        log.warning("health: liveness generation failed: %s", event)
        return False
