"""How far to draft, per sequence and per step, so that speculation never slows decoding.

**Per sequence** (:class:`DraftStats`): an estimate of ``p``, the chance that a drafted
token is confirmed given that the ones before it were. ``k`` drafts of which ``c`` were
confirmed tried ``c + 1`` tokens (``c`` when all were) with ``c`` successes; both counts
decay by ``decay`` per observation, so the estimate follows the sequence's recent text.
The observations are its verified drafts and, while it does not draft, prompt lookup's
*shadow* proposals checked against the tokens that came (``Speculation.idle``: free,
nothing is verified). From ``p`` the expected confirmed tokens of ``k`` drafts are
``p + p**2 + ... + p**k`` (times the recent fraction of its proposals that were not
empty), and a sequence drafts the longest ``k`` (up to ``--speculate``) whose last token
is still worth verifying (``p**k >= min_marginal``): none while its drafts would fail.
With a draft model on the shard there are no shadows: a sequence that drafts nothing
**probes** after ``probe_after`` idle steps (drafts once as if its estimate were the
prior), each failed probe doubling the wait up to ``max_probe_after``.

**Per step** (:meth:`DraftPolicy.plan`): steps with drafts run one at a time (their
positions depend on what the shard confirms), so the router's work between steps is no
longer hidden behind the forward, and the forward computes the drafted positions too. A
step carries at most ``max_step_tokens - decoding`` drafted positions (:meth:`budget`),
and drafts only when the confirmed tokens expected of it cover its cost:
``sum(expected) >= step_cost * decoding + token_cost * sum(k)``. The constants are
measured (2-core CPU, the embedded model, ``benchmarks/speculation_bench.py``): at one
stream a drafted step took 1.62 ms against 1.1 ms for a plain one (``step_cost`` 0.5 of
a token per sequence) and its forward about 0.07 ms more per drafted position
(``token_cost`` 0.06); at 16 streams, with 70 % of the drafts confirmed, always drafting
gave 0.70x the throughput of no speculation (a step of 16 decodes is already
compute-bound on a CPU, and each drafted position costs about what a sequence's token
does), hence the budget of 12 positions: no drafts from 12 decoding sequences on, few
below.

**Always** (``always``, ``--speculate-always``): every sequence drafts ``tokens`` in every
step, whatever its record and the batch (speculation before this policy, and TGIS's): the
baseline the policy is measured against, and the way to have drafts verified, right and
wrong, on a model whose drafts seldom land (the tests' random models).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["DraftPolicy", "DraftStats"]


@dataclass(slots=True)
class DraftStats:
    """One sequence's recent drafting record (decayed counts)."""

    confirmed: float = 1.0
    tried: float = 2.0
    """The prior: ``p`` = 0.5, so every new sequence drafts in its first steps."""
    found: float = 1.0
    asked: float = 1.0
    """Steps it was asked to draft, and those in which prompt lookup proposed something."""
    idle_steps: int = 0
    """Steps planned since it last drafted (counted while it drafts nothing)."""
    probe_after: int = 0
    """Idle steps after which it probes; 0 while its estimate lets it draft."""
    shadow: tuple[int, ...] = ()
    """Prompt lookup's proposal after its first ``shadow_at`` generated tokens, made while
    it did not draft: compared with the tokens generated, it estimates ``p`` without
    verifying anything (no probes needed)."""
    shadow_at: int = -1
    shadow_gap: int = 1
    """Generated tokens between two shadow proposals (more while they fail)."""

    @property
    def rate(self) -> float:
        return self.confirmed / self.tried


@dataclass(frozen=True)
class DraftPolicy:
    """Per-sequence draft lengths and the per-step decision (module docstring)."""

    tokens: int  # --speculate: drafts per sequence and step, at most
    decay: float = 0.7
    min_marginal: float = 0.1
    step_cost: float = 0.5
    token_cost: float = 0.06
    max_step_tokens: int = 12
    first_probe_after: int = 32
    max_probe_after: int = 256
    prior: float = 0.5
    always: bool = False
    """Draft ``tokens`` per sequence in every step, within no budget (module docstring)."""

    def rate(self, stats: DraftStats) -> float:
        """The estimate this step: at least the prior when it is due to probe."""
        if 0 < stats.probe_after <= stats.idle_steps:
            return max(stats.rate, self.prior)
        return stats.rate

    def length(self, stats: DraftStats) -> int:
        """Drafts worth verifying for a sequence with these stats (0: none this step)."""
        if self.always:
            return self.tokens
        rate = self.rate(stats)
        count, marginal = 0, 1.0
        while count < self.tokens and marginal * rate >= self.min_marginal:
            marginal *= rate
            count += 1
        return count

    def expected(self, stats: DraftStats, count: int) -> float:
        """Confirmed tokens expected of ``count`` drafts."""
        rate = self.rate(stats)
        return stats.found / stats.asked * sum(rate**j for j in range(1, count + 1))

    def budget(self, decoding: int) -> int:
        """Drafted positions a step of ``decoding`` decode sequences may carry."""
        if self.always:
            return self.tokens * max(decoding, 1)
        return max(self.max_step_tokens - decoding, 0)

    def plan(self, decoding: int, candidates: Iterable[DraftStats]) -> bool:
        """Whether a step of ``decoding`` decode sequences should carry drafts, the
        ``candidates`` (the ones that may draft) drafting their :meth:`length` in turn
        within the step's :meth:`budget`."""
        if self.always:
            return True
        left = self.budget(decoding)
        gain = cost = 0.0
        for stats in candidates:
            count = min(self.length(stats), left)
            if count:
                left -= count
                gain += self.expected(stats, count)
                cost += self.token_cost * count
        return gain > 0 and gain >= self.step_cost * max(decoding, 1) + cost

    def skipped(self, stats: DraftStats, probes: bool = True) -> None:
        """A step was planned in which this sequence drafted nothing (``probes``: it is to
        probe after a while, having no other way to learn of its drafts)."""
        stats.idle_steps += 1
        if probes and not stats.probe_after:
            stats.probe_after = self.first_probe_after

    def observe(self, stats: DraftStats, drafted: int, confirmed: int) -> None:
        """Update the estimates: ``confirmed`` of ``drafted`` drafts would have been (or
        were) confirmed; ``drafted`` 0: prompt lookup proposed nothing."""
        decay = self.decay
        stats.asked = stats.asked * decay + 1
        stats.found = stats.found * decay + (1 if drafted else 0)
        if drafted:
            tried = confirmed + (1 if confirmed < drafted else 0)
            stats.confirmed = stats.confirmed * decay + confirmed
            stats.tried = stats.tried * decay + tried

    def missed(self, stats: DraftStats) -> None:
        """It was asked to draft and prompt lookup proposed nothing (the step was planned
        for drafts all the same, so a sequence that often has none drafts less)."""
        probing = 0 < stats.probe_after <= stats.idle_steps
        self.observe(stats, 0, 0)
        self._drafted(stats, probing, failed=True)

    def record(self, stats: DraftStats, drafted: int, confirmed: int) -> None:
        """A verified step: ``confirmed`` of ``drafted`` drafts."""
        probing = 0 < stats.probe_after <= stats.idle_steps
        self.observe(stats, drafted, confirmed)
        self._drafted(stats, probing, failed=not confirmed)

    def _drafted(self, stats: DraftStats, probing: bool, failed: bool) -> None:
        stats.idle_steps = 0
        if probing and failed:
            stats.probe_after = min(2 * stats.probe_after, self.max_probe_after)
        else:
            stats.probe_after = 0
