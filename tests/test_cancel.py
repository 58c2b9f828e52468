"""A cancel requested at any moment after a generation starts stops it: during the checks and cost
measurements a first request runs before its prompt is read, not only once tokens flow."""

from __future__ import annotations

import time

import pytest

from edge_spec.runtime.engine import Engine
from edge_spec.runtime.loops.config import SsdConfig, TreeConfig
from tests.helpers import chain


@pytest.fixture()
def engine(int4_bundle):
    return Engine.from_bundle(int4_bundle, threads=1, mode="spec")


@pytest.mark.parametrize("slow_step", ["exact_for", "schedule_memory"])
def test_a_cancel_during_the_first_request_checks_is_kept(engine, monkeypatch, slow_step):
    """The cancel arrives while a slow set-up step runs (as the first request's exactness check or cost
    measurement does): the answer must stop before its first token, not run to its end."""
    real = getattr(engine, slow_step)

    def slow(*args, **kwargs):
        engine.cancel()  # the user pressed Ctrl-C (or the client went away) while this ran
        time.sleep(0.05)
        return real(*args, **kwargs)

    monkeypatch.setattr(engine, slow_step, slow)
    got = engine.complete("hello", max_new_tokens=64, temperature=0.0)
    assert got.stats.stop_reason == "cancelled"
    assert got.token_ids == []


def test_a_cancel_before_a_generation_does_not_stop_the_next_one(engine):
    """Negative control: a cancel with nothing running is not carried into the next request."""
    engine.cancel()
    got = engine.complete("hello", max_new_tokens=8, temperature=0.0)
    assert got.stats.stop_reason != "cancelled" and got.token_ids


# ---------------------------------------------------------------------------
# a cancel inside a speculative round stops it before the target's verify pass
# ---------------------------------------------------------------------------

ROUND_PROMPT = "def is_prime(n):"
ROUND_TOKENS = 48  # the tiny model's greedy answer runs to the limit (no end token)
CANCEL_AT_STEP = 5  # the drafter `step` call (a draft after its round's first) during which Stop is pressed


ROUND_CONFIGS = {
    "chain": chain(4),  # four drafter steps a round, then one five-row verify pass
    "tree": TreeConfig(gamma=3, drafts=2),  # two branches, one tree-shaped pass
    "ssd": SsdConfig(gamma=4, speculations=0),  # every round drafted on the critical path
}


@pytest.fixture(scope="module")
def round_engine(int4_bundle):
    engine = Engine.from_bundle(int4_bundle, threads=1, mode="spec")
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def greedy_reference(round_engine):
    """The target's own greedy answer (batch-invariant passes, as the speculative modes run)."""
    return round_engine.complete(ROUND_PROMPT, max_new_tokens=ROUND_TOKENS, mode="ar", exact=True).token_ids


def _stop_in_a_drafter_step(engine, config, monkeypatch):
    """One greedy answer in the loop ``config`` names, cancelled from inside the drafter's
    ``CANCEL_AT_STEP``-th step (as the UI thread does while it runs).  Returns the answer, the drafter
    steps taken and the row counts of the target passes started after the cancel."""
    monkeypatch.setattr(engine, "config", config)
    drafter = engine.active_drafter(config)
    steps, passes_after_cancel = 0, []
    real_step, real_forward = drafter.step, engine.target.forward

    def step(token):
        nonlocal steps
        steps += 1
        if steps == CANCEL_AT_STEP:
            engine.cancel()
        return real_step(token)

    def forward(*args, **kwargs):
        if steps >= CANCEL_AT_STEP:
            passes_after_cancel.append(len(args[0]))
        return real_forward(*args, **kwargs)

    monkeypatch.setattr(drafter, "step", step)
    monkeypatch.setattr(engine.target, "forward", forward)
    try:
        got = engine.complete(ROUND_PROMPT, max_new_tokens=ROUND_TOKENS, temperature=0.0)
    finally:
        monkeypatch.setattr(drafter, "step", real_step)
        monkeypatch.setattr(engine.target, "forward", real_forward)
    return got, steps, passes_after_cancel


def _check_stopped_then_whole(engine, got, steps, reference):
    """The cancelled answer: no drafter step after the one that cancelled, only verified tokens; the same
    engine's next answer: the whole greedy answer."""
    assert steps == CANCEL_AT_STEP, f"{steps - CANCEL_AT_STEP} drafter steps ran after the cancel"
    assert got.stats.stop_reason == "cancelled"
    assert 0 < len(got.token_ids) < ROUND_TOKENS
    assert got.token_ids == reference[: len(got.token_ids)]
    again = engine.complete(ROUND_PROMPT, max_new_tokens=ROUND_TOKENS, temperature=0.0)
    assert again.stats.stop_reason == "length"
    assert again.token_ids == reference


@pytest.mark.parametrize("loop", ["chain", "tree", "ssd"])
def test_a_cancel_between_drafter_steps_skips_the_verify_pass(round_engine, greedy_reference, monkeypatch, loop):
    """Stop pressed while the drafter drafts: the round ends there, no target pass starts after it, every
    token given is one the target verified, and the same engine's next answer is the greedy answer."""
    got, steps, passes = _stop_in_a_drafter_step(round_engine, ROUND_CONFIGS[loop], monkeypatch)
    assert passes == [], f"target passes of {passes} rows ran after the cancel"
    _check_stopped_then_whole(round_engine, got, steps, greedy_reference)


def test_a_cancel_stops_ssd_drafting_ahead(round_engine, greedy_reference, monkeypatch):
    """SSD drafting the next round's outcomes while the target verifies: a cancel then stops that drafting
    at once; the verify pass under way ends and its verified tokens may be given, nothing more."""
    config = SsdConfig(gamma=3, speculations=4)  # four outcomes of two steps each after every verify pass
    got, steps, _ = _stop_in_a_drafter_step(round_engine, config, monkeypatch)
    _check_stopped_then_whole(round_engine, got, steps, greedy_reference)
