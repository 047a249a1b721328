"""Speculative decoding, the router's half: which decoding sequences get drafted tokens, and
what a step that verified drafts did to their counts.

**Policy.** Speculation pays while the running batch is small (a decode step is bound by
reading the weights, so verifying a few more tokens per sequence costs little) and costs
when it is large, as the anchors' users report. It applies to steps planned while at most
``max_batch_size`` requests run or wait (TGIS's ``SPECULATOR_MAX_BATCH_SIZE``, 16): the
queue counts, or a closed loop of many clients, whose batch empties and refills as its
requests end together, would speculate through every refill. Drafts need
every sequence's latest token and a step's accepted count changes the next step's
positions, so those steps run one at a time: nothing is planned on top of a step in
flight while speculation applies (the overlap resumes above the batch size).

**Drafts** (``ngram.py``): prompt lookup over the input and generated ids, at most
``tokens`` of them and never past ``max_new_tokens``; none for a guided sequence (its
matcher follows sampled tokens only) or when the KV blocks for them are not free (a draft
never preempts anything). With a draft model on the shard (``ShardInfo.draft_model``) the
router asks for that many drafts instead (``ScheduledSequence.spec_tokens``), within the
same limits.

**Counts.** A drafted chunk counts ``1 + k`` tokens but advances ``num_computed`` by one
when planned, like a decode; ``reconcile`` adds the drafts the shard confirmed once the
output is back (each confirmed draft's KV entry is valid; the positions after it are
overwritten later), so a failed step undoes exactly what was planned.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from tgis.router.core.block_pool import BlockPool
from tgis.router.core.ngram import NgramIndex
from tgis.router.core.request_state import RequestState, RequestStatus
from tgis.router.core.steps import ScheduledStep, StepUpdate
from tgis.shard_api.messages import StepOutput

__all__ = ["Speculation", "SpeculationConfig"]


@dataclass(frozen=True)
class SpeculationConfig:
    """``--speculate`` and its policy flags."""

    tokens: int  # drafted tokens per sequence and step, at most
    max_batch_size: int = 16  # running sequences above which it stops
    min_ngram: int = 1  # the shortest suffix looked up (--prompt-lookup-min)
    max_ngram: int = 3  # the longest (--prompt-lookup-max)


class Speculation:
    """Drafts for the scheduler's decoding sequences, and their reconciliation."""

    def __init__(self, config: SpeculationConfig, shard_drafts: bool = False) -> None:
        self.config = config
        self.shard_drafts = shard_drafts
        """The shard's draft model drafts: ask for a number of drafts, not ids."""
        self.in_flight = False
        """A step with drafts has been sent and not answered."""

    def applies(self, demand: int) -> bool:
        """Whether steps are planned with drafts now (and so one at a time), given the
        requests running and queued: a queue that will fill the batch counts already."""
        return demand <= self.config.max_batch_size

    def drafts(self, state: RequestState, blocks: BlockPool) -> tuple[tuple[int, ...], int]:
        """Tokens to verify after ``state``'s last known one (its decode already has its
        block): drafted ids, or how many the shard's draft model is to draft."""
        request = state.request
        left = request.stopping.max_new_tokens - len(state.generated_ids) - 1
        if left < 1 or request.sampling.grammar or state.pending_tokens:
            return (), 0
        # As many as the free blocks hold after the decode's (a draft never preempts).
        count = min(self.config.tokens, left)
        decode_end = state.num_computed + 1
        while count and blocks.missing(state.block_ids, decode_end + count) > blocks.num_free:
            count -= 1
        if self.shard_drafts:
            return (), count
        index = state.ngram
        if index is None:
            index = state.ngram = NgramIndex(
                self.config.min_ngram, self.config.max_ngram, request.input_ids
            )
        index.extend(state.generated_ids[len(index) - len(request.input_ids) :])
        return tuple(index.propose(count)), 0

    def reconcile(self, step: ScheduledStep, output: StepOutput, update: StepUpdate) -> None:
        """Count the drafts each running sequence's step confirmed as computed, before its
        tokens are accepted; record what was drafted and confirmed."""
        if not step.drafted:
            return
        self.in_flight = False
        got = Counter(t.request_id for t in output.tokens)
        update.speculative_steps += 1
        for rid, drafted in step.drafted.items():
            confirmed = max(got.get(rid, 0) - 1, 0)
            update.drafted_tokens += drafted
            update.accepted_tokens += confirmed
            state = step.states[rid]
            if state.status is RequestStatus.RUNNING:
                state.num_computed += confirmed
