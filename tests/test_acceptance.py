"""Acceptance estimates the planner prices drafts with, and their carrying across requests."""

import json

import pytest

from edge_spec.runtime.schedule.acceptance import AcceptanceCalibration, Agreement, RequestAcceptance, confidence_bin
from edge_spec.runtime.schedule.memory import ScheduleMemory
from edge_spec.runtime.engine import Engine
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


def test_memory_round_trips_and_shrugs_off_a_damaged_file(tmp_path):
    path = tmp_path / "acceptance.json"
    memory = ScheduleMemory(path)
    for _ in range(50):
        memory.calibration(greedy=True).record([0.97, 0.97], accepted=2)
    memory.save()
    again = ScheduleMemory(path)
    assert again.calibration(greedy=True).to_dict() == memory.calibration(greedy=True).to_dict()
    assert again.calibration(greedy=False).first.trials == 0  # sampled verification learns on its own
    path.write_text(json.dumps({"greedy": {"edges": [0.5]}}))
    assert ScheduleMemory(path).calibration(greedy=True).first.trials == 0
    assert not list(tmp_path.glob("*.tmp"))


def test_the_engine_carries_calibration_across_requests(int4_bundle):
    engine = Engine.from_bundle(int4_bundle, threads=1, config=chain(2, adaptive=True), draft_head="trim-160")
    memory = engine.schedule_memory()
    before = memory.calibration(greedy=True).first.trials
    engine.complete("one two three one two three one two", max_new_tokens=16, temperature=0)
    learned = memory.calibration(greedy=True).first.trials
    assert learned > before
    assert ScheduleMemory(memory.path).calibration(greedy=True).first.trials == pytest.approx(learned)
    engine.complete("one two three one two three one two", max_new_tokens=16, temperature=0)
    assert memory.calibration(greedy=True).first.trials > learned  # one calibration, not one per request
    assert memory.calibration(greedy=False).first.trials == 0
