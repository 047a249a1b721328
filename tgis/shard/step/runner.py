"""The interface the shard's servicer needs from an engine (``Runner``), and the one step
algorithm both engines run (``SequenceRunner.step``).

Two implementations: ``native.runtime.model_runner.ModelRunner`` (the native paged engine) and
``fallback.runner.HfRunner`` (the transformers fallback). ``loader.load_runner`` picks one.

A step, whichever the engine:

1. ``resolve_plan`` checks the whole plan (``InvalidStepError`` leaves the state untouched);
   finished sequences are forgotten and preempted ones lose their blocks;
2. the engine computes (``_compute``): its forward pass over every scheduled token, one
   sampled token for each sequence whose known tokens are now all computed, and the
   input-token details asked for;
3. only then is the state committed (``_commit``: new sequences registered, block tables,
   computed counts and tokens advanced); sequences that failed on their own are dropped.
"""

from __future__ import annotations

import time
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch

from tgis.shard.adapters.prefixes import NO_PREFIXES, Prefixes
from tgis.shard.adapters.request_adapters import NO_ADAPTERS, Adapters
from tgis.shard.step.guided import NO_GRAMMARS, Grammars
from tgis.shard.step.plan import PlanLimits, ResolvedStep, WorkItem, resolve_plan
from tgis.shard.step.results import commit_step
from tgis.shard.step.sequence import Sequence
from tgis.shard_api.messages import (
    AdapterInfo,
    InputTokenDetails,
    PrefixInfo,
    SampledToken,
    SequenceError,
    ShardInfo,
    StepOutput,
    StepPlan,
    TokenDetail,
)


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

    def lookup_prefix(self, prefix_id: str) -> PrefixInfo:
        """Load a prompt-tuning prefix into the cache and return its virtual tokens and version;
        StoreError (``adapters/store_paths.py``) with TGIS's message when it cannot be used."""
        ...

    def lookup_adapter(self, adapter_id: str) -> AdapterInfo:
        """Load an adapter from the adapter cache and say what it is; StoreError with the
        client's message when it cannot be used."""
        ...

    def health(self) -> None:
        """Raise if the device does not answer."""
        ...


@dataclass
class Computed:
    """What an engine's ``_compute`` produced for one step."""

    # The token sampled for each sequence that got one.
    sampled: dict[int, TokenDetail] = field(default_factory=dict)
    # Input-token details of the prompt positions computed, for sequences that asked.
    input_details: dict[int, list[TokenDetail]] = field(default_factory=dict)
    # Sequences that failed on their own (e.g. NaN logits); the others go on.
    errors: list[SequenceError] = field(default_factory=list)
    # Speculative decoding: the tokens after the sampled one that a drafted sequence's
    # step confirmed (``step/speculation.py``).
    accepted: dict[int, list[TokenDetail]] = field(default_factory=dict)
    # The work as computed, when the engine changed it (drafts its draft model added);
    # empty: the plan's.
    work: tuple[WorkItem, ...] = ()


class SequenceRunner:
    """What both engines share: the step algorithm, the sequences, the plan checks, health
    and reset.

    Subclasses set ``info``, ``device``, ``sequences``, ``dropped`` and ``limits`` in
    ``__init__`` and implement ``_compute``; they may extend ``_begin_step``, ``_commit``
    and ``_forget`` to keep their own per-sequence state in step.
    """

    info: ShardInfo
    device: torch.device
    sequences: dict[int, Sequence]
    limits: PlanLimits
    # Sequences that failed on their own, skipped when scheduled until they are finished.
    dropped: set[int]
    # Prompt-tuning prefixes (NO_PREFIXES: every lookup is not found).
    prefixes: Prefixes = NO_PREFIXES
    # Adapters named by adapter_id (NO_ADAPTERS: every id is refused).
    adapters: Adapters = NO_ADAPTERS
    # Guided decoding's matchers (NO_GRAMMARS: every constrained sequence fails alone).
    grammars: Grammars = NO_GRAMMARS

    def reset(self) -> None:
        """Forget every sequence."""
        self.sequences.clear()
        self.dropped.clear()

    def lookup_prefix(self, prefix_id: str) -> PrefixInfo:
        """The virtual tokens and version of ``prefix_id``, loaded into the cache; StoreError
        if not."""
        return self.prefixes.lookup(prefix_id)

    def lookup_adapter(self, adapter_id: str) -> AdapterInfo:
        """What ``adapter_id`` is, loaded into the cache; StoreError if it cannot be used."""
        return self.adapters.lookup(adapter_id)

    def health(self) -> None:
        """Raise if the device does not answer (a cheap query, no kernel launch)."""
        if self.device.type == "cuda":
            torch.cuda.mem_get_info(self.device)

    @torch.inference_mode()
    def step(self, plan: StepPlan) -> StepOutput:
        """Apply ``plan`` and run its forward pass; see the module docstring."""
        resolved = self._begin_step(plan)
        if not resolved.work:
            self._commit(resolved, Computed())
            self._drop_failed(resolved.errors)
            return StepOutput(step_id=plan.step_id, errors=resolved.errors)
        started = time.perf_counter_ns()
        computed = self._compute(resolved)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        elapsed = time.perf_counter_ns() - started
        finished_prompts = self._commit(resolved, computed)
        all_errors = resolved.errors + tuple(computed.errors)
        self._drop_failed(all_errors)
        return StepOutput(
            step_id=plan.step_id,
            tokens=tuple(
                SampledToken(rid, detail)
                for rid, first in computed.sampled.items()
                for detail in (first, *computed.accepted.get(rid, ()))
            ),
            input_tokens=finished_prompts,
            errors=all_errors,
            forward_time_ns=elapsed,
        )

    def _compute(self, resolved: ResolvedStep) -> Computed:
        """The engine's part of a step with work: forward, sample, input-token details.
        Nothing of the runner's state may change before it returns."""
        raise NotImplementedError

    def _commit(self, resolved: ResolvedStep, computed: Computed) -> tuple[InputTokenDetails, ...]:
        """Register, advance and forget as the step computed; the input-token details of
        every prompt it completed."""
        if computed.work:
            resolved = replace(resolved, work=computed.work)
        return commit_step(
            self.sequences,
            resolved,
            computed.sampled,
            computed.input_details,
            computed.errors,
            computed.accepted,
        )

    def _begin_step(self, plan: StepPlan) -> ResolvedStep:
        """Check the whole plan (InvalidStepError changes nothing), then forget finished
        sequences and drop the blocks of preempted ones."""
        resolved = resolve_plan(
            plan,
            self.sequences,
            self.limits,
            self.dropped,
            self.prefixes,
            self.adapters,
            self.grammars,
        )
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
