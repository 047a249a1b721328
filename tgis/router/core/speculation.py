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

**Per step and sequence** (``draft_policy.py``): within that, a step carries drafts only
when the confirmed tokens expected of them (from each sequence's recent acceptance) pay
for a step run one at a time and its drafted positions; each sequence drafts as far as its
estimate makes worth it (none while its drafts would fail). While a sequence does not
draft, prompt lookup still proposes after each of its known tokens and the proposal is
checked against the tokens that come, so its estimate stays current for free (with a
draft model on the shard, it probes now and then instead). Steps without drafts are
planned on top of the one in flight, as without speculation. ``--speculate-always``
(``SpeculationConfig.always``) drafts in every step within ``max_batch_size`` instead.

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
from collections.abc import Sequence
from dataclasses import dataclass

from tgis.router.core.block_pool import BlockPool
from tgis.router.core.draft_policy import DraftPolicy, DraftStats
from tgis.router.core.ngram import NgramIndex
from tgis.router.core.request_state import RequestState, RequestStatus
from tgis.router.core.steps import ScheduledStep, StepUpdate
from tgis.shard_api.messages import StepOutput

__all__ = ["Speculation", "SpeculationConfig"]

SHADOW_GAP = 8
"""A sequence whose shadow proposals fail makes one only every few tokens (doubling up to
this many), so that the router spends little on sequences that would not draft."""


@dataclass(frozen=True)
class SpeculationConfig:
    """``--speculate`` and its policy flags."""

    tokens: int  # drafted tokens per sequence and step, at most
    max_batch_size: int = 16  # running sequences above which it stops
    min_ngram: int = 1  # the shortest suffix looked up (--prompt-lookup-min)
    max_ngram: int = 3  # the longest (--prompt-lookup-max)
    always: bool = False
    """Draft in every step within ``max_batch_size``, whatever the sequences' acceptance
    (``--speculate-always``; ``DraftPolicy.always``)."""


class Speculation:
    """Drafts for the scheduler's decoding sequences, and their reconciliation."""

    def __init__(self, config: SpeculationConfig, shard_drafts: bool = False) -> None:
        self.config = config
        self.shard_drafts = shard_drafts
        """The shard's draft model drafts: ask for a number of drafts, not ids."""
        self.in_flight = False
        """A step with drafts has been sent and not answered."""
        self.policy = DraftPolicy(config.tokens, always=config.always)
        self.budget = 0
        """Drafted positions the step being planned may still carry."""
        self.within_batch = False
        """The latest step planned was within ``max_batch_size`` and the policy's budget
        (beyond them no step drafts, and no estimates are kept up: the proposals would
        cost the router's time at every step)."""

    def applies(self, demand: int, running: Sequence[RequestState] = ()) -> bool:
        """Whether steps are planned with drafts now (and so one at a time), given the
        requests running and queued (a queue that will fill the batch counts already) and,
        by the policy (``draft_policy.py``), the ``running`` sequences' recent acceptance."""
        self.within_batch = False
        if demand > self.config.max_batch_size:
            return False
        decoding = [s for s in running if not s.prefilling]
        self.budget = self.policy.budget(len(decoding))
        if self.budget <= 0:
            return False
        self.within_batch = True
        candidates = (self._stats(s) for s in decoding if self._may_draft(s))
        return self.policy.plan(len(decoding), candidates)

    def idle(self, state: RequestState) -> None:
        """``state`` decodes without drafts in the step being planned: prompt lookup's
        proposals are still made and checked against the tokens that come (its estimate
        stays current); a draft model's are not (its sequences probe instead)."""
        if not self.within_batch:
            return
        stats = self._stats(state)
        self.policy.skipped(stats, probes=self.shard_drafts)
        if self.shard_drafts or not self._may_draft(state):
            return
        generated = state.generated_ids
        if stats.shadow:
            got = generated[stats.shadow_at : stats.shadow_at + len(stats.shadow)]
            same = 0
            while same < len(got) and got[same] == stats.shadow[same]:
                same += 1
            if same < len(got) or same == len(stats.shadow):
                self.policy.observe(stats, len(stats.shadow), same)
                stats.shadow = ()
                stats.shadow_gap = 1 if same else min(2 * stats.shadow_gap, SHADOW_GAP)
        if not stats.shadow and len(generated) >= stats.shadow_at + stats.shadow_gap:
            stats.shadow_at = len(generated)
            stats.shadow = tuple(self._index(state).propose(self.config.tokens))
            if not stats.shadow:
                self.policy.observe(stats, 0, 0)
                stats.shadow_gap = min(2 * stats.shadow_gap, SHADOW_GAP)

    def _index(self, state: RequestState) -> NgramIndex:
        """``state``'s n-gram index, up to date with its known tokens."""
        request = state.request
        index = state.ngram
        if index is None:
            index = state.ngram = NgramIndex(
                self.config.min_ngram, self.config.max_ngram, request.input_ids
            )
        index.extend(state.generated_ids[len(index) - len(request.input_ids) :])
        return index

    @staticmethod
    def _stats(state: RequestState) -> DraftStats:
        if state.draft_stats is None:
            state.draft_stats = DraftStats()
        return state.draft_stats

    @staticmethod
    def _may_draft(state: RequestState) -> bool:
        request = state.request
        left = request.stopping.max_new_tokens - len(state.generated_ids) - 1
        return left >= 1 and not request.sampling.grammar

    def drafts(self, state: RequestState, blocks: BlockPool) -> tuple[tuple[int, ...], int]:
        """Tokens to verify after ``state``'s last known one (its decode already has its
        block): drafted ids, or how many the shard's draft model is to draft."""
        request = state.request
        left = request.stopping.max_new_tokens - len(state.generated_ids) - 1
        stats = self._stats(state)
        wanted = self.policy.length(stats)
        if left < 1 or request.sampling.grammar or state.pending_tokens or not wanted:
            self.idle(state)
            return (), 0
        # As many as the free blocks hold after the decode's (a draft never preempts).
        count = min(wanted, left, self.budget)
        decode_end = state.num_computed + 1
        while count and blocks.missing(state.block_ids, decode_end + count) > blocks.num_free:
            count -= 1
        if self.shard_drafts:
            self.budget -= count
            return (), count
        stats.shadow, stats.shadow_at = (), len(state.generated_ids)
        drafts = tuple(self._index(state).propose(count))
        if count and not drafts:
            self.policy.missed(stats)
        self.budget -= len(drafts)
        return drafts, 0

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
            self.policy.record(self._stats(state), drafted, confirmed)
            if state.status is RequestStatus.RUNNING:
                state.num_computed += confirmed
