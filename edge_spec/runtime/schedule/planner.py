"""The chain loop's schedule: which proposer drafts this round, and how many drafts it may make.

In order: drafts that cannot be rejected (tokens a constraint's grammar forces, ``propose.forced``); a
sequence proposer (prompt lookup) whose match promises more tokens per second than the
model (:mod:`schedule.sources`); else the drafter model, with this round's stop rule from the
adaptive policy (:mod:`schedule.policy`) or a fixed γ; and when that leaves the round without
drafts while the verify pass has a spare row anyway (batch-invariant passes), a filler (free guess),
whose chance of acceptance is what the policy weighs a draft-less round with.
After verification the outcome is folded into the estimates that made the choice, and every round
checks its guess -- the free guess, which is also a lookup's first draft -- and what each sequence
source offered against the tokens the target produced, drafted or not, so guesses and lookups are
judged from the first rounds of a request.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from edge_spec.runtime.constrain import Constraint
from edge_spec.runtime.model.decoder import Decoder
from edge_spec.runtime.propose.base import DraftBlock, DraftRule, Proposer
from edge_spec.runtime.schedule.acceptance import AcceptanceCalibration, RequestAcceptance
from edge_spec.runtime.schedule.policy import AdaptiveGamma, CostModel, RoundOverhead, chain_tokens, guess_row_pays
from edge_spec.runtime.schedule.sources import LookupChoice
from edge_spec.runtime.verify.chain import VerifyResult
from edge_spec.runtime.verify.sampling import SamplingParams

# chance of a right guess below which a draft-less round runs in one row, where that is exact, until the
# passes' costs are measured (then ``policy.guess_row_pays`` decides): what a second row costs over one
# after a short prompt (68.0 against 77.7 ms a pass on the 1.5B target with AVX-512 VNNI, +14%).  It
# changes only how fast an answer comes: a pass of either size gives the same logits there.
GUESS_ROW_WORTH = 0.15
QUIET_AFTER = 2  # the drafter rests after this many of its rounds in a row lose their first draft ...
QUIET_RATE = 0.45  # ... in a request whose first drafts are accepted less often than this
QUIET_ROUNDS = (3, 48)  # its first rest in rounds, and the longest (each rest after a lost try doubles)


@dataclass
class QuietDrafter:
    """Per request: rest the drafter model while its drafts keep losing, decided from the tokens alone.

    The adaptive policy weighs the drafter against a draft-less round by measured costs, but a request
    whose drafts lose (translation, shuffled text) learns that only over rounds that cost a drafter's
    steps and a wider pass each: on 14-token answers the request is over before it has learnt.  Here two
    lost rounds in a row, in a request whose first drafts are accepted less often than
    :data:`QUIET_RATE`, rest the drafter for a few rounds (decoding then costs what target-only decoding
    costs), then let it try again, resting twice as long after each try that loses.  Counted in tokens,
    so the same prompt decodes the same way whatever the machine's load."""

    rounds: int = 0
    firsts_accepted: int = 0
    lost_in_a_row: int = 0
    rest: int = 0
    next_rest: int = QUIET_ROUNDS[0]

    def holds(self) -> bool:
        """Whether this round rests the drafter (counts the round)."""
        if self.rest > 0:
            self.rest -= 1
            return True
        return False

    def record(self, first_accepted: bool) -> None:
        """A verified round of the drafter's: was its first draft accepted?"""
        self.rounds += 1
        self.firsts_accepted += first_accepted
        if first_accepted:
            self.lost_in_a_row, self.next_rest = 0, QUIET_ROUNDS[0]
            return
        self.lost_in_a_row += 1
        if self.lost_in_a_row >= QUIET_AFTER and self.firsts_accepted < QUIET_RATE * self.rounds:
            self.rest, self.lost_in_a_row = self.next_rest, QUIET_AFTER - 1  # one more loss after the rest: again
            self.next_rest = min(2 * self.next_rest, QUIET_ROUNDS[1])


class DraftPlanner:
    """Per request; see the module docstring."""

    def __init__(
        self,
        proposers: list[Proposer],
        target: Decoder,
        gamma: int,
        adaptive: bool,
        min_confidence: float = 0.0,
        calibration: AcceptanceCalibration | None = None,
        overhead: RoundOverhead | None = None,
    ) -> None:
        """``calibration`` and ``overhead``: the acceptance calibration for this drafter and sampling
        regime, and the round's time outside the models, carried across requests (``schedule.memory``);
        None starts afresh."""
        self.target = target
        self.gamma, self.adaptive, self.min_confidence = gamma, adaptive, min_confidence
        calibration = calibration or AcceptanceCalibration()
        self.model = next((p for p in proposers if p.kind == "model"), None)
        self.estimates = RequestAcceptance(calibration)
        self.certain = [p for p in proposers if p.kind == "sequence" and p.certain]
        self.sequences = [
            (p, LookupChoice(calibration.sequence, self.estimates, own_first=p.own_first))
            for p in proposers
            if p.kind == "sequence" and p not in self.certain
        ]
        self.fillers = [p for p in proposers if p.kind == "filler"]
        self.policy = AdaptiveGamma(gamma, self.estimates) if adaptive else None
        self.overhead = overhead or RoundOverhead()
        self.quiet = QuietDrafter()
        self._guessed: tuple[int, int] | None = None  # this round's free guess: (suffix matched, token)
        # what each sequence source offered this round, taken or not: (choice, tokens, matched, share, cached)
        self._offers: list[tuple[LookupChoice, list[int], int, float, bool]] = []

    def draft(
        self,
        committed: list[int],
        room: int,
        params: SamplingParams,
        rng: np.random.Generator,
        constraint: Constraint | None = None,
    ) -> DraftBlock:
        """This round's drafts after ``committed`` (``constraint``: what the answer may contain, in its
        state after ``committed``; the drafter draws from what it allows).  A cancel cuts or refuses the
        drafter's pass it meets (``Decoder.interrupt``)."""
        rule = DraftRule(params, rng, self.gamma, self.min_confidence, constraint=constraint)
        self._offers = []
        costs = self._costs()
        guess = self._guess(committed, room, rule)
        spare = guess if guess is not None and self.target.min_rows >= 2 else None  # a pass's spare row
        lean = spare is not None and self.target.exact_rows < self.target.min_rows and not self._row_pays(spare, costs)
        if lean:  # this request's guesses keep failing: a draft-less round runs in one row
            spare = None
        self._guessed = (guess.matched, guess.tokens[0]) if guess else None  # checked whatever the round does
        for proposer in self.certain:  # drafts that cannot be rejected: all of them, before anyone else's
            block = proposer.propose(committed, room, rule)
            if block.tokens:
                return block
        spare_rate = self.estimates.guess(spare.matched) if spare else 0.0  # what a draft-less round makes
        for proposer, choice in self.sequences:
            block = proposer.propose(committed, room, rule)
            share = block.confidences[0] if block.confidences else 1.0
            if block.tokens:
                self._offers.append((choice, list(block.tokens), block.matched, share, block.cached))
                if not choice.own_first and self._guessed is None:  # no filler: a lookup's first draft is the guess
                    self._guessed = (block.matched, block.tokens[0])
            model_rate = self._model_rate(costs, spare_rate)
            take = (
                choice.lookup_gamma(
                    len(block.tokens), block.matched, costs, self.gamma, model_rate, self.adaptive, share, block.cached
                )
                if block.tokens
                else 0
            )
            if take:
                block.truncate(take)
                return block
        block = DraftBlock()
        if self.model is not None and not (self.adaptive and self.quiet.holds()):  # a fixed γ drafts every round
            if self.policy is not None and costs is not None:
                rule.stop = self.policy.begin_round(costs, spare=spare_rate)
                rule.gamma = 0 if rule.stop is None else rule.stop.gamma_max
            block = self.model.propose(committed, room, rule)
        if block.tokens or spare is None:
            block.lean = not block.tokens  # no drafts and no guess to carry: no row beyond exactness's
            return block
        spare.steps = block.steps  # a dropped model step still counts as a step
        return spare

    def _row_pays(self, guess: DraftBlock, costs: CostModel | None) -> bool:
        """Whether carrying the guess in a second row is worth that row, at the rate this request's guesses
        (by the match behind this one) are right: priced by the passes' costs, by
        :data:`GUESS_ROW_WORTH` before they are measured."""
        rate = self.estimates.guess(guess.matched)
        return rate >= GUESS_ROW_WORTH if costs is None else guess_row_pays(costs, rate)

    def _guess(self, committed: list[int], room: int, rule: DraftRule) -> DraftBlock | None:
        """The free guess for the next token (None: no room, or no filler proposes one)."""
        if room == 0:
            return None
        for filler in self.fillers:
            guess = filler.propose(committed, room, rule)
            if guess.tokens:
                return guess
        return None

    def update(self, block: DraftBlock, result: VerifyResult, outside_seconds: float = 0.0) -> None:
        """Fold a verified round into the acceptance estimates of the source that drafted it, and its
        time outside the models into the round overhead."""
        self.overhead.record(outside_seconds)
        drafted = len(block.tokens)
        if self.model is not None and block.source == self.model.name and drafted:
            self.quiet.record(result.accepted > 0)
            if self.policy is not None:
                self.policy.update(drafted, result.accepted, block.confidences, dropped=block.steps > drafted)
            else:  # fixed γ computes no confidences: only the first-draft average (lookup weighs against it)
                self.estimates.note_first(result.accepted > 0)
        elif self.policy is not None and block.steps:  # the drafter stepped and the stop rule dropped its draft
            self.policy.update(0, 0, dropped=True)
        for choice, offered, matched, share, cached in self._offers:  # taken or not: checked for free
            choice.judge(offered, matched, result.tokens, share, cached)
        if self._guessed is not None:  # verified or not, the guess was right iff the target's token equals it
            matched, guess = self._guessed
            self.estimates.record_guess(matched, result.tokens[0] == guess)

    def _model_rate(self, costs: CostModel | None, spare: float) -> float | None:
        """Tokens per second the drafter's round would make now (None: no drafter or no costs yet)."""
        if self.model is None or costs is None:
            return None
        if self.policy is not None:
            return self.policy.plan(costs, spare).rate
        first, later = self.estimates.first, self.estimates.later_draft()
        return chain_tokens(first, later, self.gamma) / costs.expected_cost(first, later, self.gamma)

    def _costs(self) -> CostModel | None:
        """What a model round costs now (None until the drafter's step and target passes are measured)."""
        step, verify = self.model.step_estimate if self.model else 0.0, self.target.recent_seconds()
        catch_up = self.model.catch_up_seconds if self.model else 0.0
        return (
            CostModel(step, verify, catch_up, overhead=self.overhead.seconds) if step is not None and verify else None
        )
