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

Inside a round the drafter's own confidence refines this (:class:`DraftRound`):
each draft's acceptance is estimated from its confidence (drafter probability of
the proposed token, per-request estimates per confidence bin), a draft is kept
only if it raises the round's expected tokens per second, and drafting goes on
only while the expected gain of one more token beats its cost (one draft step
plus one more verify row).

Exactness never depends on this choice: γ only changes how many drafts the
verifier sees.
"""

from __future__ import annotations

from collections.abc import Callable
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


def fold_acceptance(alpha: float, smoothing: float, drafted: int, accepted: int) -> float:
    """α after one verified round: a rejection at position k means k accepts and one reject, each
    trial weighted like one EMA step of ``smoothing``.  A round without drafts leaves α as it is."""
    if drafted == 0:
        return alpha
    trials = accepted + (1 if accepted < drafted else 0)
    weight = 1 - (1 - smoothing) ** trials
    return (1 - weight) * alpha + weight * (accepted / trials)


def best_gamma(alpha: float, costs: CostModel, gamma_max: int, prefer_drafting: float = 0.03,
               prefer_shorter: float = 0.03) -> int:
    """The γ in 0..γ_max maximizing expected tokens per second.

    Plain decoding (γ = 0) must win by ``prefer_drafting`` (relative): α is a noisy running estimate,
    near the break-even point both choices cost about the same, and every stretch without drafts
    leaves the drafter to catch up later and α without fresh evidence.  Among drafting lengths the
    shortest within ``prefer_shorter`` of the best is taken: where one more draft is worth about its
    cost (γ = 1 against 2 on a compute-bound CPU), α's noise and the geometric model's optimism
    about the second and later drafts make the longer choice lose more often than it wins.
    """
    rates = [expected_tokens(alpha, g) / costs.round_cost(g) for g in range(gamma_max + 1)]
    if not gamma_max:
        return 0
    top = max(rates[1:])
    best = min(g for g in range(1, gamma_max + 1) if rates[g] * (1 + prefer_shorter) >= top)
    return 0 if rates[0] > rates[best] * (1 + prefer_drafting) else best


@dataclass
class AdaptiveGamma:
    """Per-request state of the γ policy (see module docstring)."""

    gamma_max: int
    alpha: float = 0.8  # optimistic start: the first rounds measure it
    smoothing: float = 0.15  # EMA weight of the newest round
    probe_every: int = 4  # first probe interval; doubles (up to max_probe_every) while probes keep failing
    max_probe_every: int = 64
    by_confidence: ConfidenceAcceptance = field(default_factory=lambda: ConfidenceAcceptance())
    probing: bool = False  # the last choice was a probe
    _rounds_without_draft: int = 0
    _interval: int = 0

    def choose(self, costs: CostModel) -> int:
        self.probing = False
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
        self.probing = True
        return 1

    def begin_round(self, costs: CostModel) -> "DraftRound | None":
        """None: decode this round without drafts.  Otherwise the stop rule for this round's drafts
        (at most the γ* above); a probe round keeps its one draft whatever its confidence (it is
        there to measure α)."""
        gamma = self.choose(costs)
        if gamma == 0:
            return None
        if self.probing:
            return DraftRound(costs, 1, self.alpha, forced=True, acceptance_of=self.acceptance)
        # the round may stop earlier than γ (confidence), never later: measured sweeps show that
        # drafting past the geometric optimum on a confident streak costs more than it brings here
        return DraftRound(costs, gamma, self.alpha, acceptance_of=self.acceptance)

    def acceptance(self, confidence: float) -> float:
        return self.by_confidence.estimate(confidence, self.alpha)

    def update(self, drafted: int, accepted: int, confidences: list[float] | None = None) -> None:
        """Fold one round in (:func:`fold_acceptance`) and its drafts into the confidence bins."""
        if drafted == 0:
            return
        self.alpha = fold_acceptance(self.alpha, self.smoothing, drafted, accepted)
        trials = accepted + (1 if accepted < drafted else 0)
        for i, confidence in enumerate((confidences or [])[:trials]):
            self.by_confidence.update(confidence, i < accepted)


CONFIDENCE_EDGES = (0.3, 0.5, 0.7, 0.85, 0.95)  # bins of the drafter's probability of its own token


@dataclass
class ConfidenceAcceptance:
    """Per-request acceptance estimate by drafter confidence bin: EMA per bin, starting from the
    global α until a bin has seen ``min_samples`` outcomes (the two blend in between)."""

    smoothing: float = 0.2
    min_samples: int = 4
    rates: list[float] = field(default_factory=lambda: [0.0] * (len(CONFIDENCE_EDGES) + 1))
    counts: list[int] = field(default_factory=lambda: [0] * (len(CONFIDENCE_EDGES) + 1))

    @staticmethod
    def bin(confidence: float) -> int:
        return sum(confidence >= edge for edge in CONFIDENCE_EDGES)

    def estimate(self, confidence: float, prior: float) -> float:
        b = self.bin(confidence)
        weight = min(self.counts[b] / self.min_samples, 1.0)
        return weight * self.rates[b] + (1 - weight) * prior

    def update(self, confidence: float, accepted: bool) -> None:
        b = self.bin(confidence)
        self.counts[b] += 1
        if self.counts[b] == 1:
            self.rates[b] = float(accepted)
        else:
            self.rates[b] += self.smoothing * (float(accepted) - self.rates[b])


@dataclass
class DraftRound:
    """Stop rule inside one round: after each draft, keep it or not, and draft another or not.

    ``expected`` is E[tokens] of the round so far (1 for the target's own token plus, per kept
    draft, the probability that it and all before it are accepted); ``cost`` is what the round
    will cost: the drafting done so far plus the verify pass over the kept drafts.
    """

    costs: CostModel
    gamma_max: int
    next_acceptance: float  # acceptance guess for a draft not yet made (its confidence unknown)
    forced: bool = False  # keep every draft (probe rounds)
    acceptance_of: Callable[[float], float] | None = None  # drafter confidence -> acceptance estimate
    margin: float = 0.03  # another draft must beat the round's rate by this much (relative)
    kept: int = 0
    survive: float = 1.0  # P(all kept drafts accepted)
    expected: float = 1.0

    def acceptance(self, confidence: float) -> float:
        """Estimated acceptance of a draft the drafter proposed with this confidence."""
        return self.acceptance_of(confidence) if self.acceptance_of else self.next_acceptance

    def add(self, acceptance: float, may_drop: bool = True) -> tuple[bool, bool]:
        """Fold in draft ``kept + 1`` with estimated ``acceptance``; return (keep it, draft another).

        ``may_drop`` must be False when sampling: dropping a sampled draft because of its own value
        would bias the output (the kept drafts would no longer be plain samples of q).  Stopping
        *after* a draft, based on the drafts so far, is always safe: each position is still either
        verified against q or sampled from p directly.
        """
        drafted = self.kept + 1
        sunk = drafted * self.costs.draft
        with_it = (self.expected + self.survive * acceptance) / (sunk + self.costs.verify_cost(drafted + 1))
        without = self.expected / (sunk + self.costs.verify_cost(drafted))
        if with_it < without and may_drop and not self.forced:
            return False, False
        self.kept = drafted
        self.survive *= acceptance
        self.expected += self.survive
        if drafted >= self.gamma_max:
            return True, False
        rate = self.expected / (sunk + self.costs.verify_cost(drafted + 1))
        gain = self.survive * self.next_acceptance
        extra = self.costs.draft + self.costs.verify_cost(drafted + 2) - self.costs.verify_cost(drafted + 1)
        return True, gain / extra > rate * (1 + self.margin)  # same bias to shorter rounds as best_gamma
