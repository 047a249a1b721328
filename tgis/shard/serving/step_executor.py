"""One entrance for Steps and Resets, whichever way they arrive (gRPC or the step channel).

``StepExecutor`` runs them one at a time (a lock), in arrival order, and applies the
protocol's rules around the runner:

* a plan whose ``base_step_id`` is set and is not the last step that completed is refused
  (``STALE_BASE``) without touching anything: it was planned on top of a step that failed;
* the runner's exceptions become the protocol's failure codes (``StepFailed``):
  ``InvalidStepError`` → ``INVALID_PLAN``, out of device memory → ``OUT_OF_MEMORY``,
  anything else → ``INTERNAL`` (logged with its traceback).
"""

from __future__ import annotations

import logging
import threading

import torch

from tgis.shard.errors import InvalidStepError
from tgis.shard.step.runner import Runner
from tgis.shard_api.channel import StepFailed
from tgis.shard_api.messages import (
    AdapterInfo,
    PrefixInfo,
    ShardInfo,
    StepErrorCode,
    StepOutput,
    StepPlan,
)

log = logging.getLogger(__name__)


class StepExecutor:
    """Serialises a Runner's Steps and Resets and tracks the last step that completed."""

    def __init__(self, runner: Runner) -> None:
        self.runner = runner
        self._lock = threading.Lock()
        self._last_completed = 0

    @property
    def info(self) -> ShardInfo:
        return self.runner.info

    def step(self, plan: StepPlan) -> StepOutput:
        """Run ``plan``; StepFailed with the protocol's code when it fails as a whole."""
        with self._lock:
            if plan.base_step_id and plan.base_step_id != self._last_completed:
                raise StepFailed(
                    StepErrorCode.STALE_BASE,
                    f"step {plan.step_id} was planned on step {plan.base_step_id}, which did "
                    "not complete",
                )
            try:
                output = self.runner.step(plan)
            except InvalidStepError as e:
                raise StepFailed(StepErrorCode.INVALID_PLAN, str(e)) from e
            except torch.OutOfMemoryError as e:
                log.error("step %d ran out of device memory: %s", plan.step_id, e)
                raise StepFailed(StepErrorCode.OUT_OF_MEMORY, str(e)) from e
            except Exception as e:
                log.exception("step %d failed", plan.step_id)
                raise StepFailed.internal(e) from e
            self._last_completed = plan.step_id
            return output

    def reset(self) -> None:
        """Forget every sequence; the next step is planned on nothing."""
        with self._lock:
            self.runner.reset()
            self._last_completed = 0

    def lookup_prefix(self, prefix_id: str) -> PrefixInfo:
        """A prompt-tuning prefix's virtual tokens and version (StoreError if unusable). Not
        serialised with Steps: the prefix cache is thread-safe, and with tensor parallelism the
        lock-step runner orders it with the Steps itself."""
        return self.runner.lookup_prefix(prefix_id)

    def lookup_adapter(self, adapter_id: str) -> AdapterInfo:
        """What an adapter is, loaded into this rank's (every rank's) adapter cache
        (StoreError if unusable). Not serialised with Steps, as ``lookup_prefix``."""
        return self.runner.lookup_adapter(adapter_id)

    def health(self) -> None:
        self.runner.health()
