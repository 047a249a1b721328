"""The speculation policy (``draft_policy.py``): per-sequence draft lengths from recent
acceptance, the per-step decision from the batch, probes, and prompt lookup's shadow
proposals checked against the tokens that came."""

from __future__ import annotations

from tests.router.core.test_scheduler import make_state
from tgis.router.core.block_pool import BlockPool
from tgis.router.core.draft_policy import DraftPolicy, DraftStats
from tgis.router.core.speculation import Speculation, SpeculationConfig

POLICY = DraftPolicy(tokens=4)


def accepting(times: int = 6) -> DraftStats:
    stats = DraftStats()
    for _ in range(times):
        POLICY.record(stats, 4, 4)
    return stats


def rejecting(times: int = 1) -> DraftStats:
    stats = DraftStats()
    for _ in range(times):
        POLICY.record(stats, 2, 0)
    return stats


def test_a_new_sequence_drafts_alone_and_an_accepting_one_drafts_in_full() -> None:
    assert POLICY.length(DraftStats()) > 0
    assert POLICY.plan(1, [DraftStats()])
    assert POLICY.length(accepting()) == 4
    assert POLICY.plan(1, [accepting()])


def test_drafts_that_fail_stop_drafting() -> None:
    stats = rejecting()
    assert not POLICY.plan(1, [stats])
    assert POLICY.length(rejecting(4)) == 0
    assert not POLICY.plan(1, [rejecting(4)])


def test_length_follows_the_estimate() -> None:
    stats = DraftStats()
    for _ in range(8):  # about half of each draft's tokens confirmed
        POLICY.record(stats, 4, 1)
    assert 0 < POLICY.length(stats) < 4
    assert POLICY.length(stats) <= POLICY.length(accepting())


def test_the_step_decision_weighs_the_batch() -> None:
    """A step's drafted positions stay within a budget that shrinks as the batch grows (at
    16 sequences none: a decode step is already heavy), and a few accepting sequences do
    not pay for a step run one at a time for many."""
    assert POLICY.budget(1) == POLICY.max_step_tokens - 1 and POLICY.budget(16) == 0
    assert not POLICY.plan(16, [accepting() for _ in range(16)])
    assert POLICY.plan(3, [accepting()] + [rejecting(4)] * 2)  # 3.9 tokens for 3
    assert not POLICY.plan(8, [accepting()] + [rejecting(4)] * 7)
    assert POLICY.plan(4, [accepting() for _ in range(4)])
    assert not POLICY.plan(4, [])  # none may draft (all guided, say)


def test_prompt_lookup_that_finds_nothing_drafts_less() -> None:
    stats = accepting()
    before = POLICY.expected(stats, 4)
    for _ in range(6):
        POLICY.missed(stats)
    assert POLICY.expected(stats, 4) < before / 4
    assert not POLICY.plan(1, [stats])


def test_a_failing_sequence_probes_later_and_backs_off() -> None:
    stats = rejecting(4)
    for _ in range(POLICY.first_probe_after - 1):
        POLICY.skipped(stats)
        assert POLICY.length(stats) == 0
    POLICY.skipped(stats)
    assert POLICY.length(stats) > 0 and POLICY.plan(1, [stats])  # the probe
    POLICY.record(stats, POLICY.length(stats), 0)
    assert stats.probe_after == 2 * POLICY.first_probe_after
    for _ in range(POLICY.first_probe_after):
        POLICY.skipped(stats)
    assert POLICY.length(stats) == 0
    # Without probes (prompt lookup's shadow proposals keep the estimate) it never does.
    quiet = rejecting(4)
    for _ in range(4 * POLICY.first_probe_after):
        POLICY.skipped(quiet, probes=False)
    assert POLICY.length(quiet) == 0


def test_a_confirmed_probe_resumes_drafting() -> None:
    stats = rejecting(4)
    for _ in range(POLICY.first_probe_after):
        POLICY.skipped(stats)
    POLICY.record(stats, 2, 2)
    assert stats.probe_after == 0 and stats.idle_steps == 0
    POLICY.record(stats, 4, 4)
    assert POLICY.length(stats) > 0


def test_always_drafts_in_full_whatever_the_record() -> None:
    """``--speculate-always``: every sequence drafts ``tokens`` in every step, failing or
    not, at any batch size within ``max_batch_size`` (the budget holds them all)."""
    always = DraftPolicy(tokens=4, always=True)
    assert always.length(rejecting(4)) == 4 and always.length(DraftStats()) == 4
    assert always.plan(16, [rejecting(4) for _ in range(16)])
    assert always.plan(1, [])  # drafts or not, the step is one at a time, as before
    assert always.budget(16) == 64
    spec = Speculation(SpeculationConfig(tokens=3, always=True))
    state = make_state(1, 6, 100)
    state.generated_ids = [0]
    state.num_computed = state.known_length - 1
    state.draft_stats = rejecting(4)
    assert spec.applies(1, [state])
    blocks = BlockPool(64, 4)
    state.block_ids = blocks.allocate(2)
    assert spec.drafts(state, blocks) == ((1, 2, 3), 0)


def decoding(generated: list[int], prompt: int = 6) -> Speculation:
    """A Speculation and one decoding sequence whose prompt is ``0..prompt-1``."""
    spec = Speculation(SpeculationConfig(tokens=3))
    state = make_state(1, prompt, 100)
    state.generated_ids = list(generated)
    state.num_computed = state.known_length - 1
    spec.applies(1, [state])  # within the batch size: estimates are kept
    spec.state = state  # type: ignore[attr-defined]
    return spec


def test_shadow_proposals_estimate_acceptance_without_drafting() -> None:
    """Idle steps of a sequence copying its prompt raise its estimate (it would draft in
    full at one stream); one generating what prompt lookup does not propose lowers it."""
    copying = decoding([0])
    state = copying.state  # type: ignore[attr-defined]
    for token in range(1, 6):
        copying.idle(state)
        state.generated_ids.append(token)
        state.num_computed += 1
    copying.idle(state)
    stats = state.draft_stats
    assert stats is not None and stats.rate > 0.7
    assert copying.policy.length(stats) == 3 and copying.applies(1, [state])

    novel = decoding([0])
    state = novel.state  # type: ignore[attr-defined]
    for token in range(6):
        novel.idle(state)
        state.generated_ids.append(50 + token)
        state.num_computed += 1
    novel.idle(state)
    assert state.draft_stats is not None and state.draft_stats.rate < 0.3
    assert not novel.applies(1, [state])
    assert state.draft_stats.probe_after == 0  # prompt lookup never probes


def test_drafts_follow_the_policy_length_within_the_budget() -> None:
    spec = decoding([0])
    state = spec.state  # type: ignore[attr-defined]
    blocks = BlockPool(64, 4)
    state.block_ids = blocks.allocate(2)
    assert spec.drafts(state, blocks) == ((1, 2, 3), 0)  # the prior (0.5): three
    state.draft_stats = rejecting(4)
    spec.applies(1, [state])
    assert spec.drafts(state, blocks) == ((), 0)
    state.draft_stats = accepting()
    spec.applies(1, [state])
    spec.budget = 2  # what the sequences before it left
    assert spec.drafts(state, blocks) == ((1, 2), 0)
    assert spec.budget == 0


def test_no_estimates_above_the_batch_size() -> None:
    """Above ``max_batch_size`` no step drafts, and no proposals are made for estimates."""
    spec = decoding([0])
    state = spec.state  # type: ignore[attr-defined]
    assert not spec.applies(17, [state])
    before = state.draft_stats.asked if state.draft_stats else None
    spec.idle(state)
    spec.idle(state)
    assert (state.draft_stats.asked if state.draft_stats else None) == before
    assert state.draft_stats is not None and not state.draft_stats.shadow
