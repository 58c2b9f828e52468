"""Acceptance estimates the planner prices drafts with, and their carrying across requests."""

import json

import pytest

from edge_spec.runtime.engine import Engine
from edge_spec.runtime.schedule.acceptance import (
    AGREEMENT_SPREADS,
    CAUTION_FADE,
    REQUEST_CAUTION,
    AcceptanceCalibration,
    Agreement,
    LogOddsShift,
    RequestAcceptance,
    confidence_bin,
    shifted,
)
from edge_spec.runtime.schedule.memory import ScheduleMemory
from tests.helpers import chain


def test_before_any_evidence_a_draft_is_worth_its_confidence():
    calibration = AcceptanceCalibration()
    assert calibration.acceptance(0.9) == pytest.approx(0.9)
    assert calibration.acceptance(0.1) == pytest.approx(0.1)


def test_only_drafts_up_to_the_first_rejection_are_evidence():
    calibration = AcceptanceCalibration()
    calibration.record([0.99, 0.3, 0.99, 0.99], accepted=1)  # the 3rd and 4th were never judged
    assert calibration.by_confidence[confidence_bin(0.99)].trials == pytest.approx(1)
    assert calibration.by_confidence[confidence_bin(0.3)].trials == pytest.approx(1)
    assert calibration.by_confidence[confidence_bin(0.3)].hits == 0
    assert calibration.first.hits == pytest.approx(1) and calibration.first.trials == pytest.approx(1)
    assert calibration.after[confidence_bin(0.99)].trials == pytest.approx(1)  # the 2nd followed a 0.99


def test_bins_learn_a_miscalibrated_drafter():
    calibration = AcceptanceCalibration()
    for _ in range(300):  # confident but wrong half the time; unsure but always right
        calibration.record([0.97], accepted=0)
        calibration.record([0.97], accepted=1)
        calibration.record([0.4], accepted=1)
    assert calibration.acceptance(0.97) == pytest.approx(0.5, abs=0.02)
    assert calibration.acceptance(0.4) > 0.97


def test_streaks_the_after_table_learns():
    calibration = AcceptanceCalibration()
    for _ in range(300):
        calibration.record([0.99, 0.99], accepted=2)  # after a sure draft the next is accepted
        calibration.record([0.6, 0.6], accepted=1)  # after an unsure one it is not
    assert calibration.next_after(0.99) > 0.95
    assert calibration.next_after(0.6) < 0.05


def test_a_request_keeps_its_own_first_draft_average():
    calibration = AcceptanceCalibration()
    request = RequestAcceptance(calibration)
    start = request.first
    for _ in range(20):
        request.record([0.9], accepted=1)
    assert request.first > 0.95 > start
    assert RequestAcceptance(calibration).first > start  # the next request starts from what was learned


def test_a_request_scales_estimates_by_odds_not_past_certainty():
    """One lucky draft (predicted 0.35, accepted) must not make a 0.87 draft look certain, which would
    buy long drafts; a request whose drafts keep failing sinks its estimates, one that keeps
    succeeding lifts them, and neither reaches 0 or 1."""
    lucky = Agreement()
    lucky.note(0.35, True)
    assert 0.87 < lucky.scale(0.87) < 0.95
    assert lucky.scale(0.0) == 0.0 and lucky.scale(1.0) == 1.0
    failing, succeeding = Agreement(), Agreement()
    for _ in range(10):
        failing.note(0.9, False)
        succeeding.note(0.5, True)
    assert 0.0 < failing.scale(0.9) < 0.5
    assert 0.9 < succeeding.scale(0.8) < 1.0
    assert Agreement().scale(0.6) == pytest.approx(0.6)  # no evidence: the calibration as it is


def test_a_lucky_unsure_draft_does_not_buy_long_rounds_but_a_run_of_surprises_moves_the_request():
    """The shift is in log-odds and averaged over a narrow and a wide prior: one unsure draft (0.2)
    accepted leaves a 0.98 draft at about 0.98 (an odds ratio from a few drafts of prior made it
    0.995 and bought four-draft rounds that translation then lost), while three confident drafts (0.9)
    rejected in a row make the request's 0.9 drafts worse than even."""
    lucky = Agreement()
    lucky.note(0.2, True)
    assert 0.98 < lucky.scale(0.98) < 0.986
    surprised = Agreement()
    surprised.note(0.9, False)
    assert surprised.scale(0.9) > 0.85  # one rejection: the calibration is still believed
    for _ in range(2):
        surprised.note(0.9, False)
    assert surprised.scale(0.9) < 0.5
    assert surprised.scale(0.99) > surprised.scale(0.9) > surprised.scale(0.5)  # the order is kept


def test_memory_round_trips_and_shrugs_off_a_damaged_file(tmp_path):
    path = tmp_path / "acceptance.json"
    memory = ScheduleMemory(path)
    for _ in range(50):
        memory.calibration("greedy").record([0.97, 0.97], accepted=2)
    memory.save()
    again = ScheduleMemory(path)
    assert again.calibration("greedy").to_dict() == memory.calibration("greedy").to_dict()
    assert again.calibration("sampled").first.trials == 0  # sampled verification learns on its own
    path.write_text(json.dumps({"greedy": {"edges": [0.5]}}))
    assert ScheduleMemory(path).calibration("greedy").first.trials == 0
    assert not list(tmp_path.glob("*.tmp"))


def test_the_engine_carries_calibration_across_requests(int4_bundle):
    engine = Engine.from_bundle(int4_bundle, threads=1, config=chain(2, adaptive=True), draft_head="trim-160")
    memory = engine.bundle.schedule_memory(engine.config)
    before = memory.calibration("greedy").first.trials
    engine.complete("one two three one two three one two", max_new_tokens=16, temperature=0)
    learned = memory.calibration("greedy").first.trials
    assert learned > before
    assert ScheduleMemory(memory.path).calibration("greedy").first.trials == pytest.approx(learned)
    engine.complete("one two three one two three one two", max_new_tokens=16, temperature=0)
    assert memory.calibration("greedy").first.trials > learned  # one calibration, not one per request
    assert memory.calibration("sampled").first.trials == 0


def test_the_engine_measures_what_a_round_spends_outside_the_models(int4_bundle):
    engine = Engine.from_bundle(int4_bundle, threads=1, config=chain(2, adaptive=True), draft_head="trim-160")
    memory = engine.bundle.schedule_memory(engine.config)
    rounds = memory.overhead.rounds
    spec = engine.complete("one two three one two three one two", max_new_tokens=16, temperature=0).stats.spec
    assert memory.overhead.rounds == rounds + spec.target_calls  # every verify pass is a round
    round_seconds = (spec.draft_seconds + spec.verify_seconds) / spec.target_calls
    assert 0.0 < memory.overhead.seconds < round_seconds  # the models' time is left out


def test_the_round_clock_leaves_the_drafter_s_whole_steps_out_of_the_overhead():
    """A draft step's own Python (confidence, stop rule) is in the step's cost already; only what the
    round spends outside its steps and the target's pass is the round's overhead."""
    import time

    import numpy as np

    from edge_spec.runtime.loops.request import RoundClock
    from edge_spec.runtime.propose.base import DraftRule
    from edge_spec.runtime.propose.model import ChainDrafter
    from edge_spec.runtime.verify.sampling import SamplingParams

    class SlowDrafter(ChainDrafter):
        name = "slow"
        head_seconds = 0.0

        def start(self, committed):
            return self.step(0) + (2,)  # a catch-up step over two rows counts too

        def step(self, token):
            time.sleep(0.02)
            return np.eye(8)[3] * 10.0, None

    drafter = SlowDrafter(8)
    rule = DraftRule(SamplingParams(), np.random.default_rng(0), gamma=3)
    clock = RoundClock(drafter)
    drafter.propose([1, 2], room=8, rule=rule)
    clock.drafted()
    clock.verified()
    assert clock.draft_seconds >= 0.06 and clock.outside_seconds < 0.01
    unaware = RoundClock(None)  # the control: a clock that does not know the drafter counts its steps
    drafter.propose([1, 2], room=8, rule=rule)
    unaware.drafted()
    unaware.verified()
    assert unaware.outside_seconds >= 0.06


def test_free_guesses_are_calibrated_by_the_suffix_they_matched_and_carried(tmp_path):
    calibration = AcceptanceCalibration()
    assert calibration.guess_rate(0) < calibration.guess_rate(1) < calibration.guess_rate(4)  # priors
    for _ in range(60):
        calibration.record_guess(4, accepted=False)  # long matches that keep failing (a miscalibrated prior)
        calibration.record_guess(0, accepted=True)
        calibration.record([0.9], accepted=1)
    assert calibration.guess_rate(4) < 0.1 and calibration.guess_rate(0) > 0.9
    assert calibration.guess_rate(7) == calibration.guess_rate(4)  # 4+ share a bucket
    path = tmp_path / "acceptance.json"
    memory = ScheduleMemory(path)
    memory.calibrations["greedy"] = calibration
    memory.save()
    assert ScheduleMemory(path).calibration("greedy").guess_rate(4) == pytest.approx(calibration.guess_rate(4))
    older = json.loads(path.read_text())
    del older["greedy"]["guess"]  # a file written before guesses were calibrated keeps the rest
    path.write_text(json.dumps(older))
    loaded = ScheduleMemory(path).calibration("greedy")
    assert calibration.first.trials > 0 and loaded.first.trials == pytest.approx(calibration.first.trials)
    assert loaded.guess[4].trials == 0


def test_a_request_checks_its_guesses_against_the_calibration():
    calibration = AcceptanceCalibration()
    for _ in range(200):  # answers whose 4+ matches went on as before
        calibration.record_guess(4, accepted=True)
    carried = calibration.guess_rate(4)
    translation, copying = RequestAcceptance(calibration), RequestAcceptance(calibration)
    fresh = translation.guess(4)
    assert fresh == pytest.approx(
        shifted(carried, REQUEST_CAUTION)
    )  # no evidence yet: the calibration's word, from below
    for _ in range(8):
        translation.record_guess(4, right=False)
        copying.record_guess(4, right=True)
    assert translation.guess(4) < 0.5 * calibration.guess_rate(4)  # this request's guesses fail: it stops trusting them
    assert (
        copying.guess(4) >= shifted(calibration.guess_rate(4), REQUEST_CAUTION) > 0.9
    )  # negative control: right guesses keep their rate
    assert RequestAcceptance(calibration).guess(4) == pytest.approx(shifted(calibration.guess_rate(4), REQUEST_CAUTION))


def test_a_request_starts_cautious_and_the_caution_fades_with_its_judged_drafts():
    """A new request prices every draft below what the calibration says (``for_request``).  The caution
    fades with the drafts judged, whatever they show: a predictable request whose confident drafts are
    accepted as predicted is back at the calibration within a few rounds (as evidence, those drafts
    would barely move it), while drafts that do worse than predicted take it further down.  A bare
    ``Agreement`` (no request caution) starts neutral."""
    calibration = AcceptanceCalibration()
    for k in range(300):
        calibration.record([0.9], accepted=int(k % 5 != 0))  # 0.9 drafts accepted four times in five
        calibration.record([0.99], accepted=int(k % 50 != 0))  # 0.99 drafts 49 times in 50
    predicted, sure = calibration.acceptance(0.9), calibration.acceptance(0.99)
    start = RequestAcceptance(calibration).acceptance(0.9)
    assert start == pytest.approx(shifted(predicted, REQUEST_CAUTION)) and start < predicted - 0.05
    assert Agreement().scale(predicted) == pytest.approx(predicted)
    predictable, doing_worse = RequestAcceptance(calibration), RequestAcceptance(calibration)
    assert predictable.acceptance(0.99) < sure - 0.01
    for _ in range(int(3 * CAUTION_FADE)):
        predictable.record([0.99], accepted=1)
        doing_worse.record([0.9], accepted=0)
    assert sure - 0.002 < predictable.acceptance(0.99) <= 1.0  # the caution is gone, not outweighed
    assert doing_worse.acceptance(0.9) < start
    held_as_evidence = Agreement(
        LogOddsShift(AGREEMENT_SPREADS[0], REQUEST_CAUTION), LogOddsShift(AGREEMENT_SPREADS[1], REQUEST_CAUTION)
    )
    for _ in range(int(3 * CAUTION_FADE)):
        held_as_evidence.note(sure, True)
    assert held_as_evidence.scale(sure) < sure - 0.003  # negative control: a prior mean would still hold it down


def test_every_round_checks_the_guess_it_could_have_carried(int4_bundle, monkeypatch):
    """Drafted or not, each round learns whether its free guess equals the token the target produced
    there.  The guess here is right at even positions and wrong at odd ones (any function of the prefix
    is a valid guess), so the recorded checks must follow that pattern exactly."""
    from edge_spec.runtime.propose.base import point_mass_block
    from edge_spec.runtime.propose.guess import FreeGuess
    from edge_spec.runtime.verify.sampling import SamplingParams
    from tests.helpers import run

    engine = Engine.from_bundle(int4_bundle, threads=1, mode="spec", draft_head="trim-160")
    ids = engine.bundle.tokenizer.encode("one two three one two three one two")
    engine.bundle.target.min_rows = 2  # batch-invariant passes: a round without drafts carries a guess
    reference, _ = run(engine, ids, SamplingParams(), 24, None)
    sequence = list(ids) + reference
    guessed = []

    def guess(self, committed, room, rule):
        position = len(committed)  # committed ends at the pending token: the guess is for this position
        guessed.append(position)
        token = sequence[position] if position % 2 == 0 else (sequence[position] + 1) % engine.bundle.target.vocab_size
        block = point_mass_block(self.name, [token], rule.params)
        block.matched = 1
        return block

    checks = []
    record = RequestAcceptance.record_guess
    monkeypatch.setattr(FreeGuess, "propose", guess)
    monkeypatch.setattr(
        RequestAcceptance,
        "record_guess",
        lambda self, matched, right: (checks.append(right), record(self, matched, right))[1],
    )
    tokens, stats = run(engine, ids, SamplingParams(), 24, chain(2, adaptive=True))
    assert tokens == reference
    rounds = sum(t.rounds for t in stats.sources.values())
    assert len(checks) == len(guessed) >= rounds - 1 > 0  # every round with room for a token after the pending one
    assert stats.tally("model").rounds > 0  # rounds the drafter drafted checked their guesses too
    assert checks == [position % 2 == 0 for position in guessed] and any(checks) and not all(checks)


def test_a_dropped_draft_after_accepted_ones_counts_against_the_table_of_later_drafts():
    """The later-draft table prices a draft before its confidence is known; a draft the stop rule then
    dropped bought nothing for its step, so it counts as a miss there -- but only where it would have been
    judged (every verified draft accepted), and never in the by-confidence table (it was not verified)."""
    calibration = AcceptanceCalibration()
    calibration.record([0.99, 0.97], accepted=2, dropped=True)
    after = calibration.after[confidence_bin(0.97)]
    assert after.trials == pytest.approx(1) and after.hits == 0
    assert sum(r.trials for r in calibration.by_confidence) == pytest.approx(2)
    rejected = AcceptanceCalibration()
    rejected.record([0.99, 0.97], accepted=1, dropped=True)  # the drop followed a rejection: never judged
    assert rejected.after[confidence_bin(0.97)].trials == 0
    kept = AcceptanceCalibration()
    kept.record([0.99, 0.97], accepted=2)  # control: nothing dropped, nothing counted after the last draft
    assert kept.after[confidence_bin(0.97)].trials == 0
    for _ in range(100):  # streaks whose successors keep being dropped: later drafts priced low
        calibration.record([0.99], accepted=1, dropped=True)
    assert calibration.next_after(0.99) < 0.2 < kept.next_after(0.99)
