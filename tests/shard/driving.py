"""Driving a runner as the router does: ``Router`` (block allocation and Step plans, the
stand-in every runner test steps through) and ``drive``, one run of ``PROMPTS`` to
``NEW_TOKENS`` tokens each with an optional preemption and its recompute (the preemption
tests, and the compiled step against the eager one)."""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Mapping
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass

from tgis.shard.native.runtime.model_runner import ModelRunner
from tgis.shard.step.runner import Runner
from tgis.shard_api.messages import (
    DetailOptions,
    NewSequence,
    SamplingParams,
    ScheduledSequence,
    StepOutput,
    StepPlan,
)


class Router:
    """What the real router does for the shard: block allocation and Step plans.

    Blocks come from a shuffled free list, so block tables are never contiguous and freed
    blocks (with stale keys/values) are reused. A model with recurrent state gets each
    running sequence a state slot, highest first, given back when it finishes or is
    preempted (so a freed slot, with a stale state, is reused).
    """

    def __init__(self, runner: ModelRunner, seed: int = 0) -> None:
        self.runner = runner
        self.block_size = runner.info.block_size
        self.free = list(range(runner.info.num_blocks))
        random.Random(seed).shuffle(self.free)
        self.tables: dict[int, list[int]] = {}
        self.computed: dict[int, int] = {}
        self.pending: list[NewSequence] = []
        self.generated: dict[int, list[int]] = {}
        self.outputs: list[StepOutput] = []
        self.step_id = 0
        self._finished: list[int] = []
        self._preempted: list[int] = []
        # Leading blocks borrowed from another sequence (a prefix-cache hit), by request.
        self.shared: dict[int, int] = {}
        self._cached: dict[int, int] = {}
        self.free_slots = list(range(runner.info.state_slots))
        self.slots: dict[int, int] = {}

    def add(
        self,
        request_id: int,
        prompt: Iterable[int],
        sampling: SamplingParams | None = None,
        details: DetailOptions | None = None,
        prefix_id: str = "",
        prefix_length: int = 0,
        adapter_id: str = "",
    ) -> None:
        """Announce a sequence with the next step (with a prompt-tuning prefix or adapter,
        the schedule's counts include its ``prefix_length`` virtual tokens)."""
        self.pending.append(
            NewSequence(
                request_id,
                tuple(prompt),
                sampling or SamplingParams(),
                details or DetailOptions(),
                prefix_id=prefix_id,
                prefix_length=prefix_length,
                adapter_id=adapter_id,
            )
        )
        self.tables[request_id] = []
        self.computed[request_id] = 0
        self.generated[request_id] = []

    def share(self, request_id: int, source_id: int, num_blocks: int) -> None:
        """Give a sequence not yet computed ``source_id``'s first ``num_blocks`` blocks as
        a prefix-cache hit: its next step starts after them (``cached_tokens``)."""
        assert self.computed[request_id] == 0 and not self.tables[request_id]
        self.tables[request_id] = self.tables[source_id][:num_blocks]
        self.shared[request_id] = num_blocks
        self.computed[request_id] = self._cached[request_id] = num_blocks * self.block_size

    def finish(self, request_id: int) -> None:
        """Free the sequence's blocks (not borrowed ones); the shard forgets it with the
        next step."""
        self.free.extend(self.tables.pop(request_id)[self.shared.pop(request_id, 0) :])
        self._release_slot(request_id)
        self._finished.append(request_id)

    def _release_slot(self, request_id: int) -> None:
        if request_id in self.slots:
            self.free_slots.append(self.slots.pop(request_id))

    def _slot(self, request_id: int) -> int | None:
        """The sequence's state slot (taken at its first step), if the model has slots."""
        if not self.runner.info.state_slots:
            return None
        if request_id not in self.slots:
            self.slots[request_id] = self.free_slots.pop()
        return self.slots[request_id]

    def preempt(self, request_id: int) -> None:
        """Take the sequence's blocks back; the shard drops its block table with the next
        step, and it is resumed by scheduling all its known tokens again from position 0."""
        self.free.extend(self.tables[request_id][self.shared.pop(request_id, 0) :])
        self.tables[request_id] = []
        self.computed[request_id] = 0
        self._release_slot(request_id)
        self._preempted.append(request_id)

    def step(self, schedule: Mapping[int, int]) -> StepOutput:
        """Run one Step computing ``schedule[rid]`` tokens of each listed sequence."""
        scheduled = []
        for rid, n in schedule.items():
            need = math.ceil((self.computed[rid] + n) / self.block_size) - len(self.tables[rid])
            blocks = [self.free.pop() for _ in range(max(need, 0))]
            self.tables[rid].extend(blocks)
            self.computed[rid] += n
            cached = self._cached.pop(rid, 0)
            if cached:  # the first step after a hit sends the whole table
                blocks = list(self.tables[rid])
            slot = self._slot(rid)
            scheduled.append(ScheduledSequence(rid, n, tuple(blocks), cached, state_slot=slot))
        self.step_id += 1
        plan = StepPlan(
            step_id=self.step_id,
            new_sequences=tuple(self.pending),
            scheduled=tuple(scheduled),
            finished_request_ids=tuple(self._finished),
            preempted_request_ids=tuple(self._preempted),
        )
        self.pending, self._finished, self._preempted = [], [], []
        output = self.runner.step(plan)
        for sampled in output.tokens:
            self.generated[sampled.request_id].append(sampled.token.token_id)
        self.outputs.append(output)
        return output

    def decode(self, request_ids: Iterable[int]) -> StepOutput:
        """One decode step of each listed sequence."""
        return self.step({rid: 1 for rid in request_ids})

    def speculate(self, drafts: Mapping[int, SequenceOf[int] | int]) -> StepOutput:
        """One decode step of each listed sequence with its drafted tokens (none: a plain
        decode), or with a number of tokens for the shard's draft model to draft; blocks are
        reserved for them all, and each sequence's computed count then advances by the
        tokens it got."""
        scheduled = []
        for rid, drafted in drafts.items():
            spec = drafted if isinstance(drafted, int) else 0
            ids = () if isinstance(drafted, int) else tuple(drafted)
            n = 1 + len(ids)
            need = math.ceil((self.computed[rid] + n + spec) / self.block_size)
            blocks = [self.free.pop() for _ in range(max(need - len(self.tables[rid]), 0))]
            self.tables[rid].extend(blocks)
            slot = self._slot(rid)
            scheduled.append(ScheduledSequence(rid, n, tuple(blocks), 0, ids, spec, slot))
        self.step_id += 1
        plan = StepPlan(step_id=self.step_id, new_sequences=(), scheduled=tuple(scheduled))
        output = self.runner.step(plan)
        for sampled in output.tokens:
            self.generated[sampled.request_id].append(sampled.token.token_id)
            self.computed[sampled.request_id] += 1
        self.outputs.append(output)
        return output


# ---- one run with a preemption (``drive``) -----------------------------------------------

NEW_TOKENS = 14


def prefill_then_decode(
    runner: object, prompts: dict[int, list[int]], new_tokens: int, details: object = None
) -> Router:
    """Prefill ``prompts`` in one step, then decode them together to ``new_tokens`` each."""
    router = Router(runner)  # type: ignore[arg-type]
    for rid, prompt in prompts.items():
        router.add(rid, prompt, details=details)  # type: ignore[arg-type]
    router.step({rid: len(p) for rid, p in prompts.items()})
    for _ in range(new_tokens - 1):
        router.decode(prompts)
    return router


def prompt_of(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 256) for _ in range(length)]


PROMPTS = {1: prompt_of(5, 11), 2: prompt_of(23, 12), 3: prompt_of(9, 13)}


@dataclass(frozen=True)
class Preemption:
    request_id: int
    after_tokens: int  # preempt once it has generated this many (0: mid-prompt, see below)
    pause_steps: int  # steps the others run while it waits (0: resumed in the same step)
    chunk: int  # recompute chunk size


def drive(
    runner: Runner,
    sampling: dict[int, SamplingParams],
    preemption: Preemption | None = None,
    details: DetailOptions | None = None,
) -> Router:
    """Generate NEW_TOKENS for each prompt (prompts prefilled in chunks of 8); with
    ``preemption``, that sequence is preempted once and resumed by a chunked recompute."""
    router = Router(runner)  # type: ignore[arg-type]
    for rid, prompt in PROMPTS.items():
        router.add(rid, prompt, sampling=sampling.get(rid), details=details)
    prefilled = dict.fromkeys(PROMPTS, 0)
    phase, waited, left = "run", 0, 0
    target = preemption.request_id if preemption else None
    while any(len(router.generated[r]) < NEW_TOKENS for r in PROMPTS):
        schedule: dict[int, int] = {}
        for rid, prompt in PROMPTS.items():
            if len(router.generated[rid]) >= NEW_TOKENS:
                continue
            if rid == target and preemption is not None:
                if (
                    phase == "run"
                    and len(router.generated[rid]) == preemption.after_tokens
                    and (preemption.after_tokens > 0 or prefilled[rid] >= 8)
                ):
                    router.preempt(rid)
                    phase, waited = "paused", 0
                if phase == "paused":
                    if waited < preemption.pause_steps:
                        waited += 1
                        continue
                    phase = "recompute"
                    left = len(prompt) + len(router.generated[rid])
                    prefilled[rid] = len(prompt)
                if phase == "recompute":
                    schedule[rid] = min(preemption.chunk, left)
                    left -= schedule[rid]
                    if left == 0:
                        phase, target = "done", None
                    continue
            if prefilled[rid] < len(prompt):
                schedule[rid] = min(8, len(prompt) - prefilled[rid])
                prefilled[rid] += schedule[rid]
            else:
                schedule[rid] = 1
        before = {rid: len(router.generated[rid]) for rid in PROMPTS}
        out = router.step(schedule)
        sampled = {t.request_id for t in out.tokens}
        if preemption is not None and preemption.request_id in schedule:
            rid = preemption.request_id
            # While catching up nothing is sampled; the last recompute chunk samples.
            catching_up = phase == "recompute"
            assert (rid in sampled) == (
                not catching_up and before[rid] + len(PROMPTS[rid]) <= router.computed[rid]
            )
        assert not out.errors
    return router
