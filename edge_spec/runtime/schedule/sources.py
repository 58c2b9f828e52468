"""Sequence drafts or the drafter model?  Per request, per sequence proposer (prompt lookup).

A lookup round costs only its verify pass; a drafter round costs its drafter steps too.  The lookup's
drafts are taken, as many as pay, when the round they make promises at least as many tokens per
second as the drafter's planned round.  The first draft is the token a free guess would carry (the
same longest match), so its chance is the guess's, by match length and checked every round
(``RequestAcceptance.guess``): lookup and a draft-less round can never disagree about it.  Later
drafts come from the carried ``SequenceCalibration``, scaled by how this request's later drafts do.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from edge_spec.runtime.schedule.acceptance import Agreement, RequestAcceptance, SequenceCalibration
from edge_spec.runtime.schedule.policy import CostModel, plan_round


@dataclass
class LookupChoice:
    """Per request: when the sequence offers drafts, take how many of them (0: use the drafter).  A
    proposal that loses is still tried every ``probe_every``-th time, so that its estimate stays current."""

    calibration: SequenceCalibration
    estimates: RequestAcceptance  # the request's guess estimates: a lookup's first draft is its guess
    probe_every: int = 8
    agreement: Agreement = field(default_factory=Agreement.for_request)
    # True: the proposer's first draft is not the guess's token (``propose.suffix``): it is judged on its
    # own, by match length and agreement, every round it offers one, taken or not
    own_first: bool = False
    first_agreement: Agreement = field(default_factory=Agreement.for_request)
    _skipped: int = 0

    def lookup_gamma(
        self,
        offered: int,
        matched: int,
        costs: CostModel | None,
        gamma_max: int,
        model_rate: float | None,
        adaptive: bool,
        share: float = 1.0,
        cached: bool = False,
    ) -> int:
        """Drafts to take of the ``offered`` ones (whose source matched ``matched`` tokens) when the
        drafter's round would make ``model_rate`` tokens per second (None: no drafter, or not known).
        ``share``: how many of the source's occurrences agreed on the first draft (suffix drafts);
        ``cached``: only earlier requests' text has it (suffix drafts)."""
        first, later = self._estimates(matched, share, cached)
        most = min(offered, gamma_max)
        if costs is None:  # nothing measured yet: trust a lookup that is likely right
            return most if first >= 0.5 else 0
        lookup_costs = replace(costs, draft=0.0, drafter_drafts=False)
        plan = plan_round(first, later, lookup_costs, most)  # its rate: what lookup can make here at best
        gamma = plan.gamma if adaptive else most
        if gamma and (model_rate is None or plan.rate >= model_rate):
            return gamma
        self._skipped += 1
        if self._skipped >= self.probe_every:
            self._skipped = 0
            return 1
        return 0

    def judge(
        self, offered: list[int], matched: int, produced: list[int], share: float = 1.0, cached: bool = False
    ) -> None:
        """What the source ``offered`` this round (after a ``matched``-token match), taken or not, against
        the tokens the round ``produced``: each offered draft whose predecessors all equal the produced
        tokens would have been accepted iff it equals the produced token at its place, so its fate is
        known for free as far as the round produced tokens.  Judging only the rounds that took the
        sequence's drafts learns later drafts slowly and from a biased sample: a request whose short
        matches lose is drafted by the model most rounds, and its estimate stays the carried one that
        copying requests made.  Under sampling each produced token is a draw from the target's
        distribution at its place (accepted or not), so the comparison is as unbiased as the greedy one."""
        if not offered or not produced:
            return
        if self.own_first:
            self.record_first(matched, share, produced[0] == offered[0], cached)
        predicted = self.calibration.later_draft(matched)
        for place in range(1, min(len(offered), len(produced))):
            if offered[place - 1] != produced[place - 1]:  # a wrong draft ends what the offer is judged on
                break
            right = offered[place] == produced[place]
            self.agreement.note(predicted, right)
            self.calibration.record_later(matched, right)

    def record_first(self, matched: int, share: float, right: bool, cached: bool = False) -> None:
        """Whether the first draft the source offered this round equals the target's token there (taken
        or not: checked for free, as the guess is)."""
        self.first_agreement.note(self.calibration.first_draft(matched, share, cached), right)
        self.calibration.record_first(matched, share, right, cached)

    def _estimates(self, matched: int, share: float = 1.0, cached: bool = False) -> tuple[float, float]:
        later = self.agreement.scale(self.calibration.later_draft(matched))
        if self.own_first:
            return self.first_agreement.scale(self.calibration.first_draft(matched, share, cached)), later
        return self.estimates.guess(matched), later
