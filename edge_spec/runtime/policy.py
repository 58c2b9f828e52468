"""Choosing the draft length γ each round from measured costs and the running acceptance rate.

On a compute-bound CPU a verify pass over γ+1 positions costs much more than
one decoding step, and the drafter is far from free, so a fixed γ loses
whenever acceptance drops (chat, translation).  Each round we pick

    γ* = argmax_γ  E[tokens | γ] / cost(γ),   γ in 0..γ_max

with E[tokens | γ] = 1 + α + ... + α^γ for per-token acceptance α (geometric
model, as in the speculative decoding papers) and
cost(γ) = γ · t_draft + t_verify(γ + 1), where t_verify(n) is the measured
latency of a target pass over n new tokens.  γ* = 0 is plain autoregressive
decoding; while in that regime a γ = 1 probe every ``probe_every`` rounds keeps
α up to date.  α is an exponential moving average of per-round acceptance.

Exactness never depends on this choice: γ only changes how many drafts the
verifier sees.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CostModel:
    """Latencies in seconds.  ``verify[n]``: target pass over n new tokens; ``draft``: one draft step."""

    draft: float
    verify: dict[int, float] = field(default_factory=dict)

    def verify_cost(self, n: int) -> float:
        """Measured latency for n new tokens; between measurements interpolate linearly, outside them
        scale the nearest one with a prior of +25% per extra row (what int4 matmuls cost here)."""
        if n in self.verify:
            return self.verify[n]
        known = sorted(self.verify)
        if not known:
            raise ValueError("cost model has no verify measurements")
        below = [k for k in known if k < n]
        above = [k for k in known if k > n]
        if below and above:
            lo, hi = below[-1], above[0]
            return self.verify[lo] + (n - lo) / (hi - lo) * (self.verify[hi] - self.verify[lo])
        nearest = below[-1] if below else above[0]
        return self.verify[nearest] * (1 + 0.25 * (n - 1)) / (1 + 0.25 * (nearest - 1))

    def round_cost(self, gamma: int) -> float:
        return gamma * self.draft + self.verify_cost(gamma + 1)


def expected_tokens(alpha: float, gamma: int) -> float:
    """Tokens emitted by one round of γ drafts when each draft is accepted with probability α."""
    return sum(alpha**i for i in range(gamma + 1))


def best_gamma(alpha: float, costs: CostModel, gamma_max: int) -> int:
    """The γ in 0..γ_max maximizing expected tokens per second."""
    rates = [expected_tokens(alpha, g) / costs.round_cost(g) for g in range(gamma_max + 1)]
    return max(range(gamma_max + 1), key=lambda g: (rates[g], -g))


@dataclass
class AdaptiveGamma:
    """Per-request state of the γ policy (see module docstring)."""

    gamma_max: int
    alpha: float = 0.8  # optimistic start: the first rounds measure it
    smoothing: float = 0.3  # EMA weight of the newest round
    probe_every: int = 8  # first probe interval; doubles (up to max_probe_every) while probes keep failing
    max_probe_every: int = 64
    _rounds_without_draft: int = 0
    _interval: int = 0

    def choose(self, costs: CostModel) -> int:
        gamma = best_gamma(self.alpha, costs, self.gamma_max)
        if gamma > 0:
            self._rounds_without_draft = 0
            self._interval = self.probe_every
            return gamma
        self._interval = self._interval or self.probe_every
        self._rounds_without_draft += 1
        if self._rounds_without_draft < self._interval:
            return 0
        # probe: one draft token keeps α current; a probe costs a drafter catch-up, so back off
        self._rounds_without_draft = 0
        self._interval = min(2 * self._interval, self.max_probe_every)
        return 1

    def update(self, drafted: int, accepted: int) -> None:
        """Fold one round in.  A rejection at position k means k accepts and one reject."""
        if drafted == 0:
            return
        trials = accepted + (1 if accepted < drafted else 0)
        observed = accepted / trials
        weight = 1 - (1 - self.smoothing) ** trials
        self.alpha = (1 - weight) * self.alpha + weight * observed
