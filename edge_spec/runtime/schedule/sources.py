"""Sequence drafts or the drafter model?  Per request, per sequence proposer (prompt lookup).

A lookup round costs only its verify pass; a drafter round costs its drafter steps too.  The lookup's
drafts are taken, as many as pay, when the round they make promises at least as many tokens per
second as the drafter's planned round.  Their acceptance comes from the carried calibration by match
length (``schedule.acceptance.SequenceCalibration``), scaled by how this request's lookups do.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from edge_spec.runtime.schedule.acceptance import Agreement, SequenceCalibration
from edge_spec.runtime.schedule.policy import CostModel, plan_round


@dataclass
class LookupChoice:
    """Per request: when the sequence offers drafts, take how many of them (0: use the drafter).  A
    proposal that loses is still tried every ``probe_every``-th time, so that its estimate stays current."""

    calibration: SequenceCalibration
    probe_every: int = 8
    agreement: Agreement = field(default_factory=Agreement)
    _skipped: int = 0

    def lookup_gamma(self, offered: int, matched: int, costs: CostModel | None, gamma_max: int,
                     model_rate: float | None, adaptive: bool) -> int:
        """Drafts to take of the ``offered`` ones (whose source matched ``matched`` tokens) when the
        drafter's round would make ``model_rate`` tokens per second (None: no drafter, or not known)."""
        first, later = self._estimates(matched)
        most = min(offered, gamma_max)
        if costs is None:  # nothing measured yet: trust a lookup that is likely right
            return most if first >= 0.5 else 0
        lookup_costs = CostModel(0.0, costs.verify)
        plan = plan_round(first, later, lookup_costs, most)  # its rate: what lookup can make here at best
        gamma = plan.gamma if adaptive else most
        if gamma and (model_rate is None or plan.rate >= model_rate):
            return gamma
        self._skipped += 1
        if self._skipped >= self.probe_every:
            self._skipped = 0
            return 1
        return 0

    def update(self, matched: int, drafted: int, accepted: int) -> None:
        for i in range(min(drafted, accepted + 1)):
            predicted = self.calibration.first_draft(matched) if i == 0 else self.calibration.later_draft()
            self.agreement.note(predicted, i < accepted)
        self.calibration.record(matched, drafted, accepted)

    def _estimates(self, matched: int) -> tuple[float, float]:
        return (self.agreement.scale(self.calibration.first_draft(matched)),
                self.agreement.scale(self.calibration.later_draft()))
