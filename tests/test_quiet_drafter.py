"""Requests whose drafts keep losing: the drafter rests, and rounds without drafts run in one row where
one-row passes are exact -- decided from the tokens, and the answer stays the target's."""

from __future__ import annotations

import pytest

from edge_spec.runtime.engine import Engine
from edge_spec.runtime.loops.config import loop_config
from edge_spec.runtime.schedule.acceptance import RequestAcceptance
from edge_spec.runtime.schedule.planner import QUIET_ROUNDS, QuietDrafter


def rests(outcomes: list[bool]) -> list[int]:
    """The rest the drafter is given after each outcome."""
    quiet, seen = QuietDrafter(), []
    for accepted in outcomes:
        quiet.record(accepted)
        seen.append(quiet.rest)
        while quiet.holds():  # the rounds it rests
            pass
    return seen


def test_two_lost_rounds_in_a_losing_request_rest_the_drafter_longer_each_time():
    first, longest = QUIET_ROUNDS
    assert rests([False, False]) == [0, first]
    assert rests([False, False, False, False]) == [0, first, 2 * first, 4 * first]
    # a win ends the streak and the doubling; two more losses in a request still losing rest it again
    assert rests([False, False, False, True, False, False]) == [0, first, 2 * first, 0, 0, first]
    assert max(rests([False] * 20)) == longest


def test_a_request_whose_drafts_mostly_win_never_rests():
    assert set(rests([True, True, False, False, True, True, True, False, False, True])) == {0}


class RowCounter:
    """Counts the rows of every target pass the loop runs."""

    def __init__(self, decoder) -> None:
        self.decoder, self.rows = decoder, []
        self.forward = decoder.forward

    def __call__(self, ids, num_logits=1, **kw):
        lean = kw.get("lean", False)
        least = self.decoder.exact_rows if lean else self.decoder.min_rows
        self.rows.append(max(len(ids), least))
        return self.forward(ids, num_logits, **kw)


@pytest.mark.parametrize("prompt", ["def is_prime", "zq xv kj wp"])
def test_rounds_whose_guesses_keep_failing_run_in_one_row_and_equal_ar_exact(int4_bundle, monkeypatch, prompt):
    config = loop_config("spec", lookup=False)  # the drafter and the guess only
    engine = Engine.from_bundle(int4_bundle, threads=1, config=config, draft_head="trim-64")
    reference = engine.complete(prompt, max_new_tokens=24, mode="ar", exact=True).token_ids
    counter = RowCounter(engine.bundle.target)
    monkeypatch.setattr(engine.bundle.target, "forward", counter)
    monkeypatch.setattr(RequestAcceptance, "guess", lambda self, matched: 0.0)  # no guess ever pays
    monkeypatch.setattr(QuietDrafter, "holds", lambda self: True)  # the drafter rests throughout
    assert engine.complete(prompt, max_new_tokens=24).token_ids == reference
    decode = counter.rows[1:]  # after the prompt's pass
    if engine.bundle.exact_rows() == 1:
        assert decode and set(decode) == {1}
    else:  # where one-row passes are not exact, the pad row stays
        assert decode and set(decode) == {2}
