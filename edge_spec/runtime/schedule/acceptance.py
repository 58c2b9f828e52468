"""How likely is a draft to be accepted?  Estimates the round planner prices drafts with.

Three questions, each answered from counts of verified drafts:

* a draft the drafter proposed with confidence ``c`` (its probability of its own token): accepted?
  (``by_confidence``; before any evidence a bin's prior is the confidence itself, which is what a
  well-calibrated drafter's probability means under greedy verification);
* a draft not yet made, right after a draft of confidence ``c`` was accepted: accepted?
  (``after``: confident drafts come in streaks -- boilerplate, copied spans -- so the last draft's
  confidence predicts the next draft's fate better than any running average);
* the first draft of a round, before anything is drafted: accepted? (``first``).

These are properties of the drafter/target pair and the sampling regime, not of one request, so one
:class:`AcceptanceCalibration` is carried across requests (and across processes, see
``schedule.memory``); counts decay so that it follows what the user asks now.  Within a request the
first-draft estimate also keeps a fast moving average (:class:`RequestAcceptance`): a prompt that
copies code accepts far more than the mix the calibration has seen.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

CONFIDENCE_EDGES = (0.2, 0.35, 0.5, 0.65, 0.8, 0.9, 0.95, 0.98, 0.995)
BINS = len(CONFIDENCE_EDGES) + 1
PRIOR_WEIGHT = 4.0  # a prior counts as this many verified drafts
DECAY = 0.998  # per recorded outcome: the calibration remembers roughly the last 500 drafts per table


def confidence_bin(confidence: float) -> int:
    return sum(confidence >= edge for edge in CONFIDENCE_EDGES)


def bin_middle(index: int) -> float:
    """A representative confidence of a bin (its prior acceptance)."""
    lower = ([0.0] + list(CONFIDENCE_EDGES))[index]
    upper = (list(CONFIDENCE_EDGES) + [1.0])[index]
    return (lower + upper) / 2


def odds(probability: float) -> float:
    probability = min(max(probability, 1e-6), 1.0 - 1e-6)
    return probability / (1.0 - probability)


def probability(odds: float) -> float:
    return odds / (1.0 + odds)


def shifted(estimate: float, shift: float) -> float:
    """``estimate`` with its log-odds moved by ``shift``."""
    return probability(odds(estimate) * math.exp(shift))


@dataclass
class DecayedRate:
    """Accepted / tried with exponentially decaying counts, shrunk towards a prior."""

    hits: float = 0.0
    trials: float = 0.0

    def estimate(self, prior: float) -> float:
        return (self.hits + PRIOR_WEIGHT * prior) / (self.trials + PRIOR_WEIGHT)

    def record(self, accepted: bool) -> None:
        self.hits = DECAY * self.hits + float(accepted)
        self.trials = DECAY * self.trials + 1.0


MATCH_EDGES = (2, 4, 8, 16, 32)  # lower edges of a suffix draft's match-length bins
# once a copied span is confirmed it tends to go on, the more surely the longer the match behind the round
LATER_SEQUENCE_PRIORS = (0.6, 0.8, 0.85, 0.9, 0.95)
# its chance per bin before any evidence (all occurrences agreeing): from 4 tokens on, what the free guess's table
# starts a 4-token match at (``GUESS_PRIORS``), rising with the length
MATCH_PRIORS = (0.5, 0.8, 0.85, 0.9, 0.95)
DISAGREED_PRIOR_SCALE = 0.7  # the prior of a draft not every earlier occurrence continued with
# the prior of a draft only earlier requests' text supports: another request's answer is a weaker witness
# of this one's next token than this request's own text, whose copies are the usual reason to match
CACHED_PRIOR_SCALE = 0.8
MATCH_BINS = 4 * len(MATCH_EDGES)  # match length x all occurrences agreed or not x this request or the cache


def length_bin(matched: int) -> int:
    """The bin of a match of ``matched`` tokens among :data:`MATCH_EDGES` (shorter ones: the first)."""
    return max(sum(matched >= edge for edge in MATCH_EDGES) - 1, 0)


def match_bin(matched: int, share: float, cached: bool = False) -> int:
    """The bin of a suffix draft: its match length's, doubled for one not every occurrence agreed on, and
    doubled again for one only the cache (earlier requests) supports."""
    return length_bin(matched) + (len(MATCH_EDGES) if share < 1.0 else 0) + (2 * len(MATCH_EDGES) if cached else 0)


@dataclass
class SequenceCalibration:
    """Acceptance of the drafts copied from the sequence (prompt lookup) after the first one was
    accepted.  The first one is the free guess's token for the same matched suffix (the index returns
    the longest match either way), so it is judged by the guess calibration, which every round checks.

    Later drafts are counted by the length of the match behind their round: a round after a 64-token
    match is a copy under way and goes on for dozens of tokens, one after a 2-token match mostly met
    the sequence's words by chance and leaves the copy after a token or two.  One table for both let a
    request that copied a file (every later draft right) price the next request's chance matches as
    copies: an explanation of that file drafted seven tokens a round behind 2-token matches and lost
    them all."""

    later: list[DecayedRate] = field(default_factory=lambda: [DecayedRate() for _ in MATCH_EDGES])
    # a suffix draft's first (not the guess's token: see ``propose.suffix``), by ``match_bin``
    first: list[DecayedRate] = field(default_factory=lambda: [DecayedRate() for _ in range(MATCH_BINS)])

    def later_draft(self, matched: int) -> float:
        """Chance that a draft after an accepted one is right, in a round whose match was ``matched`` long."""
        index = length_bin(matched)
        return self.later[index].estimate(LATER_SEQUENCE_PRIORS[index])

    def record_later(self, matched: int, right: bool) -> None:
        self.later[length_bin(matched)].record(right)

    def first_draft(self, matched: int, share: float, cached: bool = False) -> float:
        """Chance that a suffix draft is right, before any of its request's outcomes: by how long the match
        behind it is, whether every earlier occurrence continued with it, and whether only earlier
        requests' text (``cached``) has it."""
        index = match_bin(matched, share, cached)
        prior = MATCH_PRIORS[index % len(MATCH_EDGES)]
        prior *= (1.0 if share >= 1.0 else DISAGREED_PRIOR_SCALE) * (CACHED_PRIOR_SCALE if cached else 1.0)
        return self.first[index].estimate(prior)

    def record_first(self, matched: int, share: float, right: bool, cached: bool = False) -> None:
        self.first[match_bin(matched, share, cached)].record(right)


# a free guess (and a lookup's first draft) by the suffix it matched: none (the last token again), 1..4+
GUESS_PRIORS = (0.05, 0.2, 0.5, 0.6, 0.8)


@dataclass
class AcceptanceCalibration:
    """Carried across requests: see the module docstring.  ``sequence``: the same for prompt lookup's
    drafts after their first, which the schedule weighs against the drafter's; ``guess``: for the
    free guess a draft-less batch-invariant pass carries, by the length of the suffix it matched (what
    a round without drafts is worth, and the chance of a lookup's first draft, the same token)."""

    by_confidence: list[DecayedRate] = field(default_factory=lambda: [DecayedRate() for _ in range(BINS)])
    after: list[DecayedRate] = field(default_factory=lambda: [DecayedRate() for _ in range(BINS)])
    first: DecayedRate = field(default_factory=DecayedRate)
    sequence: SequenceCalibration = field(default_factory=SequenceCalibration)
    guess: list[DecayedRate] = field(default_factory=lambda: [DecayedRate() for _ in GUESS_PRIORS])
    first_prior: float = 0.6  # before any round: drafters are chosen because they agree this often

    def guess_rate(self, matched: int) -> float:
        index = min(max(matched, 0), len(GUESS_PRIORS) - 1)
        return self.guess[index].estimate(GUESS_PRIORS[index])

    def record_guess(self, matched: int, accepted: bool) -> None:
        self.guess[min(max(matched, 0), len(GUESS_PRIORS) - 1)].record(accepted)

    def acceptance(self, confidence: float) -> float:
        return self.by_confidence[confidence_bin(confidence)].estimate(confidence)

    def next_after(self, confidence: float) -> float:
        """Acceptance of the draft following an accepted draft of this confidence."""
        return self.after[confidence_bin(confidence)].estimate(self.acceptance(confidence))

    def first_draft(self) -> float:
        return self.first.estimate(self.first_prior)

    def record(self, confidences: list[float], accepted: int, dropped: bool = False) -> None:
        """One verified chain: drafts ``0..accepted-1`` accepted, draft ``accepted`` (if any) rejected;
        drafts past the first rejection were never judged and teach nothing.  ``dropped``: the round drafted
        one more draft and dropped it unverified (the stop rule found it too unsure).  When every verified
        draft was accepted, that draft counts against the table of later drafts: the table prices a draft
        before its confidence is known, and one that ends up dropped buys nothing for its step.  Counting
        only the drafts that were kept would learn from the confident ones alone."""
        judged = min(len(confidences), accepted + 1)
        for i in range(judged):
            ok = i < accepted
            self.by_confidence[confidence_bin(confidences[i])].record(ok)
            if i == 0:
                self.first.record(ok)
            else:
                self.after[confidence_bin(confidences[i - 1])].record(ok)
        if dropped and confidences and accepted == len(confidences):
            self.after[confidence_bin(confidences[-1])].record(False)

    def to_dict(self) -> dict:
        pairs = lambda rates: [[r.hits, r.trials] for r in rates]
        return {
            "by_confidence": pairs(self.by_confidence),
            "after": pairs(self.after),
            "first": [self.first.hits, self.first.trials],
            "edges": list(CONFIDENCE_EDGES),
            "sequence_later": pairs(self.sequence.later),
            "sequence_first": pairs(self.sequence.first),
            "guess": pairs(self.guess),
        }

    @classmethod
    def from_dict(cls, data: dict) -> "AcceptanceCalibration":
        """Raises ValueError/KeyError/TypeError on data of another layout (the caller starts afresh)."""
        if data["edges"] != list(CONFIDENCE_EDGES):
            raise ValueError("calibration bins changed")
        rates = lambda pairs: [DecayedRate(float(h), float(t)) for h, t in pairs]
        sequence = SequenceCalibration()
        later = data["sequence_later"]  # one pair per match length; a file with one pair for all: learnt afresh
        if later and isinstance(later[0], list):
            if len(later) != len(MATCH_EDGES):
                raise ValueError("calibration bins changed")
            sequence.later = rates(later)
        if "sequence_first" in data:  # a file written before suffix drafts were calibrated: learnt afresh
            first = rates(data["sequence_first"])
            if len(first) == MATCH_BINS // 2:  # written before cached drafts had bins of their own: they start afresh
                first += [DecayedRate() for _ in range(MATCH_BINS // 2)]
            if len(first) != MATCH_BINS:
                raise ValueError("calibration bins changed")
            sequence.first = first
        # a file written before guesses were calibrated: they are learnt afresh, the rest is kept
        guess = rates(data["guess"]) if "guess" in data else [DecayedRate() for _ in GUESS_PRIORS]
        calibration = cls(
            rates(data["by_confidence"]), rates(data["after"]), DecayedRate(*map(float, data["first"])), sequence, guess
        )
        if len(calibration.by_confidence) != BINS or len(calibration.after) != BINS or len(guess) != len(GUESS_PRIORS):
            raise ValueError("calibration bins changed")
        return calibration


# a request's log-odds shift against the carried calibration: usually small (narrow prior), now and
# then large (a request unlike the ones calibrated on: copied code, translation), as a mixture of two
AGREEMENT_SPREADS = (0.3, 1.5)
WIDE_PRIOR = 0.2  # prior weight of the wide one
# a new request's caution (see Agreement.for_request): its estimates start this far below the calibration in
# log-odds, and the gap fades by 1/e over every CAUTION_FADE outcomes the request has had judged
REQUEST_CAUTION = -0.75
CAUTION_FADE = 16.0


@dataclass
class LogOddsShift:
    """One shift of every prediction's log-odds fitted to a request's outcomes under a normal prior of
    width ``spread``: one Newton step per outcome (online Laplace: the shift's precision grows by each
    outcome's ``p·(1 − p)``), so that a note costs the same at the thousandth token as at the first.
    ``evidence``: the log-likelihood of the outcomes, each predicted before it was seen."""

    spread: float
    shift: float = 0.0
    precision: float = 0.0  # 0: the prior's, set on creation
    evidence: float = 0.0

    def __post_init__(self) -> None:
        self.precision = self.precision or 1.0 / self.spread**2

    def scale(self, estimate: float) -> float:
        return shifted(estimate, self.shift)

    def note(self, predicted: float, accepted: bool) -> None:
        p = self.scale(predicted)
        self.evidence += math.log(p if accepted else 1.0 - p)
        self.precision += p * (1.0 - p)
        self.shift += (float(accepted) - p) / self.precision


@dataclass
class Agreement:
    """How one request's drafts do against what a carried calibration predicted for them: a shift of
    every prediction's log-odds, averaged over a narrow and a wide prior by how well each predicted this
    request's outcomes (Bayesian model averaging; the calibration is right until the request shows
    otherwise).

    A shift of log-odds, not a ratio of rates: one lucky draft predicted at 0.2 must not lift a 0.98
    estimate to near certainty (which buys long drafts), nor one unlucky draft sink it; a request whose
    confident drafts keep failing (translation) sinks them all, one whose unsure drafts keep succeeding
    (copied code) lifts them.  An outcome weighs by how surprising it was: a 0.98 draft rejected says
    more than a 0.5 one."""

    narrow: LogOddsShift = field(default_factory=lambda: LogOddsShift(AGREEMENT_SPREADS[0]))
    wide: LogOddsShift = field(default_factory=lambda: LogOddsShift(AGREEMENT_SPREADS[1]))
    caution: float = 0.0  # log-odds taken off every estimate before any outcome, fading (for_request)
    judged: int = 0  # outcomes noted so far

    @classmethod
    def for_request(cls) -> "Agreement":
        """A new request's agreement: cautious at first (``REQUEST_CAUTION``), less so with every outcome.

        The calibration is right on average over requests, but the two ways of being wrong do not cost
        alike at a request's start.  One that does worse than the average (translation, open questions:
        short answers, whose few rounds leave the evidence little time) loses whole rounds to drafts
        planned too long; one that does better loses little to rounds planned short, since the stop rule
        still extends a round while confident drafts come.  The caution fades with the number of outcomes
        judged, whatever they were: confident drafts accepted say little about the shift (each moves it
        by ``1 − p``), so a caution held as evidence would keep a predictable request's rounds short for
        hundreds of drafts.  It only offsets what the planner is told; the shift learns as before.
        Replayed over recorded answers (README, *A request starts cautious*) it lifts the
        worst category and leaves the overall speed and the prime prompt as they were."""
        return cls(caution=REQUEST_CAUTION)

    @property
    def shift(self) -> float:
        """The request's shift as the planner uses it: the averaged fit plus what is left of the caution."""
        return self.fitted + self.caution * math.exp(-self.judged / CAUTION_FADE)

    @property
    def fitted(self) -> float:
        """The shift the outcomes support, averaged over the two priors."""
        log_odds = math.log(WIDE_PRIOR / (1.0 - WIDE_PRIOR)) + self.wide.evidence - self.narrow.evidence
        weight = 1.0 / (1.0 + math.exp(-min(max(log_odds, -50.0), 50.0)))
        return (1.0 - weight) * self.narrow.shift + weight * self.wide.shift

    def note(self, predicted: float, accepted: bool) -> None:
        self.narrow.note(predicted, accepted)
        self.wide.note(predicted, accepted)
        self.judged += 1

    def scale(self, estimate: float) -> float:
        if not 0.0 < estimate < 1.0:
            return min(max(estimate, 0.0), 1.0)
        return shifted(estimate, self.shift)


@dataclass
class RequestAcceptance:
    """One request's view: the carried calibration, scaled by how this request's drafts do against it.

    Two corrections, both with a few drafts of prior weight: a slow average of this request's first
    drafts (``first``), and a shift of the log-odds of every estimate fitted to how the drafts it saw did
    against what the calibration predicted for them (``agreement``, cautious over its first outcomes:
    :meth:`Agreement.for_request`) -- translation accepts less at the same drafter confidence than code
    does.  Free guesses get their own agreement (``guess_agreement``): a
    request's guesses can be far better (copied code) or worse (translation) than its drafts."""

    calibration: AcceptanceCalibration
    smoothing: float = 0.1
    first: float | None = None
    agreement: Agreement = field(default_factory=Agreement.for_request)
    guess_agreement: Agreement = field(default_factory=Agreement.for_request)
    later_accepted: int = 0  # this request's later drafts (each after an accepted one): accepted ...
    later_judged: int = 0  # ... of judged

    def __post_init__(self) -> None:
        if self.first is None:
            self.first = self.calibration.first_draft()

    def acceptance(self, confidence: float) -> float:
        return self.agreement.scale(self.calibration.acceptance(confidence))

    def next_after(self, confidence: float) -> float:
        """A draft after an accepted draft of this confidence, in this request: at least what its first
        drafts do, as :meth:`later_draft` assumes when the round is planned.  Without that floor, a
        calibration carried from requests whose streaks broke early (translation) keeps a request whose
        streaks do not (code, at T > 0 too) at one draft a round, and one-draft rounds never teach the
        table of later drafts otherwise."""
        return max(self.agreement.scale(self.calibration.next_after(confidence)), self.first)

    def later_draft(self) -> float:
        """A draft after an accepted draft whose confidence is not known yet (planning a round)."""
        weights = [r.trials + 1e-9 for r in self.calibration.after]
        estimates = [
            r.estimate(self.calibration.by_confidence[i].estimate(bin_middle(i)))
            for i, r in enumerate(self.calibration.after)
        ]
        overall = sum(w * e for w, e in zip(weights, estimates)) / sum(weights)
        return max(self.agreement.scale(overall), self.first)  # in a streak later drafts do at least as well

    def guess(self, matched: int) -> float:
        """Chance that the free guess whose source matched ``matched`` tokens is right, in this request."""
        return self.guess_agreement.scale(self.calibration.guess_rate(matched))

    def record_guess(self, matched: int, right: bool) -> None:
        """Whether the guess a round could have carried equals the token the target produced there.

        Asked every round, not only of the guesses that were verified: a guess is right exactly when
        the target's next token equals it (under sampling with the same probability ``p(guess)`` as a
        point-mass draft's acceptance), so every round checks this request's guesses for free -- a
        translation, whose guesses are rarely right, learns it before it pays for any."""
        self.guess_agreement.note(self.calibration.guess_rate(matched), right)
        self.calibration.record_guess(matched, right)

    def streak_rate(self, prior: float, weight: float) -> float:
        """How often this request's later drafts were accepted, shrunk towards ``prior`` by ``weight``
        drafts: raw rates, not the calibration's, since a request whose drafter reproduces the target is
        what the carried tables know least about."""
        return (self.later_accepted + weight * prior) / (self.later_judged + weight)

    def note_first(self, accepted: bool) -> None:
        """A drafter round whose confidences were not computed (fixed γ): only the first-draft average."""
        self.first += self.smoothing * (float(accepted) - self.first)

    def record_dropped_first(self, confidence: float) -> None:
        """A round whose only draft the stop rule dropped unverified, at ``confidence``.  The first-draft
        estimate prices the step that starts a round; learning it from kept drafts alone would learn it
        from the confident ones, so a request whose drafter is unsure at every step (a script it hardly
        knows, a word spelt backwards) would pay a step in every round and drop each draft.  The dropped
        draft's outcome is unknown, so it teaches what it was expected to be worth: its acceptance as
        this request's calibration estimates it (low for an unsure draft; high for a confident one
        dropped only because the free guess was worth more, which says nothing against the drafter)."""
        self.first += self.smoothing * (self.acceptance(confidence) - self.first)

    def record(self, confidences: list[float], accepted: int, dropped: bool = False) -> None:
        if not confidences:
            return
        for i in range(min(len(confidences), accepted + 1)):  # before the calibration learns from them
            self.agreement.note(self.calibration.acceptance(confidences[i]), i < accepted)
            if i:  # a later draft: what a long round is made of
                self.later_judged += 1
                self.later_accepted += i < accepted
        self.calibration.record(confidences, accepted, dropped)
        self.first += self.smoothing * (float(accepted > 0) - self.first)
