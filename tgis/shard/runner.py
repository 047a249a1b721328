"""The interface the shard's servicer needs from an engine: ``Runner``.

Two implementations: ``model_runner.ModelRunner`` (the native paged engine) and
``hf_runner.HfRunner`` (the transformers fallback). ``loader.load_runner`` picks one.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf
from typing import Protocol

import torch

from tgis.shard.prefix_rows import NO_PREFIXES, Prefixes
from tgis.shard.sequence import Sequence
from tgis.shard.step_plan import PlanLimits, ResolvedStep, resolve_plan
from tgis.shard_api.messages import SequenceError, ShardInfo, StepOutput, StepPlan


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

    def lookup_prefix(self, prefix_id: str) -> int:
        """Load a prompt-tuning prefix into the cache and return its virtual tokens;
        StoreError (``adapter_store.py``) with TGIS's message when it cannot be used."""
        ...

    def health(self) -> None:
        """Raise if the device does not answer."""
        ...


class SequenceRunner:
    """What both engines share: the sequences, the plan checks, health and reset.

    Subclasses set ``info``, ``device``, ``sequences`` and ``limits`` in ``__init__``, and
    call ``_drop_failed`` with every step's per-sequence errors.
    """

    info: ShardInfo
    device: torch.device
    sequences: dict[int, Sequence]
    limits: PlanLimits
    # Sequences that failed on their own, skipped when scheduled until they are finished.
    dropped: set[int]
    # Prompt-tuning prefixes (NO_PREFIXES: every lookup is not found).
    prefixes: Prefixes = NO_PREFIXES

    def reset(self) -> None:
        """Forget every sequence."""
        self.sequences.clear()
        self.dropped.clear()

    def lookup_prefix(self, prefix_id: str) -> int:
        """The virtual tokens of ``prefix_id``, loaded into the cache; StoreError if not."""
        return self.prefixes.lookup(prefix_id)

    def health(self) -> None:
        """Raise if the device does not answer (a cheap query, no kernel launch)."""
        if self.device.type == "cuda":
            torch.cuda.mem_get_info(self.device)

    def _begin_step(self, plan: StepPlan) -> ResolvedStep:
        """Check the whole plan (InvalidStepError changes nothing), then forget finished
        sequences and drop the blocks of preempted ones."""
        resolved = resolve_plan(plan, self.sequences, self.limits, self.dropped, self.prefixes)
        for rid in resolved.finished:
            self._forget(rid)
            self.dropped.discard(rid)
        for rid in resolved.preempted:
            self.sequences[rid].preempt()
        return resolved

    def _drop_failed(self, errors: SequenceOf[SequenceError]) -> None:
        """Forget the sequences that failed on their own this step and remember them until
        the router finishes them (it may schedule them once more before it hears)."""
        for error in errors:
            self._forget(error.request_id)
            self.dropped.add(error.request_id)

    def _forget(self, request_id: int) -> None:
        """Drop a sequence's state (subclasses drop what they keep about it too)."""
        self.sequences.pop(request_id, None)
