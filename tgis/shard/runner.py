"""The interface the shard's servicer needs from an engine: ``Runner``.

Two implementations: ``model_runner.ModelRunner`` (the native paged engine) and
``hf_runner.HfRunner`` (the transformers fallback). ``loader.load_runner`` picks one.
"""

from __future__ import annotations

from typing import Protocol

import torch

from tgis.shard.messages import ShardInfo, StepOutput, StepPlan
from tgis.shard.sequence import Sequence
from tgis.shard.step_plan import PlanLimits, ResolvedStep, resolve_plan


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


class SequenceRunner:
    """What both engines share: the sequences, the plan checks, health and reset.

    Subclasses set ``info``, ``device``, ``sequences`` and ``limits`` in ``__init__``.
    """

    info: ShardInfo
    device: torch.device
    sequences: dict[int, Sequence]
    limits: PlanLimits

    def reset(self) -> None:
        """Forget every sequence."""
        self.sequences.clear()

    def health(self) -> None:
        """Raise if the device does not answer (a cheap query, no kernel launch)."""
        if self.device.type == "cuda":
            torch.cuda.mem_get_info(self.device)

    def _begin_step(self, plan: StepPlan) -> ResolvedStep:
        """Check the whole plan (InvalidStepError changes nothing), then forget finished
        sequences and drop the blocks of preempted ones."""
        resolved = resolve_plan(plan, self.sequences, self.limits)
        for rid in resolved.finished:
            self.sequences.pop(rid, None)
        for rid in resolved.preempted:
            self.sequences[rid].preempt()
        return resolved
