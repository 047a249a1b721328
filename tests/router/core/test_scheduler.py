"""Block accounting, step planning and output handling (pure router logic, no processes).

The property test at the end drives the scheduler as the engine does, with up to two steps
in flight, under random workloads against a simulated shard that checks every plan the way
the real one does (and more: no block is ever in two live block tables).
"""

from __future__ import annotations

import random
from collections import Counter, deque
from dataclasses import dataclass, field

import pytest

from tgis.embedded_model import MODEL_DIR
from tgis.router.core.batching import SchedulerLimits
from tgis.router.core.block_pool import BlockPool, blocks_for
from tgis.router.core.detokenizer import IncrementalDetokenizer
from tgis.router.core.expiry import drop_aborted_and_expired
from tgis.router.core.request_state import RequestState, RequestStatus, TokenEvent
from tgis.router.core.scheduler import Scheduler
from tgis.router.core.speculation import SpeculationConfig
from tgis.router.core.steps import ScheduledStep
from tgis.router.core.stopping import StopChecker
from tgis.router.errors import MAX_DETAIL_CHARS, ConstraintError, GenerationError
from tgis.router.intake.tokenization import RouterTokenizer
from tgis.router.request_types import (
    GenerationParams,
    ResponseOptions,
    SamplingParams,
    StoppingParams,
    StopReason,
    ValidatedRequest,
)
from tgis.shard_api.messages import (
    AdapterKind,
    SampledToken,
    ScheduledSequence,
    SequenceError,
    StepOutput,
    StepPlan,
    TokenDetail,
)

TOKENIZER = RouterTokenizer(str(MODEL_DIR / "tokenizer.json"))
EOS = 2


def make_state(
    request_id: int,
    prompt_len: int,
    max_new_tokens: int,
    prefix: int = 0,
    *,
    lora: str = "",
    tuning: int = 0,
    versions: tuple[str, str] = ("", ""),
) -> RequestState:
    """A request of ``prompt_len`` input tokens, after a prompt prefix of ``prefix`` virtual
    tokens (id ``p<prefix>``) when ``prefix`` > 0, or after a prompt-tuning adapter of
    ``tuning`` virtual tokens (id ``pt<tuning>``) when ``tuning`` > 0; with LoRA adapter
    ``lora`` when it is set; ``versions``: of the adapter's and the prefix's contents."""
    assert not (lora and tuning) and not (prefix and tuning)
    stopping = StoppingParams(max_new_tokens=max_new_tokens)
    sampling = SamplingParams()
    adapter_id, kind = "", None
    if lora:
        adapter_id, kind = lora, AdapterKind.LORA
    elif tuning:
        adapter_id, kind = f"pt{tuning}", AdapterKind.PROMPT_TUNING
    request = ValidatedRequest(
        text="x",
        input_ids=tuple(range(prompt_len)),
        params=GenerationParams(sampling, stopping, ResponseOptions()),
        stopping=stopping,
        sampling=sampling,
        prefix_id=f"p{prefix}" if prefix else "",
        prefix_length=prefix or tuning,
        adapter_id=adapter_id,
        adapter_kind=kind,
        adapter_version=versions[0] if adapter_id else "",
        prefix_version=versions[1] if prefix else "",
    )
    return RequestState(
        request_id=request_id,
        request=request,
        arrival=0.0,
        detokenizer=IncrementalDetokenizer(TOKENIZER, True, eos_token_ids=(EOS,)),
        stop_checker=StopChecker(stopping, (EOS,)),
    )


def limits(batch: int = 8, prefill: int = 1000, **kwargs: object) -> SchedulerLimits:
    return SchedulerLimits(max_batch_size=batch, max_batch_prefill_tokens=prefill, **kwargs)  # type: ignore[arg-type]


def token_for(request_id: int, index: int, eos_every: int = 0, cycle: int = 0) -> int:
    """The token the simulated shard samples at each output position of each request
    (EOS at about one position in ``eos_every`` when it is set; with ``cycle``, the other
    tokens repeat with that period, so that prompt lookup finds them)."""
    h = request_id * 7919 + index * 104729
    if eos_every and h % eos_every == 0:
        return EOS
    if cycle:
        return (request_id + index) % cycle + 3
    return h % 1000 + 3


def complete(scheduler: Scheduler, step: ScheduledStep) -> list[RequestState]:
    """The shard's answer to a step, applied: one token for each sampling sequence.
    Returns the states that got a token."""
    tokens = []
    sampled = []
    for rid in sorted(step.samples):
        state = step.states[rid]
        index = len(state.generated_ids)
        tokens.append(SampledToken(rid, TokenDetail(token_for(rid, index))))
        sampled.append(state)
    scheduler.update(step, StepOutput(step.plan.step_id, tuple(tokens)), 0.0)
    return sampled


# ---- allocator ---------------------------------------------------------------------------


def test_blocks_for_rounds_up() -> None:
    assert [blocks_for(n, 16) for n in (0, 1, 16, 17, 32, 33)] == [0, 1, 1, 2, 2, 3]


def test_allocator_allocates_grows_and_releases() -> None:
    allocator = BlockPool(num_blocks=4, block_size=4)
    owned = allocator.allocate(1)
    assert owned == [0]
    assert allocator.missing(owned, 9) == 2
    assert allocator.grow(owned, 9) == (1, 2)
    assert allocator.grow(owned, 12) == ()
    assert (allocator.num_free, allocator.num_used) == (1, 3)
    with pytest.raises(RuntimeError):
        allocator.grow(owned, 17)  # needs 2 more, 1 free: nothing is taken
    assert allocator.num_free == 1 and len(owned) == 3
    allocator.release(owned)
    assert owned == [] and allocator.num_free == 4


# ---- steps, chunks, admission --------------------------------------------------------------


def test_new_requests_join_the_running_batch_at_the_next_step() -> None:
    scheduler = Scheduler(BlockPool(64, 4), limits())
    first = make_state(1, prompt_len=5, max_new_tokens=10)
    scheduler.add(first)
    step = scheduler.schedule(now=0.0)
    plan = step.plan
    assert [s.request_id for s in plan.new_sequences] == [1]
    # Admission allocates the whole prompt's blocks; the shard hears of them in the chunk.
    assert [(c.request_id, c.num_tokens, c.new_block_ids) for c in plan.scheduled] == [
        (1, 5, (0, 1))
    ]
    assert step.samples == {1} and step.prompt_tokens == 5 and step.admitted == (first,)
    complete(scheduler, step)
    second = make_state(2, prompt_len=3, max_new_tokens=4)
    scheduler.add(second)
    step = scheduler.schedule(now=1.0)
    # One decode token for the running request, the whole prompt of the newcomer.
    assert [(c.request_id, c.num_tokens) for c in step.plan.scheduled] == [(1, 1), (2, 3)]
    assert [s.request_id for s in step.plan.new_sequences] == [2]
    assert step.joined_running_batch and step.prompt_tokens == 3
    assert second.status is RequestStatus.RUNNING and second.started_at == 1.0


def test_steps_planned_on_top_of_unanswered_ones_count_their_tokens() -> None:
    scheduler = Scheduler(BlockPool(64, 4), limits())
    state = make_state(1, prompt_len=5, max_new_tokens=3)
    scheduler.add(state)
    first = scheduler.schedule(0.0)
    # Planned before the first step's token is back: it computes that token.
    second = scheduler.schedule(0.0, base_step_id=first.plan.step_id)
    assert second.plan.base_step_id == first.plan.step_id
    assert [(c.request_id, c.num_tokens) for c in second.plan.scheduled] == [(1, 1)]
    assert state.pending_tokens == 2 and state.num_computed == 6
    complete(scheduler, first)
    third = scheduler.schedule(0.0, base_step_id=second.plan.step_id)
    assert [c.num_tokens for c in third.plan.scheduled] == [1]
    # Three tokens asked for: nothing more is planned until they are back.
    assert state.generation_scheduled and not scheduler.schedule(0.0).plan.scheduled
    complete(scheduler, second)
    complete(scheduler, third)
    assert state.finish_reason is StopReason.MAX_TOKENS and state.pending_tokens == 0
    assert state.generated_ids == [token_for(1, i) for i in range(3)]


def test_a_stop_found_one_step_late_drops_the_token_computed_meanwhile() -> None:
    scheduler = Scheduler(BlockPool(64, 4), limits())
    state = make_state(1, prompt_len=2, max_new_tokens=10)
    scheduler.add(state)
    first = scheduler.schedule(0.0)
    second = scheduler.schedule(0.0, base_step_id=first.plan.step_id)
    eos = SampledToken(1, TokenDetail(EOS))
    update = scheduler.update(first, StepOutput(first.plan.step_id, (eos,)), 0.0)
    ((_, event),) = update.events
    assert isinstance(event, TokenEvent) and event.stop_reason is StopReason.EOS_TOKEN
    assert state.status is RequestStatus.FINISHED and scheduler.blocks.num_free == 64
    late = SampledToken(1, TokenDetail(77))
    assert not scheduler.update(second, StepOutput(second.plan.step_id, (late,)), 0.0).events
    assert state.generated_ids == [EOS]
    assert scheduler.schedule(0.0).plan.finished_request_ids == (1,)


def two_scheduled() -> tuple[Scheduler, RequestState, RequestState, ScheduledStep]:
    """A scheduler with requests 1 and 2 in its first step."""
    scheduler = Scheduler(BlockPool(64, 4), limits())
    a, b = make_state(1, 3, 5), make_state(2, 3, 5)
    scheduler.add(a)
    scheduler.add(b)
    return scheduler, a, b, scheduler.schedule(0.0)


def test_a_sequence_error_fails_only_that_request() -> None:
    scheduler, a, b, step = two_scheduled()
    output = StepOutput(
        step.plan.step_id,
        (SampledToken(1, TokenDetail(50)),),
        errors=(SequenceError(2, "the model produced NaN logits"),),
    )
    update = scheduler.update(step, output, 0.0)
    failed = [e for s, e in update.events if s is b]
    assert len(failed) == 1 and isinstance(failed[0], GenerationError)
    assert b.finish_reason is StopReason.ERROR and a.generated_ids == [50]


def test_a_constraint_failure_is_its_own_error_with_a_bounded_message() -> None:
    scheduler, _, _, step = two_scheduled()
    output = StepOutput(
        step.plan.step_id,
        errors=(
            SequenceError(1, "guided decoding: " + "g" * 20_000, constraint=True),
            SequenceError(2, "e" * 20_000),
        ),
    )
    update = scheduler.update(step, output, 0.0)
    errors = {s.request_id: e for s, e in update.events if isinstance(e, GenerationError)}
    assert isinstance(errors[1], ConstraintError)
    assert type(errors[2]) is GenerationError
    for error in errors.values():
        assert error.message.startswith("Request failed during generation: ")
        assert len(error.detail) == MAX_DETAIL_CHARS and error.detail.endswith("...")


def test_long_prompts_are_chunked_and_decodes_do_not_count_against_the_budget() -> None:
    scheduler = Scheduler(BlockPool(64, 4), limits(prefill=6))
    decoding = make_state(1, prompt_len=2, max_new_tokens=50)
    scheduler.add(decoding)
    complete(scheduler, scheduler.schedule(0.0))
    state = make_state(2, prompt_len=14, max_new_tokens=2)
    scheduler.add(state)
    chunks = []
    while state.in_prompt:
        step = scheduler.schedule(now=0.0)
        plan = step.plan
        assert plan.scheduled[0].request_id == 1 and plan.scheduled[0].num_tokens == 1
        chunks.append(plan.scheduled[1].num_tokens)
        complete(scheduler, step)
    assert chunks == [6, 6, 2]
    assert len(state.block_ids) == blocks_for(14, 4)
    assert state.generated_ids == [token_for(2, 0)]


def test_a_budget_shared_by_chunks_admits_the_last_request_partially() -> None:
    scheduler = Scheduler(BlockPool(64, 4), limits(prefill=10))
    for rid, length in ((1, 4), (2, 9), (3, 2)):
        scheduler.add(make_state(rid, length, 5))
    step = scheduler.schedule(0.0)
    assert [(c.request_id, c.num_tokens) for c in step.plan.scheduled] == [(1, 4), (2, 6)]
    assert [s.request_id for s in scheduler.waiting] == [3]
    complete(scheduler, step)
    step = scheduler.schedule(0.0)  # 1 decodes, 2 finishes its prompt, 3 is admitted
    assert [(c.request_id, c.num_tokens) for c in step.plan.scheduled] == [(1, 1), (2, 3), (3, 2)]


def test_admission_respects_batch_size_and_keeps_headroom() -> None:
    scheduler = Scheduler(BlockPool(8, 4), limits(batch=2))
    states = [make_state(i, prompt_len=8, max_new_tokens=8) for i in range(1, 5)]
    for s in states:
        scheduler.add(s)
    plan = scheduler.schedule(now=0.0).plan
    assert [s.request_id for s in plan.new_sequences] == [1, 2]  # batch size 2
    scheduler.finish(states[0])
    assert scheduler.blocks.num_free == 6  # freed at once
    plan = scheduler.schedule(now=0.0).plan
    assert plan.finished_request_ids == (1,)
    assert [s.request_id for s in plan.new_sequences] == [3]
    # 2 prompt blocks + 1 block of headroom must be free to admit next to others: 2 free.
    scheduler = Scheduler(BlockPool(6, 4), limits())
    for s in [make_state(i, prompt_len=8, max_new_tokens=8) for i in range(1, 4)]:
        scheduler.add(s)
    assert [s.request_id for s in scheduler.schedule(0.0).plan.new_sequences] == [1, 2]
    assert scheduler.blocks.num_free == 2 and len(scheduler.waiting) == 1


def test_a_lone_request_needs_no_headroom() -> None:
    scheduler = Scheduler(BlockPool(4, 4), limits())
    scheduler.add(make_state(1, prompt_len=15, max_new_tokens=1))
    assert [s.request_id for s in scheduler.schedule(0.0).plan.new_sequences] == [1]


@pytest.mark.parametrize(
    ("waiting", "ratio", "joins_at_step"),
    [(1, 1.0, 5), (3, 1.0, 5), (4, 1.0, 1), (2, 0.5, 1), (1, 0.0, 1)],
)
def test_waiting_served_ratio_and_max_waiting_tokens(
    waiting: int, ratio: float, joins_at_step: int
) -> None:
    scheduler = Scheduler(
        BlockPool(256, 4), limits(max_waiting_tokens=5, waiting_served_ratio=ratio)
    )
    for rid in range(1, 5):
        scheduler.add(make_state(rid, 3, 100))
    complete(scheduler, scheduler.schedule(0.0))  # 4 running
    for rid in range(5, 5 + waiting):
        scheduler.add(make_state(rid, 3, 100))
    for step_number in range(1, 8):
        step = scheduler.schedule(0.0)
        complete(scheduler, step)
        if step.plan.new_sequences:
            assert step_number == joins_at_step
            assert len(step.plan.new_sequences) == waiting
            return
    pytest.fail("the waiting requests never joined")


# ---- preemption --------------------------------------------------------------------------


def test_decode_without_a_free_block_preempts_the_youngest() -> None:
    scheduler = Scheduler(BlockPool(6, 4), limits())
    a, b, c = (make_state(i, prompt_len=4, max_new_tokens=50) for i in (1, 2, 3))
    for s in (a, b, c):
        scheduler.add(s)
    step = scheduler.schedule(0.0)
    assert len(step.plan.new_sequences) == 3  # 3 blocks + headroom: all fit
    complete(scheduler, step)
    step = scheduler.schedule(0.0)  # each decode needs its 2nd block: 3 free
    complete(scheduler, step)
    assert scheduler.blocks.num_free == 0
    for _ in range(3):
        complete(scheduler, scheduler.schedule(0.0))
    step = scheduler.schedule(0.0)  # position 8: a 3rd block each, none free
    plan = step.plan
    assert plan.preempted_request_ids == (3,) and step.preemptions == 1
    assert [x.request_id for x in scheduler.running] == [1, 2]
    assert [x.request_id for x in scheduler.waiting] == [3]
    assert c.block_ids == [] and c.num_computed == 0 and c.preemptions == 1
    assert [(x.request_id, x.num_tokens) for x in plan.scheduled] == [(1, 1), (2, 1)]
    assert not plan.new_sequences
    complete(scheduler, step)
    # 3 blocks free, c needs 3 plus one of headroom next to b: not yet.
    scheduler.finish(a)
    step = scheduler.schedule(0.0)
    assert [(x.request_id, x.num_tokens) for x in step.plan.scheduled] == [(2, 1)]
    complete(scheduler, step)
    # Resumed once enough is free: every known token recomputed, nothing new announced.
    scheduler.finish(b)
    known = c.known_length
    step = scheduler.schedule(0.0)
    plan = step.plan
    assert [(x.request_id, x.num_tokens) for x in plan.scheduled] == [(3, known)]
    assert plan.finished_request_ids == (2,) and not plan.new_sequences
    assert not plan.preempted_request_ids and step.admitted == ()  # resumed, not fresh
    sampled = complete(scheduler, step)
    assert c in sampled and c.generated_ids == [token_for(3, i) for i in range(6)]


def test_preempted_while_its_token_is_on_the_way() -> None:
    scheduler = Scheduler(BlockPool(4, 4), limits())
    a, b = make_state(1, 4, 50), make_state(2, 8, 50)
    scheduler.add(a)
    scheduler.add(b)
    first = scheduler.schedule(0.0)  # 1 + 2 blocks
    # On top of it: a takes the last block, b needs a 3rd and is the youngest: it goes.
    second = scheduler.schedule(0.0, first.plan.step_id)
    assert second.plan.preempted_request_ids == (2,)
    assert b.status is RequestStatus.WAITING and b.pending_tokens == 1
    complete(scheduler, first)  # b's first token arrives while it waits
    assert b.generated_ids == [token_for(2, 0)] and b.pending_tokens == 0
    complete(scheduler, second)
    scheduler.finish(a)
    step = scheduler.schedule(0.0)
    # Resumed with the token it got while queued: prompt + 1 recomputed, one sampled.
    assert [(c.request_id, c.num_tokens) for c in step.plan.scheduled] == [(2, 9)]
    complete(scheduler, step)
    assert b.generated_ids == [token_for(2, i) for i in range(2)]


def test_the_needy_youngest_preempts_itself_and_goes_before_fresh_requests() -> None:
    scheduler = Scheduler(BlockPool(4, 4), limits())
    a, b = make_state(1, 4, 50), make_state(2, 8, 50)
    scheduler.add(a)
    scheduler.add(b)
    complete(scheduler, scheduler.schedule(0.0))  # 1 + 2 blocks, 1 free
    scheduler.add(make_state(3, 1, 1))
    # a takes the last block for position 4; b needs one for position 8 and is the youngest.
    plan = scheduler.schedule(0.0).plan
    assert plan.preempted_request_ids == (2,) and [x.request_id for x in plan.scheduled] == [1]
    assert not plan.new_sequences
    assert [x.request_id for x in scheduler.waiting] == [2, 3]


def test_reserve_mode_allocates_the_worst_case_and_never_preempts() -> None:
    scheduler = Scheduler(BlockPool(8, 4), limits(preemption=False))
    states = [make_state(i, prompt_len=4, max_new_tokens=8) for i in range(1, 4)]
    for s in states:
        scheduler.add(s)
    step = scheduler.schedule(0.0)
    assert [s.request_id for s in step.plan.new_sequences] == [1, 2]  # 3 blocks each
    assert step.plan.scheduled[0].new_block_ids == (0, 1, 2)
    complete(scheduler, step)
    while states[0].status is RequestStatus.RUNNING:
        step = scheduler.schedule(0.0)
        plan = step.plan
        assert not plan.preempted_request_ids and all(not c.new_block_ids for c in plan.scheduled)
        complete(scheduler, step)
    assert states[0].finish_reason is StopReason.MAX_TOKENS


def test_finished_and_cancelled_requests_free_blocks_at_once_running_or_queued() -> None:
    scheduler = Scheduler(BlockPool(4, 4), limits())
    a, b, c = make_state(1, 4, 50), make_state(2, 8, 50), make_state(3, 1, 5)
    for s in (a, b, c):
        scheduler.add(s)
    complete(scheduler, scheduler.schedule(0.0))
    assert scheduler.schedule(0.0).plan.preempted_request_ids == (2,)  # queued, shard knows it
    scheduler.finish(c)  # never admitted: nothing for the shard to forget
    scheduler.finish(b)  # queued after preemption: the shard must forget it
    assert scheduler.blocks.num_free == 2
    scheduler.finish(a)
    assert scheduler.blocks.num_free == 4
    plan = scheduler.schedule(0.0).plan
    assert sorted(plan.finished_request_ids) == [1, 2] and not plan.scheduled
    assert not scheduler.has_work


def test_a_failed_step_is_undone_and_its_messages_sent_again() -> None:
    scheduler = Scheduler(BlockPool(4, 4), limits())
    a, b = make_state(1, 4, 50), make_state(2, 8, 50)
    scheduler.add(a)
    scheduler.add(b)
    complete(scheduler, scheduler.schedule(0.0))
    step = scheduler.schedule(0.0)
    assert step.plan.preempted_request_ids == (2,)
    scheduler.step_failed(step)
    assert a.pending_tokens == 0
    scheduler.add(make_state(3, 2, 2))
    again = scheduler.schedule(0.0).plan
    assert again.preempted_request_ids == (2,)
    assert again.scheduled == step.plan.scheduled  # the same work, same blocks announced
    # A new sequence whose announcing step failed is announced again.
    fresh = Scheduler(BlockPool(8, 4), limits())
    fresh.add(make_state(1, 5, 3))
    first = fresh.schedule(0.0)
    fresh.step_failed(first)
    assert fresh.schedule(0.0).plan.new_sequences == first.plan.new_sequences


def test_two_failed_steps_are_undone_latest_first() -> None:
    scheduler = Scheduler(BlockPool(16, 4), limits())
    a = make_state(1, 4, 50)
    scheduler.add(a)
    first = scheduler.schedule(0.0)
    b = make_state(2, 3, 5)
    scheduler.add(b)
    second = scheduler.schedule(0.0, first.plan.step_id)  # a decodes, b is admitted
    scheduler.step_failed(second)
    scheduler.step_failed(first)
    assert (a.num_computed, a.pending_tokens, a.known_to_shard, a.blocks_sent) == (0, 0, False, 0)
    assert (b.num_computed, b.pending_tokens, b.known_to_shard) == (0, 0, False)
    again = scheduler.schedule(0.0).plan
    assert [n.request_id for n in again.new_sequences] == [1, 2]
    assert [(c.request_id, c.num_tokens) for c in again.scheduled] == [(1, 4), (2, 3)]


def test_no_starvation_a_long_head_is_admitted_before_anything_behind_it() -> None:
    scheduler = Scheduler(BlockPool(16, 4), limits(prefill=64))
    rng = random.Random(5)
    next_id = 1
    admitted_order: list[int] = []
    big: RequestState | None = None
    for step_number in range(400):
        if step_number == 3:
            big = make_state(next_id, 60, 2)  # needs 15 of the 16 blocks
            scheduler.add(big)
            next_id += 1
        for _ in range(rng.randrange(0, 3)):  # a steady stream of small requests
            scheduler.add(make_state(next_id, rng.randrange(1, 8), rng.randrange(1, 10)))
            next_id += 1
        step = scheduler.schedule(float(step_number))
        admitted_order += [s.request_id for s in step.plan.new_sequences]
        complete(scheduler, step)
    assert big is not None and big.status is RequestStatus.FINISHED
    assert admitted_order == sorted(admitted_order)  # FIFO: nobody overtook anybody


# ---- prompt prefixes ----------------------------------------------------------------------------


def test_a_prefix_is_prompt_tokens_in_blocks_chunks_and_the_new_sequence() -> None:
    scheduler = Scheduler(BlockPool(64, 4), limits(prefill=8))
    state = make_state(1, prompt_len=5, max_new_tokens=3, prefix=6)
    assert (state.request.input_length, state.prompt_length) == (5, 11)
    scheduler.add(state)
    step = scheduler.schedule(0.0)
    (new,) = step.plan.new_sequences
    # The shard gets the input's ids and the prefix to put in front of them.
    assert (new.prefix_id, new.prefix_length) == ("p6", 6)
    assert new.prompt_token_ids == tuple(range(5)) and new.prompt_length == 11
    # Blocks for prefix + input (11 tokens: 3 blocks of 4), a first chunk of 8 of them.
    assert [(c.num_tokens, c.new_block_ids) for c in step.plan.scheduled] == [(8, (0, 1, 2))]
    assert step.prompt_tokens == 8 and not step.samples and state.in_prompt
    complete(scheduler, step)
    step = scheduler.schedule(0.0)
    assert [(c.num_tokens, c.new_block_ids) for c in step.plan.scheduled] == [(3, ())]
    assert step.samples == {1} and not state.in_prompt
    complete(scheduler, step)
    step = scheduler.schedule(0.0)  # position 11: still the 3rd block
    assert [(c.num_tokens, c.new_block_ids) for c in step.plan.scheduled] == [(1, ())]
    complete(scheduler, step)
    step = scheduler.schedule(0.0)  # position 12: a 4th block
    assert [(c.num_tokens, c.new_block_ids) for c in step.plan.scheduled] == [(1, (3,))]
    complete(scheduler, step)
    assert state.finish_reason is StopReason.MAX_TOKENS
    assert state.generated_ids == [token_for(1, i) for i in range(3)]
    assert scheduler.blocks.num_free == 64


def test_a_prefix_counts_in_admission_and_in_the_reserved_worst_case() -> None:
    # 6 blocks of 4: a 16-token prompt (prefix 12 + input 4) takes 4, leaving no room for
    # another such request next to it (4 blocks + 1 of headroom > 2 free).
    scheduler = Scheduler(BlockPool(6, 4), limits())
    first, second = make_state(1, 4, 2, prefix=12), make_state(2, 4, 2, prefix=12)
    scheduler.add(first)
    scheduler.add(second)
    step = scheduler.schedule(0.0)
    assert [s.request_id for s in step.plan.new_sequences] == [1]
    assert len(first.block_ids) == 4 and list(scheduler.waiting) == [second]
    reserve = Scheduler(BlockPool(64, 4), limits(preemption=False))
    state = make_state(1, prompt_len=5, max_new_tokens=8, prefix=6)
    assert state.worst_case_length == 19
    reserve.add(state)
    reserve.schedule(0.0)
    assert len(state.block_ids) == blocks_for(19, 4)


def test_a_preempted_request_recomputes_its_prefix_too() -> None:
    scheduler = Scheduler(BlockPool(64, 4), limits())
    state = make_state(1, prompt_len=3, max_new_tokens=10, prefix=5)
    scheduler.add(state)
    for _ in range(3):  # the prompt, then two decodes
        complete(scheduler, scheduler.schedule(0.0))
    assert len(state.generated_ids) == 3
    scheduler.preempt(state)
    step = scheduler.schedule(0.0)
    assert step.plan.preempted_request_ids == (1,) and not step.plan.new_sequences
    assert [c.num_tokens for c in step.plan.scheduled] == [5 + 3 + 3]
    assert step.prompt_tokens == 11 and step.samples == {1}


# ---- adapters --------------------------------------------------------------------------------


def running_loras(scheduler: Scheduler) -> set[str]:
    return {s.request.lora_id for s in scheduler.running if s.request.lora_id}


def test_max_loras_holds_a_third_lora_adapter_until_a_slot_frees() -> None:
    scheduler = Scheduler(BlockPool(256, 4), limits(max_loras=2))
    a1 = make_state(1, 4, 50, lora="a")
    b = make_state(2, 4, 50, lora="b")
    plain = make_state(3, 4, 50)
    tuned = make_state(4, 4, 50, tuning=5)
    a2 = make_state(5, 4, 50, lora="a")
    for state in (a1, b, plain, tuned, a2):
        scheduler.add(state)
    step = scheduler.schedule(0.0)
    # Two adapters: every one admitted (plain and prompt-tuning requests take no slot).
    assert step.admitted == (a1, b, plain, tuned, a2)
    assert [(n.adapter_id, n.prefix_id, n.prefix_length) for n in step.plan.new_sequences] == [
        ("a", "", 0),
        ("b", "", 0),
        ("", "", 0),
        ("pt5", "", 5),
        ("a", "", 0),
    ]
    assert [c.num_tokens for c in step.plan.scheduled] == [4, 4, 4, 9, 4]
    complete(scheduler, step)
    c = make_state(6, 4, 50, lora="c")
    behind = make_state(7, 4, 50)
    a3 = make_state(8, 4, 50, lora="a")
    for state in (a3, make_state(9, 4, 50, tuning=3), c, behind):
        scheduler.add(state)
    step = scheduler.schedule(1.0)
    # An adapter already running and a prompt-tuning request join; a third adapter waits,
    # and (FIFO, as for every admission limit) so does what is queued behind it.
    assert [s.request_id for s in step.admitted] == [8, 9]
    assert list(scheduler.waiting) == [c, behind]
    complete(scheduler, step)
    scheduler.finish(a1, StopReason.EOS_TOKEN)
    step = scheduler.schedule(2.0)  # "a" still runs (requests 5 and 8)
    assert not step.admitted and list(scheduler.waiting) == [c, behind]
    complete(scheduler, step)
    scheduler.finish(a2, StopReason.EOS_TOKEN)
    scheduler.finish(a3, StopReason.EOS_TOKEN)  # the last "a"
    step = scheduler.schedule(3.0)
    assert step.admitted == (c, behind) and not scheduler.waiting
    assert running_loras(scheduler) == {"b", "c"}
    assert [n.adapter_id for n in step.plan.new_sequences] == ["c", ""]


def test_a_resumed_lora_request_waits_for_a_slot_too() -> None:
    scheduler = Scheduler(BlockPool(256, 4), limits(max_loras=1))
    a, b = make_state(1, 4, 50, lora="a"), make_state(2, 4, 50, lora="b")
    scheduler.add(a)
    scheduler.add(b)
    step = scheduler.schedule(0.0)
    assert step.admitted == (a,) and list(scheduler.waiting) == [b]
    complete(scheduler, step)
    scheduler.finish(a, StopReason.EOS_TOKEN)
    complete(scheduler, scheduler.schedule(1.0))
    assert scheduler.running == [b]
    scheduler.add(make_state(3, 4, 50, lora="c"))
    scheduler.preempt(b)
    fresh_a = make_state(4, 4, 50, lora="a")
    scheduler.add(fresh_a)
    # b leads the queue again and takes the one slot; c and the rest wait behind it.
    step = scheduler.schedule(2.0)
    assert [c.request_id for c in step.plan.scheduled] == [2]
    assert running_loras(scheduler) == {"b"}
    assert [s.request_id for s in scheduler.waiting] == [3, 4]


def test_without_max_loras_any_number_of_adapters_runs() -> None:
    scheduler = Scheduler(BlockPool(256, 4), limits())
    for rid in range(1, 6):
        scheduler.add(make_state(rid, 4, 5, lora=f"l{rid}"))
    assert len(scheduler.schedule(0.0).admitted) == 5
    assert len(running_loras(scheduler)) == 5


# ---- property test ---------------------------------------------------------------------------


@dataclass
class SimSequence:
    tokens: list[int]
    prompt_len: int
    identity: tuple[str, ...] = ()
    computed: int = 0
    table: list[int] = field(default_factory=list)

    def slot(
        self, position: int, drafts: tuple[int, ...] = ()
    ) -> tuple[tuple[str, ...], tuple[int, ...]]:
        """What the KV entry of ``position`` depends on: the adapter and prefix, and every
        token up to it (drafted ones past the known tokens)."""
        return self.identity, tuple((self.tokens + list(drafts))[: position + 1])

    def first_read(self, window: int) -> int:
        """The first position its next query reads (its whole past without a window)."""
        return max(self.computed - window + 1, 0) if window else 0

    def readable(self, window: int, block_size: int) -> list[int]:
        """The blocks of its table that its next queries read."""
        return self.table[self.first_read(window) // block_size :]


class StepRefused(Exception):
    def __init__(self, stale: bool) -> None:
        self.stale = stale


class SimShard:
    """The shard's bookkeeping, with assertions for every rule a plan must follow, the
    executor's stale-base rule and the skipping of sequences that failed on their own.

    It remembers what every KV slot was computed from (``SimSequence.slot``), so a
    prefix-cache hit is checked to hold exactly the sequence's own keys and values, and a
    block another live sequence still reads is never written. With a sliding ``window``
    the queries read only the keys ``p - window < t <= p`` (each checked to hold the
    sequence's own entry): the blocks of a table before them may be reused."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        rng: random.Random,
        cycle: int = 0,
        window: int = 0,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.window = window
        self.rng = rng
        self.cycle = cycle  # token_for's period
        self.drafted = self.accepted = 0
        self.seqs: dict[int, SimSequence] = {}
        self.dropped: set[int] = set()
        self.last_completed = 0
        self.slots: dict[int, object] = {}  # block * block_size + offset -> what it holds
        self.cache_hits = 0  # tokens started from cached blocks

    def prefill_tokens(self, plan: StepPlan) -> int:
        """Tokens of the plan that are prompt or recompute tokens (not decodes), judged
        before the step runs (so only for a plan whose base is the last step run)."""
        total = 0
        for chunk in plan.scheduled:
            seq = self.seqs.get(chunk.request_id)
            if seq is None or seq.computed < seq.prompt_len or len(seq.tokens) - seq.computed > 1:
                total += chunk.num_tokens
        return total

    def run(self, plan: StepPlan, fail: bool) -> StepOutput:
        if plan.base_step_id and plan.base_step_id != self.last_completed:
            raise StepRefused(stale=True)
        for rid in plan.finished_request_ids:
            self.seqs.pop(rid, None)
            self.dropped.discard(rid)
        for rid in plan.preempted_request_ids:
            if rid in self.seqs:
                self.seqs[rid].computed = 0
                self.seqs[rid].table = []
        if fail:  # out of memory or an error: the forgetting happened, nothing else
            raise StepRefused(stale=False)
        for ns in plan.new_sequences:
            assert ns.request_id not in self.seqs and ns.request_id not in self.dropped
            # Virtual positions come from a prefix or from a prompt-tuning adapter.
            assert not ns.prefix_id or ns.prefix_length > 0
            assert not ns.prefix_length or bool(ns.prefix_id) != ns.adapter_id.startswith("pt")
            # A prefix's virtual positions come first (-1: no token id).
            prompt = [-1] * ns.prefix_length + list(ns.prompt_token_ids)
            identity = (
                ns.adapter_id,
                ns.adapter_version,
                ns.prefix_id,
                ns.prefix_version,
                str(ns.prefix_length),
            )
            self.seqs[ns.request_id] = SimSequence(prompt, ns.prompt_length, identity)
        seen = set()
        tokens = []
        errors = []
        for chunk in plan.scheduled:
            rid = chunk.request_id
            assert rid not in seen
            seen.add(rid)
            if rid not in self.seqs:
                assert rid in self.dropped, f"unknown request {rid}"
                continue
            seq = self.seqs[rid]
            if chunk.cached_tokens:
                self._start_after_cached(seq, chunk)
            drafts = chunk.draft_token_ids
            if drafts:  # a decode, and its drafts after the last known token
                assert seq.prompt_len <= seq.computed == len(seq.tokens) - 1
                assert chunk.num_tokens == 1 + len(drafts)
            else:
                assert 1 <= chunk.num_tokens <= len(seq.tokens) - seq.computed
            seq.table += chunk.new_block_ids
            assert len(seq.table) * self.block_size >= seq.computed + chunk.num_tokens
            if self.window:  # the keys its first query reads are its own
                for position in range(seq.first_read(self.window), seq.computed):
                    block = seq.table[position // self.block_size]
                    slot = self.slots.get(block * self.block_size + position % self.block_size)
                    assert slot == seq.slot(position), f"request {rid} lost KV at {position}"
            for position in range(seq.computed, seq.computed + chunk.num_tokens):
                block = seq.table[position // self.block_size]
                others = [
                    r
                    for r, o in self.seqs.items()
                    if r != rid and block in o.readable(self.window, self.block_size)
                ]
                assert not others, f"request {rid} writes block {block} that {others} hold"
                self.slots[block * self.block_size + position % self.block_size] = seq.slot(
                    position, drafts
                )
            seq.computed += chunk.num_tokens - len(drafts)
            if seq.computed == len(seq.tokens):
                if self.rng.random() < 0.01:  # the sequence fails on its own
                    errors.append(SequenceError(rid, "the model produced NaN logits"))
                    del self.seqs[rid]
                    self.dropped.add(rid)
                    continue
                for token in self._sample(rid, seq, drafts):
                    tokens.append(SampledToken(rid, TokenDetail(token)))
        live = [b for seq in self.seqs.values() for b in seq.table]
        assert all(0 <= b < self.num_blocks for b in live)
        for seq in self.seqs.values():
            readable = seq.readable(self.window, self.block_size)
            assert len(readable) == len(set(readable)), "a block twice in one table"
        self.last_completed = plan.step_id
        return StepOutput(plan.step_id, tuple(tokens), errors=tuple(errors))

    def _sample(self, rid: int, seq: SimSequence, drafts: tuple[int, ...]) -> list[int]:
        """The next token, then one more for every draft equal to the token before it (the
        drafts confirmed count as computed)."""
        generated = len(seq.tokens) - seq.prompt_len
        sampled = [token_for(rid, generated, eos_every=37, cycle=self.cycle)]
        while len(sampled) <= len(drafts) and drafts[len(sampled) - 1] == sampled[-1]:
            sampled.append(token_for(rid, generated + len(sampled), eos_every=37, cycle=self.cycle))
        seq.tokens += sampled
        seq.computed += len(sampled) - 1
        self.drafted += len(drafts)
        self.accepted += len(sampled) - 1
        return sampled

    def _start_after_cached(self, seq: SimSequence, chunk: ScheduledSequence) -> None:
        """A prefix-cache hit: whole blocks, from position 0, at least one token left, and
        every cached slot computed from this sequence's own adapter, prefix and tokens."""
        cached = chunk.cached_tokens
        assert seq.computed == 0 and not seq.table
        assert cached % self.block_size == 0 and cached < len(seq.tokens)
        assert len(chunk.new_block_ids) * self.block_size >= cached + chunk.num_tokens
        for position in range(cached):
            block = chunk.new_block_ids[position // self.block_size]
            slot = self.slots.get(block * self.block_size + position % self.block_size)
            assert slot == seq.slot(position), f"cached position {position} holds other KV"
        seq.computed = cached
        self.cache_hits += cached


def check_invariants(scheduler: Scheduler, lim: SchedulerLimits, cycle: int = 0) -> None:
    pool = scheduler.blocks
    held = Counter(b for s in scheduler.running for b in s.held_blocks)
    assert all(len(s.held_blocks) == len(set(s.held_blocks)) for s in scheduler.running)
    assert len(held) == pool.num_used <= pool.num_blocks
    assert all(pool.refs(b) == held.get(b, 0) for b in range(pool.num_blocks))
    if not scheduler.cache.enabled:
        assert set(held.values()) <= {1} and pool.num_cached == 0
    assert all(not s.block_ids for s in scheduler.waiting)
    assert len(scheduler.running) <= lim.max_batch_size
    if lim.max_loras is not None:
        assert len(running_loras(scheduler)) <= lim.max_loras
    running = [s.request_id for s in scheduler.running]
    waiting = [s.request_id for s in scheduler.waiting]
    # The running batch is a prefix of the arrival order, the queue the rest, in order.
    assert running == sorted(running) and waiting == sorted(waiting)
    assert not running or not waiting or running[-1] < waiting[0]
    for s in scheduler.running + list(scheduler.waiting):
        assert s.pending_tokens >= 0
        expected = [
            token_for(s.request_id, i, eos_every=37, cycle=cycle)
            for i in range(len(s.generated_ids))
        ]
        assert s.generated_ids == expected


def run_random_workload(
    seed: int, caching: bool = False, speculating: bool = False, window: int = 0
) -> tuple[Scheduler, SimShard]:
    """Random arrivals (long and short), cancellations and timeouts of queued or running
    requests, EOS, per-sequence errors, failed shard calls, tight KV capacity (so preemption
    happens), random limits, and one or two steps in flight (as the engine overlaps them);
    every step's plan is checked by ``SimShard`` and every state by ``check_invariants``;
    then everything drains. Every prompt starts with the same ids, so with ``caching`` the
    prefix cache finds blocks of other requests (same adapter and prefix, same versions of
    their contents) and its own after a preemption. With ``speculating``, the simulated
    model's tokens repeat (so prompt lookup drafts some right) and decodes carry drafts
    while few sequences run: the shard checks each drafted chunk, confirms the drafts equal
    to its tokens, and the router's counts must follow. With a sliding ``window``, blocks
    behind it are given back and reused while their sequences run."""
    rng = random.Random(seed)
    prefix_rng = random.Random(seed + 1_000_000)  # leaves the workload's own draws alone
    adapter_rng = random.Random(seed + 2_000_000)  # so does this one
    # Adapters and prefixes come in two versions of their contents (rewritten in a store).
    version_rng = random.Random(seed + 3_000_000)
    block_size = rng.choice([1, 2, 4, 16])
    max_len = rng.randrange(8, 80)
    num_blocks = blocks_for(max_len, block_size) + rng.randrange(0, 12)
    lim = SchedulerLimits(
        max_batch_size=rng.randrange(1, 10),
        max_batch_prefill_tokens=rng.randrange(1, 3 * max_len),
        max_waiting_tokens=rng.randrange(0, 6),
        waiting_served_ratio=rng.choice([0.0, 0.5, 1.2, 2.0]),
        preemption=rng.random() < 0.85,
        max_loras=adapter_rng.choice([None, 1, 2, 3]),
    )
    depth = rng.choice([1, 2, 2])
    spec_rng = random.Random(seed + 4_000_000)
    speculation = (
        SpeculationConfig(
            tokens=spec_rng.choice([1, 3, 5]),
            max_batch_size=spec_rng.choice([1, 3, 16]),
            min_ngram=1,
            max_ngram=spec_rng.choice([1, 2, 3]),
        )
        if speculating
        else None
    )
    scheduler = Scheduler(
        BlockPool(num_blocks, block_size), lim, caching, speculation, kv_window=window
    )
    cycle = 5 if speculating else 0
    shard = SimShard(num_blocks, block_size, rng, cycle, window)
    states: list[RequestState] = []
    in_flight: deque[ScheduledStep] = deque()
    next_id = 1
    steps = rng.randrange(60, 300)
    for step_number in range(100_000):
        now = float(step_number)
        arriving = step_number < steps and next_id <= 80
        if arriving:
            for _ in range(rng.choice([0, 0, 1, 1, 2, 4])):
                prompt = rng.randrange(1, max_len)
                # Part of the prompt may be a prompt prefix's virtual tokens.
                prefix = prefix_rng.choice([0, 0, prefix_rng.randrange(0, prompt)])
                # Some use a LoRA adapter (of 5); some prefixes are prompt-tuning adapters.
                lora = adapter_rng.choice(["", "", f"lora{adapter_rng.randrange(5)}"])
                tuning = prefix if not lora and adapter_rng.random() < 0.3 else 0
                state = make_state(
                    next_id,
                    prompt - prefix,
                    rng.randrange(1, max_len - prompt + 1),
                    prefix - tuning,
                    lora=lora,
                    tuning=tuning,
                    versions=(version_rng.choice("12"), version_rng.choice("12")),
                )
                scheduler.add(state)
                states.append(state)
                next_id += 1
            for _ in range(rng.choice([0, 0, 0, 1])):  # cancel or time out anything
                live = [s for s in states if s.status is not RequestStatus.FINISHED]
                if live:
                    rng.choice(live).aborted = True
        elif not scheduler.has_work and not in_flight:
            break
        while len(in_flight) < depth:
            drop_aborted_and_expired(scheduler, now)
            base = in_flight[-1].plan.step_id if in_flight else 0
            step = scheduler.schedule(now, base)
            plan = step.plan
            if not in_flight:
                assert shard.prefill_tokens(plan) <= lim.max_batch_prefill_tokens
            assert len(plan.scheduled) <= lim.max_batch_size
            if not lim.preemption:
                assert not plan.preempted_request_ids
            if not plan.has_message:
                break
            in_flight.append(step)
        if not in_flight:
            continue
        step = in_flight.popleft()
        fail = arriving and rng.random() < 0.05
        try:
            output = shard.run(step.plan, fail)
        except StepRefused as refused:
            assert not refused.stale, "the oldest step in flight is never stale"
            later = list(in_flight)
            in_flight.clear()
            for other in later:
                with pytest.raises(StepRefused):
                    shard.run(other.plan, False)
            for other in reversed(later):
                scheduler.step_failed(other)
            scheduler.step_failed(step)
            if not (rng.random() < 0.5 and scheduler.retry_without_younger_half(step)):
                scheduler.hold_admissions = False
                scheduler.fail_step(step, "failed")
        else:
            scheduler.hold_admissions = False
            scheduler.update(step, output, now)
        check_invariants(scheduler, lim, cycle)
    else:
        pytest.fail("the workload never drained")
    assert scheduler.blocks.num_free == num_blocks
    assert not shard.seqs, "the shard still holds sequences the router forgot"
    assert not shard.dropped, "the shard still remembers failed sequences"
    assert all(s.status is RequestStatus.FINISHED for s in states)
    assert all(s.pending_tokens == 0 for s in states)
    for s in states:
        if s.finish_reason is StopReason.MAX_TOKENS:
            assert len(s.generated_ids) == s.request.stopping.max_new_tokens
        assert len(s.generated_ids) <= s.request.stopping.max_new_tokens
    assert scheduler.blocks.num_used == 0
    return scheduler, shard


@pytest.mark.parametrize("seed", range(40))
def test_random_workloads_never_exceed_capacity_and_return_every_block(seed: int) -> None:
    run_random_workload(seed)


@pytest.mark.parametrize("seed", range(40))
def test_random_workloads_with_the_prefix_cache(seed: int) -> None:
    """The same workloads with the prefix cache: every hit holds the request's own KV (the
    simulated shard checks each cached slot), no held block is written by another, and
    every block comes back."""
    run_random_workload(seed, caching=True)


@pytest.mark.parametrize("seed", range(40))
def test_random_workloads_with_speculation(seed: int) -> None:
    """The same workloads with drafts (and the prefix cache on every other seed): every
    drafted chunk follows the shard's rules, confirmed drafts count as computed, and no
    cached block holds a rejected draft's KV."""
    run_random_workload(seed, caching=seed % 2 == 0, speculating=True)


def test_random_workloads_draft_and_confirm() -> None:
    shards = [run_random_workload(seed, speculating=True)[1] for seed in range(8)]
    assert sum(s.accepted > 0 for s in shards) >= 6, [(s.drafted, s.accepted) for s in shards]


def test_random_workloads_preempt_and_hit_the_cache() -> None:
    counts = [run_random_workload(seed)[0].preemption_count for seed in range(8)]
    assert sum(c > 0 for c in counts) >= 4, counts
    hits = [run_random_workload(seed, caching=True)[1].cache_hits for seed in range(8)]
    assert sum(h > 0 for h in hits) >= 6, hits


def test_budget_holds_count_steps_that_leave_the_head_waiting_for_prefill_budget() -> None:
    scheduler = Scheduler(BlockPool(64, 4), limits(batch=8, prefill=10))
    first, second = make_state(1, prompt_len=10, max_new_tokens=2), make_state(2, 3, 2)
    scheduler.add(first)
    scheduler.add(second)
    step = scheduler.schedule(now=0.0)
    assert [s.request_id for s in step.plan.new_sequences] == [1]  # the budget went to the first
    assert step.budget_hold and scheduler.budget_holds == 1
    complete(scheduler, step)
    step = scheduler.schedule(now=0.0)
    assert [s.request_id for s in step.plan.new_sequences] == [2]
    assert not step.budget_hold and scheduler.budget_holds == 1
