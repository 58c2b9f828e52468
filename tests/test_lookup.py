"""Prompt-lookup drafting: the n-gram index, the lookup-or-drafter choice, and exactness through the loop."""

from __future__ import annotations

import pytest

from edge_spec.runtime.engine import Engine
from edge_spec.runtime.propose.ngrams import NgramLookup
from edge_spec.runtime.schedule.acceptance import AcceptanceCalibration, RequestAcceptance, SequenceCalibration
from edge_spec.runtime.schedule.policy import CostModel
from edge_spec.runtime.schedule.sources import LookupChoice
from edge_spec.runtime.verify.sampling import SamplingParams
from tests.helpers import chain, chi_square_same_distribution, run


def test_lookup_continues_the_latest_longest_match():
    lookup = NgramLookup(min_n=2, max_n=3)
    seq = [1, 2, 3, 9, 1, 2, 4, 7, 8, 1, 2]
    assert lookup.continuation(seq, 3) == [4, 7, 8]  # latest earlier "1 2" is followed by 4 7 8
    seq += [3]  # suffix "1 2 3" (3 tokens) occurred at the start: the longer match wins
    assert lookup.continuation(seq, 2) == [9, 1]
    fresh = NgramLookup()
    assert fresh.continuation([5, 6, 7, 8], 3) == []  # no repeated suffix
    assert fresh.continuation([5, 6, 7, 8, 5, 6], 3) == [7, 8, 5]  # index grows incrementally
    with pytest.raises(ValueError):
        NgramLookup(min_n=3, max_n=2)


def test_the_suffix_never_matches_itself():
    lookup = NgramLookup(min_n=2, max_n=2)
    assert lookup.continuation([4, 4], 2) == []
    assert lookup.continuation([4, 4, 4], 2) == [4]  # "4 4" ended at index 2 before: continues with the last 4


def costs() -> CostModel:
    return CostModel(draft=0.018, verify={1: 0.048, 2: 0.056, 3: 0.082, 4: 0.100})


def lookup_choice(**settings) -> LookupChoice:
    calibration = AcceptanceCalibration()
    return LookupChoice(calibration.sequence, RequestAcceptance(calibration), **settings)


def test_choice_takes_a_long_match_and_probes_a_losing_one():
    choice = lookup_choice()
    model_rate = (1 + 0.8) / costs().round_cost(1)  # the drafter's γ = 1 round at acceptance 0.8
    assert choice.lookup_gamma(4, matched=4, costs=costs(), gamma_max=4, model_rate=model_rate, adaptive=True) >= 1
    bad = lookup_choice(probe_every=4)
    for _ in range(30):
        bad.estimates.record_guess(2, right=False)  # this request's short matches are never right
    picks = [bad.lookup_gamma(2, 2, costs(), 4, model_rate, adaptive=True) for _ in range(8)]
    assert picks == [0, 0, 0, 1, 0, 0, 0, 1]
    assert bad.lookup_gamma(4, 4, costs(), 4, model_rate=None, adaptive=False) == 4  # fixed γ and no drafter
    # nothing measured yet: a match likely right is taken (a request starts below the priors, 0.8 and 0.5)
    assert lookup_choice().lookup_gamma(3, 4, None, 4, None, adaptive=True) == 3
    assert lookup_choice().lookup_gamma(3, 2, None, 4, None, adaptive=True) == 0


def test_a_lookups_first_draft_is_judged_as_the_guess():
    """The first lookup draft is the token the free guess carries (the same longest match): one
    estimate, checked every round, so lookup and a draft-less round never disagree about it."""
    model_rate = (1 + 0.8) / costs().round_cost(1)
    copying, translating = lookup_choice(), lookup_choice()
    for _ in range(8):
        copying.estimates.record_guess(4, right=True)
        translating.estimates.record_guess(4, right=False)
    assert copying.lookup_gamma(4, 4, costs(), 4, model_rate, adaptive=True) >= 1
    assert translating.lookup_gamma(4, 4, costs(), 4, model_rate, adaptive=True) == 0  # negative control


def test_sequence_calibration_learns_only_from_later_drafts():
    choice = lookup_choice()
    calibration = choice.calibration
    for _ in range(200):
        choice.judge([1, 2, 3, 4], matched=4, produced=[9, 8, 7])  # first draft wrong: nothing after it is judged
    assert sum(rate.trials for rate in calibration.later) == 0
    for _ in range(200):
        choice.judge([1, 2, 3, 4], matched=4, produced=[1, 8])  # the second draft wrong
    assert calibration.later_draft(4) < 0.05
    for _ in range(400):
        choice.judge([1, 2, 3, 4], matched=4, produced=[1, 2, 3, 4, 5])
    assert calibration.later_draft(4) > 0.95


def test_an_offer_is_judged_as_far_as_the_round_produced_tokens():
    """Taken or not, each offered draft after a right one is right iff it equals the produced token at
    its place; past the first wrong one, or past the produced tokens, nothing is known."""
    choice = lookup_choice()
    choice.judge([1, 2, 3, 4], matched=4, produced=[1, 2, 9])  # second right, third wrong
    table = choice.calibration.later[1]  # matches of 4..7 tokens
    assert table.trials == pytest.approx(2, abs=0.01) and table.hits == pytest.approx(1, abs=0.01)
    for offered, produced in (([1, 2, 3], [5, 2, 3]), ([1, 2, 3], [1]), ([1], [1, 2]), ([], [1, 2]), ([1, 2], [])):
        choice.judge(offered, matched=4, produced=produced)  # first wrong, or no later place produced
    assert table.trials == pytest.approx(2, abs=0.01)
    choice.judge([1, 2, 3, 4], matched=4, produced=[1, 2])  # the round ended on a right second draft
    assert table.trials == pytest.approx(3, abs=0.01) and table.hits == pytest.approx(2, abs=0.01)
    assert sum(rate.trials for rate in choice.calibration.first) == 0  # a lookup's first draft is the guess's
    suffix = lookup_choice(own_first=True)
    suffix.judge([1, 2], matched=4, produced=[5, 2])
    assert sum(rate.trials for rate in suffix.calibration.first) == pytest.approx(1)


def test_rounds_the_drafter_drafted_teach_the_sequences_later_drafts():
    """A request whose short matches lose is drafted by the model most rounds: its sequence's later drafts
    must still be judged there, or their estimate stays what copying requests taught the calibration."""
    choice = lookup_choice()
    for _ in range(100):
        choice.judge([7, 8], matched=4, produced=[7, 3, 1])  # first right, second wrong
    assert choice.calibration.later_draft(4) < 0.1
    assert choice.agreement.shift < 0  # this request's own estimate sinks as well
    for _ in range(300):
        choice.judge([7, 8], matched=4, produced=[7, 8])
    assert choice.calibration.later_draft(4) > 0.75


@pytest.mark.parametrize("take", [0, 1])
def test_the_planner_judges_every_offer_against_the_produced_tokens(engine, monkeypatch, take):
    """Through the chain loop, lookup never taken (the drafter drafts every round) or taking one draft of
    four (the offer is judged whole, not the part taken): the sequence offers the reference answer itself,
    so every judged later draft must be right; offering it with every draft after the first one wrong (the
    negative control), every one must be wrong."""
    from edge_spec.runtime.loops.config import ChainConfig

    monkeypatch.setattr(LookupChoice, "lookup_gamma", lambda self, *args, **kwargs: take)
    outcomes = {True: [], False: []}
    for prompt in REPETITIVE:
        ids = engine.bundle.tokenizer.encode(prompt)
        further, _ = run(engine, ids, SamplingParams(), 32, None)  # a round may produce tokens past the answer's end
        reference, sequence = further[:24], list(ids) + further
        for right in (True, False):

            def offer(self, tokens, gamma, min_n=None, right=right):
                drafts = sequence[len(tokens) : len(tokens) + 4]
                return (drafts if right else drafts[:1] + [token + 1 for token in drafts[1:]]), 4

            monkeypatch.setattr(NgramLookup, "match", offer)
            monkeypatch.setattr(
                SequenceCalibration,
                "record_later",
                lambda self, matched, judged, right=right: outcomes[right].append(judged),
            )
            got, stats = run(
                engine, ids, SamplingParams(), 24, ChainConfig(gamma=4, adaptive=False, proposers=("lookup", "model"))
            )
            assert got == reference and (stats.tally("lookup").rounds > 0) == bool(take)
    assert outcomes[True] and set(outcomes[True]) == {True}
    assert outcomes[False] and set(outcomes[False]) == {False}


REPETITIVE = ["a b c d a b c d a b", "def f(x): return x def f(x): return", "one two three one two three one"]


@pytest.fixture(scope="module")
def engine(int4_bundle):
    return Engine.from_bundle(int4_bundle, threads=1, mode="spec", draft_head="trim-160")


@pytest.mark.parametrize("gamma,adaptive", [(1, False), (3, False), (4, True)])
def test_greedy_with_lookup_equals_autoregressive(engine, gamma, adaptive):
    rounds = 0
    for prompt in REPETITIVE:
        ids = engine.bundle.tokenizer.encode(prompt)
        reference, _ = run(engine, ids, SamplingParams(), 40, None)
        got, stats = run(engine, ids, SamplingParams(), 40, chain(gamma, adaptive=adaptive, lookup=True))
        assert got == reference, prompt
        rounds += stats.tally("lookup").rounds
    assert rounds > 0, "no round was drafted by lookup: case not exercised"


def test_without_free_guesses_a_lookups_first_draft_is_still_checked(engine, monkeypatch):
    """No filler configured: the lookup's first draft stands in as the round's guess, so its estimate
    still learns in every round lookup offers drafts, taken or not."""
    from edge_spec.runtime.loops.config import ChainConfig

    checks = []
    record = RequestAcceptance.record_guess
    monkeypatch.setattr(
        RequestAcceptance,
        "record_guess",
        lambda self, matched, right: (checks.append(matched), record(self, matched, right))[1],
    )
    ids = engine.bundle.tokenizer.encode(REPETITIVE[0])
    reference, _ = run(engine, ids, SamplingParams(), 24, None)
    # a lookup that always offers (the last token again, as if after a 3-token match)
    monkeypatch.setattr(NgramLookup, "match", lambda self, tokens, gamma, min_n=None: ([tokens[-1]] * gamma, 3))
    got, stats = run(engine, ids, SamplingParams(), 24, ChainConfig(gamma=2, proposers=("lookup", "model")))
    assert got == reference
    rounds = sum(t.rounds for t in stats.sources.values())
    assert len(checks) >= rounds - 1 > 0 and set(checks) == {3}  # every round, from the lookup's offer


@pytest.mark.slow
def test_sampled_with_lookup_matches_target_distribution(engine, monkeypatch):
    """Lookup drafts are verified against a point-mass q.  To exercise that path in every round, the
    lookup here proposes a fixed function of the prefix (still a valid deterministic drafter), as if it
    continued a long match."""
    monkeypatch.setattr(NgramLookup, "match", lambda self, tokens, gamma, min_n=None: ([tokens[-1], 5][:gamma], 4))
    params = SamplingParams(temperature=1.0)
    ids = engine.bundle.tokenizer.encode(REPETITIVE[0])
    n = 1500
    ar = [tuple(run(engine, ids, params, 3, None, seed=s)[0]) for s in range(n)]
    rounds = 0
    spec = []
    for s in range(n):
        tokens, stats = run(engine, ids, params, 3, chain(2, lookup=True), seed=10**6 + s)
        spec.append(tuple(tokens))
        rounds += stats.tally("lookup").rounds
    assert rounds > n // 2
    assert chi_square_same_distribution(ar, spec) > 1e-3


def test_one_index_serves_longer_matches():
    """The loop keeps one index (1-grams up) for free guesses and asks it for 2+ token lookup matches."""
    seq = [3, 9, 1, 2, 4, 7, 1, 5, 1]
    shared = NgramLookup(min_n=1)
    assert shared.continuation(seq, 2) == [5, 1]  # a 1-token match: "1" last ended before 5
    assert shared.continuation(seq, 2, min_n=2) == NgramLookup(min_n=2).continuation(seq, 2) == []
    assert shared.continuation(seq + [5], 2, min_n=2) == [1, 5]  # "1 5" occurred before, followed by 1 5


def test_later_drafts_are_judged_by_the_match_behind_their_round():
    """A 64-token match is a copy under way; a 2-token one is mostly chance.  After a request that copied
    a file (long matches, every later draft right), an explanation's short matches whose later drafts
    fail must not draft on as if they were copies, and the copy's table must stay as it was."""
    choice = lookup_choice(own_first=True)
    for _ in range(60):
        choice.judge(list(range(9)), matched=64, produced=list(range(9)))
    copied = choice.calibration.later_draft(64)
    for _ in range(60):
        choice.judge([1, 2, 3, 4], matched=2, produced=[1, 5])  # first right, the second already wrong
    assert choice.calibration.later_draft(2) < 0.2 < 0.9 < choice.calibration.later_draft(64)
    assert choice.calibration.later_draft(64) == pytest.approx(copied, abs=0.01)
    model_rate = (1 + 0.8) / costs().round_cost(1)
    for _ in range(8):
        choice.record_first(2, 1.0, right=True)
        choice.record_first(64, 1.0, right=True)
    short = choice.lookup_gamma(4, 2, costs(), 4, model_rate, adaptive=True)
    long = choice.lookup_gamma(4, 64, costs(), 4, model_rate, adaptive=True)
    assert short <= 1 < long


def test_a_calibration_file_with_one_table_of_later_drafts_still_loads():
    calibration = AcceptanceCalibration()
    for _ in range(150):
        calibration.sequence.record_later(16, right=True)
    old = calibration.to_dict()
    old["sequence_later"] = [10.0, 40.0]  # the layout with one table for every match length
    again = AcceptanceCalibration.from_dict(old).sequence
    assert again.later_draft(16) == pytest.approx(SequenceCalibration().later_draft(16))  # learnt afresh
    assert AcceptanceCalibration.from_dict(calibration.to_dict()).sequence.later_draft(16) == pytest.approx(
        calibration.sequence.later_draft(16)
    )
