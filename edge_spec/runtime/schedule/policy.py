"""How many drafts a round gets: plan the whole round against the measured row-cost curve.

A round of γ drafts costs ``γ·t_draft + t_verify(γ + 1) + t_round`` and emits ``1 + a1 + a1·a2 + ...``
tokens in expectation, where ``a_k`` is the chance that draft k is accepted once the drafts before it
were.  ``t_round`` is what every round spends outside the models (planning, lookup, verification
maths; ``RoundOverhead``, measured live).  ``t_verify(n)`` is measured for every n (``cost_profile``),
and on a CPU it is far from linear: ORT's int8 ``MatMulNBits`` kernel works on two rows per pass over
the weights, so a third row costs a whole pass and a fourth almost nothing.  A rule that weighs one
more draft at a time stops at two rows where four pay; so each decision here compares every length
the round could still reach.

* Before drafting (:func:`plan_round`): the γ in 0..γ_max with the most expected tokens per second,
  from the first-draft estimate and the estimate for later drafts (``schedule.acceptance``).  Its
  rate ``ρ`` is the price of time for the rest of the round.
* After each draft (:class:`DraftRound`): its confidence refines its own acceptance and that of the
  drafts that would follow; the round goes on to the length ``L`` maximizing ``E[tokens | L] −
  ρ·cost(L)`` over every ``L`` still reachable (up to γ_max, past the plan when the drafter turns out
  confident), keeps the draft only if ``L`` includes it, and stops when ``L`` is where it stands.
  Maximizing tokens minus their time at the achievable rate is what maximizes tokens per second over
  many rounds (a renewal argument); comparing raw per-round ratios instead would stop too early
  whenever the time already spent drafting is large.

A round also leaves the drafter tokens to read at its next step: one normally (the correction or
bonus token, read in the step that drafts the next round's first draft), two when every draft was
accepted (the last draft too), and every token of a round it did not draft (a draft-less or lookup
round).  A step that reads two rows costs more than one, so each token beyond the first is priced at
``CostModel.catch_up``; it favours rounds that end in a rejection or reach further, over rounds of
one confident draft.

Exactness never depends on this: γ only changes how many drafts the verifier sees.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from edge_spec.runtime.latency_curve import latency_at
from edge_spec.runtime.schedule.acceptance import RequestAcceptance


@dataclass
class CostModel:
    """Latencies in seconds.  ``verify[n]``: target pass over n new tokens; ``draft``: one draft step."""

    draft: float
    verify: dict[int, float] = field(default_factory=dict)
    catch_up: float = 0.0  # what each token the drafter reads beyond one in a step adds to that step
    drafter_drafts: bool = True  # False: the drafts come from elsewhere (lookup), the drafter reads them all later
    overhead: float = 0.0  # what every round spends outside the models (``RoundOverhead``)

    def verify_cost(self, n: int) -> float:
        """The latency of a pass over n new tokens (``latency_curve.latency_at``: the same rule as the profile's)."""
        return latency_at(self.verify, n)

    def round_cost(self, gamma: int, guessed: bool = False) -> float:
        """``guessed``: a draft-less round whose pass carries a guess in a second row."""
        rows = 2 if gamma == 0 and guessed else gamma + 1
        return gamma * self.draft + self.verify_cost(rows) + self.overhead

    def expected_cost(self, first: float, later: float, gamma: int, spare: float = 0.0) -> float:
        """A round's cost including the reading it leaves the drafter (module docstring): one extra
        token when all γ of the drafter's drafts are accepted; every token the round makes when the
        drafter made none of them (γ = 0, or drafts from elsewhere).  ``spare`` > 0: a draft-less
        round carries a guess (right with that chance) in a second row."""
        if gamma == 0:
            unread = 1.0 + spare
        elif self.drafter_drafts:
            unread = chain_survival(first, later, gamma)
        else:
            unread = chain_tokens(first, later, gamma)
        return self.round_cost(gamma, guessed=spare > 0) + unread * self.catch_up


OVERHEAD_SMOOTHING = 0.1  # weight of the newest round in the overhead's moving average


@dataclass
class RoundOverhead:
    """What a round spends outside the models: planning, lookup, the verification maths.  The same
    for a round of one draft as for one of four, so it makes fewer, longer rounds cheaper per token;
    a property of the machine and the interpreter, carried across requests (``schedule.memory``)."""

    seconds: float = 0.0
    rounds: int = 0

    def record(self, seconds: float) -> None:
        self.rounds += 1
        weight = 1.0 if self.rounds == 1 else OVERHEAD_SMOOTHING
        self.seconds += weight * (seconds - self.seconds)


def chain_tokens(first: float, later: float, gamma: int) -> float:
    """Expected tokens of a round of γ drafts: the first accepted with ``first``, each later one (its
    predecessors accepted) with ``later``; plus the target's own token."""
    expected, survive = 1.0, 1.0
    for k in range(gamma):
        survive *= first if k == 0 else later
        expected += survive
    return expected


def chain_survival(first: float, later: float, gamma: int) -> float:
    """The chance that all γ drafts of a round are accepted."""
    return first * later ** (gamma - 1) if gamma else 1.0


def guess_row_pays(costs: CostModel, rate: float) -> bool:
    """Whether a draft-less round should carry a guess right with chance ``rate`` in a second row, where
    one row alone would be exact: ``1 + rate`` tokens for the two-row pass against one for the one-row
    pass.  That row's premium is measured, not assumed: a few percent of a pass after a short prompt, over
    40% after a long one, where the second query row's attention costs as much as the first's."""
    return (1.0 + rate) / costs.expected_cost(0.0, 0.0, 0, spare=rate) > 1.0 / costs.expected_cost(0.0, 0.0, 0)


@dataclass(frozen=True)
class RoundPlan:
    gamma: int  # drafts planned (0: no drafter this round)
    rate: float  # expected tokens per second of the planned round: the price of time in the round


def plan_round(
    first: float, later: float, costs: CostModel, gamma_max: int, prefer_drafting: float = 0.02, spare: float = 0.0
) -> RoundPlan:
    """The γ in 0..γ_max with the most expected tokens per second.  Plain decoding (γ = 0) must win by
    ``prefer_drafting`` (relative): a stretch without drafts leaves the drafter to catch up later and
    the estimates without fresh evidence.  ``spare``: the chance that what fills the spare row of a
    draft-less batch-invariant pass (a free guess) is accepted -- that round makes ``1 + spare`` tokens."""
    rates = [
        (chain_tokens(first, later, g) + (spare if g == 0 else 0.0)) / costs.expected_cost(first, later, g, spare)
        for g in range(gamma_max + 1)
    ]
    if gamma_max == 0:
        return RoundPlan(0, rates[0])
    best = max(range(1, gamma_max + 1), key=lambda g: (rates[g], -g))
    if rates[0] > rates[best] * (1 + prefer_drafting):
        return RoundPlan(0, rates[0])
    return RoundPlan(best, rates[best])


@dataclass
class DraftRound:
    """One round's stop rule (see the module docstring): after each draft, keep it or not, and draft
    another or not.  ``expected``: E[tokens] of the drafts kept so far plus the target's token;
    ``survive``: the chance that every kept draft is accepted."""

    costs: CostModel
    gamma_max: int
    rate: float  # ρ: tokens per second the round must beat to spend more time
    estimates: RequestAcceptance
    forced: bool = False  # keep every draft up to gamma_max (probe rounds)
    spare: float = 0.0  # chance that the free guess is right, should the round drop its only draft
    dropped_confidence: float | None = None  # of the draft the rule dropped, if it dropped one
    kept: int = 0
    survive: float = 1.0
    expected: float = 1.0

    def add(self, confidence: float, may_drop: bool = True) -> tuple[bool, bool]:
        """Fold in draft ``kept + 1``, proposed with ``confidence``; return (keep it, draft another).

        ``may_drop`` must be False under rejection sampling: dropping a sampled draft because of its own
        value would bias the output (the kept drafts would no longer be plain samples of q).  Greedy and
        coupled drafts may be dropped: the token at each position is fixed whatever is verified.  Stopping
        *after* a draft, based on the drafts so far, is always safe: each position is still either
        verified against q or sampled from p directly.
        """
        k = self.kept + 1
        if self.forced:
            self._keep(self.estimates.acceptance(confidence))
            return True, k < self.gamma_max
        length = self.best_length(
            self.estimates.acceptance(confidence), self.estimates.next_after(confidence), allow_drop=may_drop
        )
        if length < k:
            self.dropped_confidence = confidence
            return False, False
        self._keep(self.estimates.acceptance(confidence))
        return True, length > k

    def best_length(self, acceptance: float, following: float, allow_drop: bool) -> int:
        """Drafts the round should end with, given draft ``kept + 1`` (acceptance ``acceptance``) and
        later drafts accepted with ``following`` each: argmax of E[tokens] − ρ·cost over every
        reachable length (the shorter one on a tie)."""
        k, costs = self.kept + 1, self.costs
        sunk = k * costs.draft
        best, best_value = k, float("-inf")
        if allow_drop:  # the drafter has read every kept draft: only the spare row's guess is left unread
            guess = self.spare if k == 1 else 0.0  # no draft left: the spare row carries the guess
            rows = 2 if guess > 0 else k  # a lone guess rides a second row; without it the pass runs lean
            best, best_value = (
                k - 1,
                self.expected + guess - self.rate * (sunk + costs.verify_cost(rows) + guess * costs.catch_up),
            )
        survive = self.survive * acceptance
        expected = self.expected + survive
        for length in range(k, self.gamma_max + 1):
            value = expected - self.rate * (
                length * costs.draft + costs.verify_cost(length + 1) + survive * costs.catch_up
            )
            if value > best_value + 1e-12:
                best, best_value = length, value
            survive *= following
            expected += survive
        return best

    def _keep(self, acceptance: float) -> None:
        self.kept += 1
        self.survive *= acceptance
        self.expected += self.survive


REACH_ACCEPTANCE = 0.98  # the acceptance at which the machine's curve sets how far a round may reach
REACH_FLOOR = 4  # the reach where the curve makes even such rounds short
REACH_PRIOR_WEIGHT = 20.0  # later drafts a request must show before its own streaks move its reach much


def reach(costs: CostModel, gamma_max: int, acceptance: float = REACH_ACCEPTANCE) -> int:
    """How many drafts a round may reach on this machine: the plan for drafts accepted with
    ``acceptance`` each (``REACH_ACCEPTANCE`` unless a request has shown better), at least
    ``REACH_FLOOR``, at most ``gamma_max``.  Where a verify row costs about a pass that is the floor;
    where rows are cheap, up to the ceiling.  The stop rule plans on estimates: where rows are dear, a
    round extended past this reach loses more when a long streak ends early than it wins when it does
    not (the replay in the README)."""
    planned = plan_round(acceptance, acceptance, costs, gamma_max).gamma
    return min(gamma_max, max(REACH_FLOOR, planned))


@dataclass
class AdaptiveGamma:
    """Per-request state of the schedule: plans each round, probes while plain decoding wins.
    ``gamma_max`` is the configured ceiling; rounds reach at most :func:`reach` of it, set from the
    request's first round's costs and raised while the request's own later drafts are accepted more often
    than ``REACH_ACCEPTANCE`` (a drafter that reproduces the target's answer, as on a textbook function,
    loses a pass every few rounds to a reach set for the average request)."""

    gamma_max: int
    estimates: RequestAcceptance
    probe_every: int = 4  # first probe interval; doubles (up to max_probe_every) while probes keep failing
    max_probe_every: int = 64
    probing: bool = False  # the last choice was a probe
    _rounds_without_draft: int = 0
    _interval: int = 0
    _reach: int | None = None
    _round: DraftRound | None = None  # the stop rule of the round begun last (None: a draft-less round)

    def ceiling(self, costs: CostModel) -> int:
        """The most drafts this request's rounds may have: :func:`reach` from its first costs, or the plan
        at the acceptance its own later drafts have shown (shrunk towards ``REACH_ACCEPTANCE`` by
        ``REACH_PRIOR_WEIGHT`` drafts) when that is higher.  Only later drafts count: they are what a
        long round is made of, and a first draft after a correction says little about a streak."""
        if self._reach is None:
            self._reach = reach(costs, self.gamma_max)
        shown = self.estimates.streak_rate(REACH_ACCEPTANCE, REACH_PRIOR_WEIGHT)
        if shown <= REACH_ACCEPTANCE or self._reach >= self.gamma_max:
            return self._reach
        return max(self._reach, reach(costs, self.gamma_max, shown))

    def plan(self, costs: CostModel, spare: float = 0.0) -> RoundPlan:
        """The round this request would draft now (also what a lookup match must beat)."""
        return plan_round(self.estimates.first, self.estimates.later_draft(), costs, self.ceiling(costs), spare=spare)

    def begin_round(self, costs: CostModel, spare: float = 0.0) -> DraftRound | None:
        """None: decode this round without drafts (a spare row's filler is accepted with ``spare``).
        Otherwise the round's stop rule."""
        self._round = self._begin(costs, spare)
        return self._round

    def _begin(self, costs: CostModel, spare: float) -> DraftRound | None:
        plan = self.plan(costs, spare)
        self.probing = False
        if plan.gamma > 0:
            self._rounds_without_draft = 0
            self._interval = self.probe_every
            return DraftRound(costs, self.ceiling(costs), plan.rate, self.estimates, spare=spare)
        self._interval = self._interval or self.probe_every
        self._rounds_without_draft += 1
        if self._rounds_without_draft < self._interval:
            return None
        # probe: one draft keeps the estimates current; a probe costs a drafter catch-up, so back off
        self._rounds_without_draft = 0
        self._interval = min(2 * self._interval, self.max_probe_every)
        self.probing = True
        return DraftRound(costs, 1, plan.rate, self.estimates, forced=True)

    def update(
        self, drafted: int, accepted: int, confidences: list[float] | None = None, dropped: bool = False
    ) -> None:
        """Fold one round of the drafter's into the estimates (``dropped``: it drafted one more draft and
        dropped it; with no draft kept, the round's first step bought nothing)."""
        if drafted:
            self.estimates.record((confidences or [])[:drafted], accepted, dropped)
        elif dropped and self._round is not None and self._round.dropped_confidence is not None:
            self.estimates.record_dropped_first(self._round.dropped_confidence)
