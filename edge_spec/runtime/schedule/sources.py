"""Sequence drafts or the drafter model?  Per request, per sequence proposer (prompt lookup).

Both sources keep a running acceptance (EMA); a sequence round costs only its verify pass, a model
round costs its drafter steps too.  The sequence's drafts are taken when they promise at least as
many tokens per second as the model's.
"""

from __future__ import annotations

from dataclasses import dataclass

from edge_spec.runtime.schedule.policy import CostModel, best_gamma, expected_tokens, fold_acceptance


@dataclass
class LookupChoice:
    """Per request: when the sequence offers a lookup draft, take it or run the drafter?

    Both sources keep a running acceptance (EMA).  A lookup round costs only its verify pass; a
    drafter round costs γ drafter steps plus its verify pass (:class:`~edge_spec.runtime.schedule.policy.CostModel`).
    Lookup wins when its expected tokens per second are at least the drafter's.  A proposal that
    loses is still tried every ``probe_every``-th time, so that its acceptance stays current.
    """

    lookup_alpha: float = 0.7
    model_alpha: float = 0.8
    smoothing: float = 0.2
    probe_every: int = 8
    _skipped: int = 0

    def lookup_gamma(self, costs: CostModel | None, gamma_max: int, adaptive: bool) -> int:
        """Lookup drafts to take this round (0: use the drafter)."""
        if costs is None:  # nothing measured yet: trust a lookup that has been doing well
            return gamma_max if self.lookup_alpha >= 0.5 else 0
        lookup_costs = CostModel(0.0, costs.verify)
        gamma = best_gamma(self.lookup_alpha, lookup_costs, gamma_max) if adaptive else gamma_max
        model_gamma = best_gamma(self.model_alpha, costs, gamma_max) if adaptive else gamma_max
        lookup_rate = expected_tokens(self.lookup_alpha, gamma) / lookup_costs.round_cost(gamma)
        model_rate = expected_tokens(self.model_alpha, model_gamma) / costs.round_cost(model_gamma)
        if gamma and lookup_rate >= model_rate:
            return gamma
        self._skipped += 1
        if self._skipped >= self.probe_every:
            self._skipped = 0
            return 1
        return 0

    def update(self, from_lookup: bool, drafted: int, accepted: int) -> None:
        if from_lookup:
            self.lookup_alpha = fold_acceptance(self.lookup_alpha, self.smoothing, drafted, accepted)
        else:
            self.model_alpha = fold_acceptance(self.model_alpha, self.smoothing, drafted, accepted)
