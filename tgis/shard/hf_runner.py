"""Runs Steps through a transformers model: the generic fallback engine.

``HfRunner`` implements the same ``Runner`` interface as the native ``ModelRunner`` and
accepts the same Step plans, checked by the same ``step_plan.resolve_plan`` (block ids are
validated and kept, but there is no paging: the engine's batched caches hold the keys and
values). Per step:

1. ``resolve_plan`` validates the plan (``InvalidStepError`` leaves the state untouched);
   finished sequences are forgotten;
2. the engine (``hf_causal`` or ``hf_seq2seq``) runs the forward pass of every scheduled
   sequence and returns the logits of those whose prompt is complete;
3. ``sampling.sample`` and ``token_details`` choose the tokens exactly as the native
   engine does (rows with NaN logits fail on their own);
4. only then are the engine's cache and the sequences' state committed.
"""

from __future__ import annotations

import time
from collections.abc import Sequence as SequenceOf

import torch

from tgis.shard.hf_engine import Forward, HfEngine
from tgis.shard.runner import SequenceRunner
from tgis.shard.sequence import Sequence
from tgis.shard.step_plan import PlanLimits, ResolvedStep
from tgis.shard.step_results import commit_step, sample_tokens
from tgis.shard_api.messages import (
    InputTokenDetails,
    ModelKind,
    SampledToken,
    SequenceError,
    ShardInfo,
    StepOutput,
    StepPlan,
    TokenDetail,
)


class HfRunner(SequenceRunner):
    """Executes StepPlans against a transformers model through an ``HfEngine``."""

    def __init__(self, engine: HfEngine, info: ShardInfo, device: torch.device) -> None:
        self.engine = engine
        self.info = info
        self.device = device
        self.sequences: dict[int, Sequence] = {}
        self.dropped: set[int] = set()
        self.limits = PlanLimits(
            vocab_size=info.vocab_size,
            num_blocks=info.num_blocks,
            block_size=info.block_size,
            device=device,
            # The encoder-decoder engine cannot recompute a decoder's generated tokens.
            resumes_generated=info.model_kind != ModelKind.SEQ2SEQ_LM,
        )

    def reset(self) -> None:
        """Forget every sequence."""
        super().reset()
        self.engine.reset()

    @torch.inference_mode()
    def step(self, plan: StepPlan) -> StepOutput:
        """Apply ``plan`` and run its forward pass; see the module docstring."""
        resolved = self._begin_step(plan)
        self.engine.forget((*resolved.finished, *resolved.preempted))
        if not resolved.work:
            self._commit(resolved, {}, {})
            self._drop_failed(resolved.errors)
            return StepOutput(step_id=plan.step_id, errors=resolved.errors)
        started = time.perf_counter_ns()
        forward = self.engine.run(resolved.work, self.sequences.keys())
        sampled, errors = self._sample(forward)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        elapsed = time.perf_counter_ns() - started
        self.engine.commit(forward)
        finished_prompts = self._commit(resolved, sampled, forward.input_details, errors)
        all_errors = resolved.errors + tuple(errors)
        self._drop_failed(all_errors)
        return StepOutput(
            step_id=plan.step_id,
            tokens=tuple(SampledToken(rid, detail) for rid, detail in sampled.items()),
            input_tokens=finished_prompts,
            errors=all_errors,
            forward_time_ns=elapsed,
        )

    def _sample(self, forward: Forward) -> tuple[dict[int, TokenDetail], list[SequenceError]]:
        """One token per sampling item, with its details (``step_results.sample_tokens``)."""
        if forward.logits is None or not forward.sample_items:
            return {}, []
        return sample_tokens(forward.logits, forward.sample_items, self.info, self.engine.history)

    def _commit(
        self,
        resolved: ResolvedStep,
        sampled: dict[int, TokenDetail],
        input_details: dict[int, list[TokenDetail]],
        errors: SequenceOf[SequenceError] = (),
    ) -> tuple[InputTokenDetails, ...]:
        completed = commit_step(self.sequences, resolved, sampled, input_details, errors)
        self.engine.forget({e.request_id for e in errors})
        return completed
