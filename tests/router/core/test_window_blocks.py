"""KV blocks behind a sliding window go back to the pool (``Scheduler.kv_window``): at the
right step and never one a later query reads, with two steps in flight, through the
prefix cache, a preemption and its recompute, and random workloads whose simulated shard
checks every key a query reads."""

from __future__ import annotations

import pytest

from tgis.router.core.block_pool import BlockPool
from tgis.router.core.request_state import RequestState, RequestStatus
from tgis.router.core.scheduler import Scheduler
from tgis.router.request_types import StopReason

from .test_scheduler import complete, limits, make_state, run_random_workload


def first_kept(computed: int, window: int, block_size: int) -> int:
    """The first block whose positions a query at ``computed`` or later may read."""
    return max(computed - window + 1, 0) // block_size


def test_blocks_wholly_behind_the_window_go_back_after_each_step() -> None:
    """Window 6, blocks of 4: with 13 positions computed the next query (at 13) reads keys
    8..13, so blocks 0 and 1 (positions 0-7) go back; with 12 it reads 7..12, so block 1
    stays. Every step gives back exactly the blocks behind the window, and the sequence
    holds at most the window's blocks and one more."""
    scheduler = Scheduler(BlockPool(64, 4), limits(), kv_window=6)
    state = make_state(1, prompt_len=10, max_new_tokens=30)
    scheduler.add(state)
    released_at: dict[int, int] = {}
    most = 0
    while state.status is RequestStatus.RUNNING or scheduler.waiting:
        step = scheduler.schedule(0.0)
        complete(scheduler, step)
        if state.status is RequestStatus.FINISHED:
            break
        computed = state.num_computed
        released_at[computed] = state.released_blocks
        assert state.released_blocks == first_kept(computed, 6, 4)
        assert len(state.held_blocks) == scheduler.blocks.num_used
        most = max(most, scheduler.blocks.num_used)
    assert released_at[10] == 1 and released_at[12] == 1 and released_at[13] == 2
    assert most <= 3  # 6 keys and the next position span at most 3 blocks of 4
    assert state.finish_reason is StopReason.MAX_TOKENS and scheduler.blocks.num_used == 0


def test_no_window_gives_nothing_back() -> None:
    scheduler = Scheduler(BlockPool(64, 4), limits())
    state = make_state(1, prompt_len=10, max_new_tokens=20)
    scheduler.add(state)
    for _ in range(15):
        complete(scheduler, scheduler.schedule(0.0))
    assert state.num_computed == 24 and state.released_blocks == 0 and len(state.held_blocks) == 6


def test_with_a_step_in_flight_only_the_answered_step_counts() -> None:
    """A step planned on top of another starts where that one ends: when the first is
    answered, the blocks behind its end's window go, not those behind the second's."""
    scheduler = Scheduler(BlockPool(64, 4), limits(), kv_window=4)
    state = make_state(1, prompt_len=9, max_new_tokens=20)
    scheduler.add(state)
    complete(scheduler, scheduler.schedule(0.0))  # the prompt: 9 computed, block 0 goes
    assert state.released_blocks == 1
    first = scheduler.schedule(0.0)  # computes position 9
    second = scheduler.schedule(0.0, base_step_id=first.plan.step_id)  # position 10
    assert state.num_computed == 11
    complete(scheduler, first)
    # The second's queries read keys 7..10: block 1 (positions 4-7) must stay.
    assert state.released_blocks == first_kept(10, 4, 4) == 1 < first_kept(11, 4, 4)
    third = scheduler.schedule(0.0, base_step_id=second.plan.step_id)  # position 11
    complete(scheduler, second)
    assert state.released_blocks == first_kept(11, 4, 4) == 2
    complete(scheduler, third)
    assert state.released_blocks == first_kept(12, 4, 4) == 2
    # A failed step rolls back to where the answered one ended: still inside the window.
    fourth = scheduler.schedule(0.0)
    scheduler.step_failed(fourth)
    assert state.num_computed == 12 and state.released_blocks == 2


def run_alone(scheduler: Scheduler, state: RequestState) -> None:
    scheduler.add(state)
    while state.status is not RequestStatus.FINISHED:
        complete(scheduler, scheduler.schedule(0.0))


def test_given_back_cached_blocks_stay_findable_until_evicted() -> None:
    """With the prefix cache a block is registered before it goes back, so it stays idle
    and findable: the next request with the same prompt starts from it."""
    scheduler = Scheduler(BlockPool(64, 4), limits(), prefix_caching=True, kv_window=4)
    first = make_state(1, prompt_len=12, max_new_tokens=3)
    scheduler.add(first)
    complete(scheduler, scheduler.schedule(0.0))
    given_back = first.block_ids[: first.released_blocks]
    assert given_back and first.registered_blocks >= first.released_blocks
    assert all(scheduler.blocks.refs(b) == 0 and scheduler.blocks.hash_of(b) for b in given_back)
    assert scheduler.blocks.num_idle == len(given_back)
    while first.status is not RequestStatus.FINISHED:
        complete(scheduler, scheduler.schedule(0.0))
    second = make_state(2, prompt_len=12, max_new_tokens=3)
    scheduler.add(second)
    step = scheduler.schedule(0.0)
    assert step.cache_hits == 8 and second.block_ids[:2] == given_back[:2]
    complete(scheduler, step)
    # It gives back the shared blocks behind its window too (they stay cached).
    assert second.released_blocks >= 2 and scheduler.blocks.refs(given_back[0]) == 0
    while second.status is not RequestStatus.FINISHED:
        complete(scheduler, scheduler.schedule(0.0))
    assert scheduler.blocks.num_used == 0


def test_preemption_gives_back_only_the_blocks_still_held_and_the_resume_slides_again() -> None:
    """A preempted windowed sequence lets go of what it holds (its given-back blocks are
    not released twice); its recompute is admitted with blocks for every known token,
    as without a window, and gives back those behind the window once a chunk is done."""
    scheduler = Scheduler(BlockPool(64, 4), limits(prefill=8), kv_window=4)
    state = make_state(1, prompt_len=10, max_new_tokens=20)
    scheduler.add(state)
    for _ in range(8):
        complete(scheduler, scheduler.schedule(0.0))
    assert state.released_blocks > 0
    scheduler.preempt(state)
    assert scheduler.blocks.num_used == 0 and state.released_blocks == 0 and not state.block_ids
    known = state.known_length
    step = scheduler.schedule(0.0)  # resumed: every known position's block, one chunk of 8
    assert len(state.block_ids) == -(-known // 4) == scheduler.blocks.num_used
    complete(scheduler, step)
    assert state.released_blocks == first_kept(8, 4, 4) == 1
    while state.status is not RequestStatus.FINISHED:
        complete(scheduler, scheduler.schedule(0.0))
    assert state.finish_reason is StopReason.MAX_TOKENS and scheduler.blocks.num_used == 0


def test_a_generation_longer_than_the_pool_runs_within_its_window() -> None:
    """Four blocks of 4 hold 16 tokens; a 3-token prompt generating 40 needs only the
    window's blocks at a time, so it runs to the end without a preemption."""
    scheduler = Scheduler(BlockPool(4, 4), limits(), kv_window=5)
    state = make_state(1, prompt_len=3, max_new_tokens=40)
    run_alone(scheduler, state)
    assert state.finish_reason is StopReason.MAX_TOKENS and len(state.generated_ids) == 40
    assert scheduler.preemption_count == 0 and scheduler.blocks.num_free == 4


@pytest.mark.parametrize("seed", range(12))
def test_random_workloads_with_a_window(seed: int) -> None:
    """The random workloads (the prefix cache on odd seeds, drafts on every third) with a
    window of 1 to 17 keys: every key a query reads still holds its own entry, no block a
    sequence still reads is written by another, and every block comes back."""
    window = (1, 2, 3, 5, 8, 17)[seed % 6]
    run_random_workload(seed, caching=seed % 2 == 1, speculating=seed % 3 == 0, window=window)


def test_random_workloads_give_blocks_back_early() -> None:
    """The window matters in those workloads: a sequence gives back blocks while it runs."""
    released = []
    for seed in range(6):
        scheduler, _ = run_random_workload(seed, window=2, caching=seed % 2 == 1)
        released.append(scheduler.window_released)
    assert sum(r > 0 for r in released) >= 4, released
