"""Runs Steps through a transformers model: the generic fallback engine.

``HfRunner`` runs the same step algorithm as the native ``ModelRunner``
(``step.runner.SequenceRunner.step``) on the same Step plans (block ids are validated and
kept, but there is no paging: the engine's batched caches hold the keys and values). Its
part of a step: the engine (``causal`` or ``seq2seq``) runs the forward pass of every
scheduled sequence and returns the logits of those whose prompt is complete;
``sampling.sample`` and ``token_details`` choose the tokens exactly as the native engine
does (rows with NaN logits fail on their own); the engine's caches take the step only
then, and forget a sequence when the runner does.
"""

from __future__ import annotations

import torch

from tgis.shard.fallback.engine import Forward, HfEngine
from tgis.shard.step.plan import PlanLimits, ResolvedStep
from tgis.shard.step.results import sample_tokens, start_masks
from tgis.shard.step.runner import Computed, SequenceRunner
from tgis.shard.step.sequence import Sequence
from tgis.shard_api.messages import (
    InputTokenDetails,
    ModelKind,
    SequenceError,
    ShardInfo,
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

    def _begin_step(self, plan: StepPlan) -> ResolvedStep:
        resolved = super()._begin_step(plan)
        self.engine.forget((*resolved.finished, *resolved.preempted))
        return resolved

    def _compute(self, resolved: ResolvedStep) -> Computed:
        """The engine's forward over every scheduled sequence, then sampling; the engine's
        caches take the step only once sampling succeeded."""
        forward = self.engine.run(resolved.work, self.sequences.keys())
        sampled, errors = self._sample(forward)
        self.engine.commit(forward)
        return Computed(sampled, forward.input_details, errors)

    def _sample(self, forward: Forward) -> tuple[dict[int, TokenDetail], list[SequenceError]]:
        """One token per sampling item, with its details (``step.results.sample_tokens``);
        the guided rows' masks are filled after the forward here (the engine tells its
        sampling rows only then)."""
        if forward.logits is None or not forward.sample_items:
            return {}, []
        masks = start_masks(forward.sample_items, self.grammars, self.device)
        return sample_tokens(
            forward.logits, forward.sample_items, self.info, self.engine.history, masks
        )

    def _commit(self, resolved: ResolvedStep, computed: Computed) -> tuple[InputTokenDetails, ...]:
        completed = super()._commit(resolved, computed)
        self.engine.forget({e.request_id for e in computed.errors})
        return completed
