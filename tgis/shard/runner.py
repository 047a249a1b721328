"""The interface the shard's servicer needs from an engine: ``Runner``.

Two implementations: ``model_runner.ModelRunner`` (the native paged engine) and
``hf_runner.HfRunner`` (the transformers fallback). ``loader.load_runner`` picks one.
"""

from __future__ import annotations

from typing import Protocol

from tgis.shard.messages import ShardInfo, StepOutput, StepPlan


class Runner(Protocol):
    """Executes StepPlans against one loaded model; called from one thread at a time."""

    @property
    def info(self) -> ShardInfo:
        """Static facts about the model and the KV cache."""
        ...

    def step(self, plan: StepPlan) -> StepOutput:
        """Apply ``plan`` (a diff against the runner's sequences) and run its forward pass.

        Raises InvalidStepError, leaving the state as it was, when the plan breaks the
        protocol.
        """
        ...

    def reset(self) -> None:
        """Forget every sequence."""
        ...

    def health(self) -> None:
        """Raise if the device does not answer."""
        ...
