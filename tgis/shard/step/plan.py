"""Check a StepPlan against the shard's state before anything changes.

``resolve_plan`` either raises ``InvalidStepError`` (the router broke the protocol; the
shard's state stays as it was) or returns what the step will do: the sequences to forget,
the sequences to preempt, the new sequences to register, one ``WorkItem`` per scheduled
sequence, and per-sequence errors for new sequences that cannot run (these are never
registered).

Preemption: a preempted sequence keeps its token ids, sampling state and counters but loses
its block table and computed count, so its next ``WorkItem`` starts at position 0 (a
recompute of every known token, possibly in chunks, in the same step as the preemption or
later). Nothing is sampled until the last known token is computed (``WorkItem.samples``),
and the prompt-token details are computed only on the prompt's first pass
(``WorkItem.prompt_details``), so a resumed sequence continues exactly where it stopped.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, replace

from tgis.shard.adapters.prefixes import NO_PREFIXES, Prefixes, PrefixUnavailable
from tgis.shard.adapters.request_adapters import NO_ADAPTERS, Adapters
from tgis.shard.errors import InvalidStepError
from tgis.shard.step.chunk_checks import (
    PlanLimits,
    check_cached,
    check_drafts,
    check_state_slot,
)
from tgis.shard.step.guided import NO_GRAMMARS, Grammars, GuidedUnavailable
from tgis.shard.step.sequence import Sequence
from tgis.shard_api.messages import (
    NewSequence,
    SamplingParams,
    ScheduledSequence,
    SequenceError,
    StepPlan,
)


@dataclass(frozen=True, slots=True)
class WorkItem:
    """One scheduled sequence: compute ``token_ids[start:end]``, its block table being the
    first ``prior_blocks`` blocks it had plus ``new_block_ids``.

    Positions are fixed when the plan is resolved, so they stay right while the runner
    commits the step and updates the sequence.
    """

    seq: Sequence
    start: int  # absolute position of the first token computed this step
    end: int  # one past the last position computed (= cached tokens afterwards)
    prior_blocks: int  # blocks of the sequence's table kept (0 when it is resumed)
    new_block_ids: tuple[int, ...]  # blocks appended to the table before the step runs
    samples: bool  # every known token is computed after this step, so one is sampled
    completes_prompt: bool  # this step computes the prompt's last token
    # Input-token details are wanted for this step's prompt positions: asked for, and the
    # prompt's first pass (nothing generated yet; a resumed sequence sent them already).
    prompt_details: bool = False
    # Speculative decoding: tokens drafted after the last known one, computed after it
    # (``end`` counts them) and verified by sampling every one of those positions.
    drafts: tuple[int, ...] = ()
    # Tokens the shard's draft model is to draft (then set as ``drafts``).
    spec_tokens: int = 0
    # The sequence's recurrent-state slot (models with Mamba layers; None: none).
    state_slot: int | None = None

    @classmethod
    def plan(
        cls,
        seq: Sequence,
        num_tokens: int,
        new_block_ids: tuple[int, ...] = (),
        start: int | None = None,
        fresh_table: bool = False,
        drafts: tuple[int, ...] = (),
    ) -> WorkItem:
        """The work of computing ``seq``'s next ``num_tokens`` tokens from ``start``
        (default: its computed count; 0 when it is resumed after a preemption, which also
        drops its old blocks). ``fresh_table``: ``new_block_ids`` is the whole table, the
        first ``start`` positions already in it (a prefix-cache hit). ``drafts``: the last
        ``len(drafts)`` of the ``num_tokens`` are these drafted tokens."""
        start = seq.num_computed if start is None else start
        end = start + num_tokens
        return cls(
            seq=seq,
            start=start,
            end=end,
            prior_blocks=len(seq.block_table) if start and not fresh_table else 0,
            new_block_ids=new_block_ids,
            samples=end - len(drafts) == len(seq.token_ids),
            completes_prompt=start < seq.prompt_len <= end,
            prompt_details=seq.details.input_tokens and seq.num_generated == 0,
            drafts=drafts,
        )

    def input_ids(self) -> list[int]:
        """The token ids of the positions computed this step (drafts included)."""
        known = self.seq.token_ids[self.start : self.end]
        return known + list(self.drafts) if self.drafts else known

    @property
    def num_tokens(self) -> int:
        """Tokens computed this step."""
        return self.end - self.start

    @property
    def block_table(self) -> tuple[int, ...]:
        """The sequence's whole block table for this step (a copy: for checks and tests)."""
        return (*self.seq.block_table[: self.prior_blocks], *self.new_block_ids)


@dataclass(frozen=True)
class ResolvedStep:
    """What a valid StepPlan does."""

    finished: tuple[int, ...]
    preempted: tuple[int, ...]  # known sequences to preempt (after forgetting finished)
    new: tuple[Sequence, ...]
    work: tuple[WorkItem, ...]
    errors: tuple[SequenceError, ...]


def resolve_plan(
    plan: StepPlan,
    sequences: Mapping[int, Sequence],
    limits: PlanLimits,
    dropped: AbstractSet[int] = frozenset(),
    prefixes: Prefixes = NO_PREFIXES,
    adapters: Adapters = NO_ADAPTERS,
    grammars: Grammars = NO_GRAMMARS,
) -> ResolvedStep:
    """Validate ``plan`` against ``sequences`` without changing them.

    ``dropped`` are sequences that failed on their own in an earlier step: the router may
    have scheduled them again before it saw the error, so they are skipped, not refused.
    ``prefixes`` gives new sequences their prompt-tuning prefix and ``adapters`` their
    adapter (a sequence whose prefix or adapter cannot be used fails alone); ``grammars``
    starts the matcher of a constrained one (compiled off this thread).
    """
    finished = set(plan.finished_request_ids)
    preempted = _preempted(plan, sequences, finished, limits)
    new, errors = _new_sequences(plan, sequences, finished, limits, prefixes, adapters, grammars)
    known = _Known(sequences, new, finished, {e.request_id for e in errors}, dropped)
    return ResolvedStep(
        finished=tuple(finished),
        preempted=tuple(sorted(preempted)),
        new=tuple(new.values()),
        work=tuple(_work(plan, known, preempted, limits)),
        errors=tuple(errors),
    )


def _preempted(
    plan: StepPlan, sequences: Mapping[int, Sequence], finished: set[int], limits: PlanLimits
) -> set[int]:
    """The known, unfinished sequences the plan preempts; InvalidStepError when the engine
    cannot recompute one of them."""
    preempted = {
        rid for rid in plan.preempted_request_ids if rid in sequences and rid not in finished
    }
    if not limits.resumes_generated:
        bad_rid = next((r for r in sorted(preempted) if sequences[r].num_generated > 0), None)
        if bad_rid is not None:
            raise InvalidStepError(
                f"request {bad_rid}: this engine cannot preempt a sequence that has "
                "generated tokens"
            )
    return preempted


def _new_sequences(
    plan: StepPlan,
    sequences: Mapping[int, Sequence],
    finished: set[int],
    limits: PlanLimits,
    prefixes: Prefixes,
    adapters: Adapters,
    grammars: Grammars,
) -> tuple[dict[int, Sequence], list[SequenceError]]:
    """The plan's new sequences by id, and the errors of those that fail alone;
    InvalidStepError for an id the shard already knows."""
    new: dict[int, Sequence] = {}
    errors: list[SequenceError] = []
    failed: set[int] = set()
    for ns in plan.new_sequences:
        rid = ns.request_id
        if (rid in sequences and rid not in finished) or rid in new or rid in failed:
            raise InvalidStepError(f"request {rid} is already known to the shard")
        started = _new_sequence(ns, limits.vocab_size, prefixes, adapters, grammars)
        if isinstance(started, SequenceError):
            errors.append(started)
            failed.add(rid)
        else:
            new[rid] = started
    return new, errors


def _new_sequence(
    ns: NewSequence, vocab_size: int, prefixes: Prefixes, adapters: Adapters, grammars: Grammars
) -> Sequence | SequenceError:
    """The sequence ``ns`` starts, or why it cannot run."""
    problem = check_new_sequence(ns, vocab_size)
    prefix = encoder_prefix = lora = guide = None
    if problem is None and ns.sampling.grammar:
        try:
            guide = grammars.guide(ns.sampling.grammar)
        except GuidedUnavailable as e:
            problem = str(e)
    if problem is None and (ns.prefix_id or ns.adapter_id):
        try:
            if ns.prefix_id:
                embeddings = prefixes.embeddings(ns)
                prefix, encoder_prefix = embeddings.decoder, embeddings.encoder
            if ns.adapter_id:
                adapter_prefix, lora = adapters.for_sequence(ns)
                prefix = prefix if adapter_prefix is None else adapter_prefix
        except PrefixUnavailable as e:
            problem = str(e)
    if problem is not None:
        return SequenceError(ns.request_id, problem)
    placeholders = [prefixes.placeholder_id] * ns.prefix_length
    return Sequence(
        request_id=ns.request_id,
        token_ids=placeholders + list(ns.prompt_token_ids),
        prompt_len=ns.prompt_length,
        prefix=prefix,
        encoder_prefix=encoder_prefix,
        lora=lora,
        guide=guide,
        sampling=ns.sampling,
        details=ns.details,
        seed=_seed(ns.sampling),
    )


@dataclass(frozen=True)
class _Known:
    """The sequences a plan's scheduled entries may name: the shard's (unless the plan
    finishes them) and the plan's new ones; new ones that failed, and dropped ones, are
    skipped."""

    sequences: Mapping[int, Sequence]
    new: Mapping[int, Sequence]
    finished: AbstractSet[int]
    failed: AbstractSet[int]
    dropped: AbstractSet[int]

    def get(self, rid: int) -> Sequence | None:
        return self.new.get(rid) or (self.sequences.get(rid) if rid not in self.finished else None)


def _work(
    plan: StepPlan, known: _Known, preempted: AbstractSet[int], limits: PlanLimits
) -> list[WorkItem]:
    """One WorkItem per scheduled sequence, in plan order; InvalidStepError for a sequence
    scheduled twice or unknown."""
    work: list[WorkItem] = []
    seen: set[int] = set()
    slots: set[int] = set()
    for s in plan.scheduled:
        rid = s.request_id
        if rid in known.failed:
            continue
        if rid in seen:
            raise InvalidStepError(f"request {rid} is scheduled twice")
        seen.add(rid)
        if s.state_slot is not None:
            if s.state_slot in slots:
                raise InvalidStepError(f"request {rid}: state_slot {s.state_slot} used twice")
            slots.add(s.state_slot)
        seq = known.get(rid)
        if seq is None:
            if rid in known.dropped and rid not in known.finished:
                continue
            raise InvalidStepError(f"unknown request id {rid}")
        work.append(_work_item(s, seq, rid in preempted, limits))
    return work


def _work_item(s: ScheduledSequence, seq: Sequence, restart: bool, limits: PlanLimits) -> WorkItem:
    """The work of one scheduled sequence (from position 0 when ``restart``, a resume after
    a preemption; after its ``cached_tokens``, a prefix-cache hit); InvalidStepError when
    its token count or blocks do not fit."""
    rid = s.request_id
    computed = 0 if restart else seq.num_computed
    cached = s.cached_tokens
    if cached:
        check_cached(s, seq, computed, limits)
        computed = cached
    drafts = s.draft_token_ids
    if drafts or s.spec_tokens:
        check_drafts(s, seq, computed, limits)
    check_state_slot(s, limits)
    uncomputed = len(seq.token_ids) + len(drafts) - computed
    if not 1 <= s.num_tokens <= uncomputed:
        raise InvalidStepError(
            f"request {rid}: num_tokens {s.num_tokens} but {uncomputed} "
            f"token(s) are waiting to be computed"
        )
    bad = [b for b in s.new_block_ids if b >= limits.num_blocks]
    if bad:
        raise InvalidStepError(
            f"request {rid}: block id {bad[0]} out of range (num_blocks {limits.num_blocks})"
        )
    table_len = (0 if restart or cached else len(seq.block_table)) + len(s.new_block_ids)
    needed = computed + s.num_tokens + s.spec_tokens
    if table_len * limits.block_size < needed:
        raise InvalidStepError(
            f"request {rid}: {table_len} block(s) cannot hold {needed} tokens "
            f"(block size {limits.block_size})"
        )
    item = WorkItem.plan(
        seq, s.num_tokens, s.new_block_ids, computed, fresh_table=cached > 0, drafts=drafts
    )
    if s.state_slot is not None:
        item = replace(item, state_slot=s.state_slot)
    return replace(item, spec_tokens=s.spec_tokens) if s.spec_tokens else item


def check_new_sequence(ns: NewSequence, vocab_size: int) -> str | None:
    """Why a new sequence cannot run, or None."""
    if ns.prompt_length == 0:
        return "empty prompt"
    if ns.prefix_length and not (ns.prefix_id or ns.adapter_id):
        return f"prefix_length {ns.prefix_length} without a prefix_id or adapter_id"
    bad = next((t for t in ns.prompt_token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        return f"prompt token id {bad} out of range (vocab size {vocab_size})"
    return check_sampling(ns.sampling, vocab_size)


def check_sampling(p: SamplingParams, vocab_size: int) -> str | None:
    """Why sampling parameters are unusable, or None."""
    if not p.temperature >= 0:
        return f"invalid temperature {p.temperature}"
    if not 0 < p.top_p <= 1:
        return f"invalid top_p {p.top_p}"
    if not p.repetition_penalty > 0:
        return f"invalid repetition_penalty {p.repetition_penalty}"
    if p.top_k < 0 or p.min_new_tokens < 0:
        return "negative top_k or min_new_tokens"
    if p.length_penalty is not None and not p.length_penalty.decay_factor > 0:
        return f"invalid length penalty decay_factor {p.length_penalty.decay_factor}"
    return _check_openai_sampling(p, vocab_size)


def _check_openai_sampling(p: SamplingParams, vocab_size: int) -> str | None:
    finite = (p.presence_penalty, p.frequency_penalty, p.min_p, *(b for _, b in p.logit_bias))
    if not all(math.isfinite(v) for v in finite):
        return "a penalty, min_p or logit bias that is not finite"
    if not 0 <= p.min_p <= 1:
        return f"invalid min_p {p.min_p}"
    bad = next((t for t, _ in p.logit_bias if not 0 <= t < vocab_size), None)
    if bad is not None:
        return f"logit_bias token id {bad} out of range (vocab size {vocab_size})"
    return None


def _seed(sampling: SamplingParams) -> int:
    """The sequence's seed: 0 when greedy (unused), else the plan's or a fresh one."""
    if sampling.is_greedy:
        return 0
    seed = sampling.seeded().seed
    assert seed is not None
    return seed
