"""A cancel requested at any moment after a generation starts stops it: during the checks and cost
measurements a first request runs before its prompt is read, not only once tokens flow."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from edge_spec.runtime.engine import Engine
from edge_spec.runtime.loops.config import SsdConfig, TreeConfig
from tests.helpers import chain


@pytest.fixture()
def fresh_engine(int4_bundle):
    """An engine no request has run on yet: its first request's set-up steps still to come."""
    return Engine.from_bundle(int4_bundle, threads=1, mode="spec")


@pytest.mark.parametrize("slow_step", ["exact_for", "schedule_memory"])
def test_a_cancel_during_the_first_request_checks_is_kept(fresh_engine, monkeypatch, slow_step):
    """The cancel arrives while a slow set-up step runs (as the first request's exactness check or cost
    measurement does): the answer must stop before its first token, not run to its end."""
    owner = fresh_engine if slow_step == "exact_for" else fresh_engine.bundle
    real = getattr(owner, slow_step)

    def slow(*args, **kwargs):
        fresh_engine.cancel()  # the user pressed Ctrl-C (or the client went away) while this ran
        time.sleep(0.05)
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, slow_step, slow)
    got = fresh_engine.complete("hello", max_new_tokens=64, temperature=0.0)
    assert got.stats.stop_reason == "cancelled"
    assert got.token_ids == []


def test_a_cancel_before_a_generation_does_not_stop_the_next_one(fresh_engine):
    """Negative control: a cancel with nothing running is not carried into the next request."""
    fresh_engine.cancel()
    got = fresh_engine.complete("hello", max_new_tokens=8, temperature=0.0)
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
def greedy_reference(engine):
    """The target's own greedy answer (batch-invariant passes, as the speculative modes run)."""
    return engine.complete(ROUND_PROMPT, max_new_tokens=ROUND_TOKENS, mode="ar", exact=True).token_ids


def _stop_in_a_drafter_step(engine, config, monkeypatch):
    """One greedy answer in the loop ``config`` names, cancelled from inside the drafter's
    ``CANCEL_AT_STEP``-th step (as the UI thread does while it runs).  Returns the answer, the drafter
    steps taken and the row counts of the target passes started after the cancel."""
    monkeypatch.setattr(engine, "config", config)
    drafter = engine.bundle.active_drafter(config)
    steps, passes_after_cancel = 0, []
    real_step, real_forward = drafter.step, engine.bundle.target.forward

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
    monkeypatch.setattr(engine.bundle.target, "forward", forward)
    try:
        got = engine.complete(ROUND_PROMPT, max_new_tokens=ROUND_TOKENS, temperature=0.0)
    finally:
        monkeypatch.setattr(drafter, "step", real_step)
        monkeypatch.setattr(engine.bundle.target, "forward", real_forward)
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
def test_a_cancel_between_drafter_steps_skips_the_verify_pass(engine, greedy_reference, monkeypatch, loop):
    """Stop pressed while the drafter drafts: the round ends there, no target pass starts after it, every
    token given is one the target verified, and the same engine's next answer is the greedy answer."""
    got, steps, passes = _stop_in_a_drafter_step(engine, ROUND_CONFIGS[loop], monkeypatch)
    assert passes == [], f"target passes of {passes} rows ran after the cancel"
    _check_stopped_then_whole(engine, got, steps, greedy_reference)


def test_a_cancel_stops_ssd_drafting_ahead(engine, greedy_reference, monkeypatch):
    """SSD drafting the next round's outcomes while the target verifies: a cancel then stops that drafting
    at once; the verify pass under way ends and its verified tokens may be given, nothing more."""
    config = SsdConfig(gamma=3, speculations=4)  # four outcomes of two steps each after every verify pass
    got, steps, _ = _stop_in_a_drafter_step(engine, config, monkeypatch)
    _check_stopped_then_whole(engine, got, steps, greedy_reference)


# ---------------------------------------------------------------------------
# a cancel cuts a model pass under way
# ---------------------------------------------------------------------------

SLOW_PASS_SECONDS = 3.0  # how long an armed pass runs unless it is cut
CUT_WITHIN = 0.5  # a cut pass must return this much sooner after the cancel


class _SlowSession:
    """The target's ONNX Runtime session, whose armed pass repeats the same real pass for
    ``SLOW_PASS_SECONDS`` (each repeat writes the same cache rows and results): a pass as long as the
    real pair's verify pass, built from tiny ones, cut only where ONNX Runtime's own run is cut."""

    def __init__(self, real, on_start):
        self.real, self.on_start, self.armed = real, on_start, False
        self.slowed = 0

    def run_with_iobinding(self, binding, *options):
        if not self.armed:
            return self.real.run_with_iobinding(binding, *options)
        self.armed = False
        self.slowed += 1
        self.on_start()
        end = time.perf_counter() + SLOW_PASS_SECONDS
        while time.perf_counter() < end:
            self.real.run_with_iobinding(binding, *options)

    def __getattr__(self, name):
        return getattr(self.real, name)


def _cancel_in_a_pass(engine, monkeypatch, prompt, arm_at, decoder=None, **kwargs):
    """One greedy answer whose ``arm_at``-th pass of ``decoder`` (default: the target) is slow and is
    cancelled from another thread 50 ms after it starts (a UI's Stop).  Returns the answer, the seconds
    from the cancel to the answer's return, and the rows of that decoder's passes."""
    target = decoder or engine.bundle.target
    cancelled_at: list[float] = []

    def press_stop():
        time.sleep(0.05)
        cancelled_at.append(time.perf_counter())
        engine.cancel()

    session = _SlowSession(target.session, lambda: threading.Thread(target=press_stop).start())
    passes, real_forward = [], target.forward

    def forward(token_ids, *args, **kw):
        passes.append(len(token_ids))
        session.armed = len(passes) == arm_at
        return real_forward(token_ids, *args, **kw)

    monkeypatch.setattr(target, "session", session)
    monkeypatch.setattr(target, "forward", forward)
    try:
        got = engine.complete(prompt, temperature=0.0, **kwargs)
        returned = time.perf_counter()
    finally:
        monkeypatch.setattr(target, "session", session.real)
        monkeypatch.setattr(target, "forward", real_forward)
    assert session.slowed == 1 and cancelled_at, "the armed pass did not run"
    return got, returned - cancelled_at[0], passes


@pytest.mark.parametrize("loop", ["chain", "tree", "ssd"])
def test_a_cancel_cuts_the_verify_pass_under_way(engine, greedy_reference, monkeypatch, loop):
    """Stop pressed while the target verifies a round: the pass is cut, not waited for; the answer holds
    only verified tokens, and the same engine's next answer is the whole greedy answer."""
    monkeypatch.setattr(engine, "config", ROUND_CONFIGS[loop])
    got, seconds, passes = _cancel_in_a_pass(engine, monkeypatch, ROUND_PROMPT, arm_at=4, max_new_tokens=ROUND_TOKENS)
    assert passes[3] > 1, f"the cut pass fed {passes[3]} rows, not a round's drafts"
    assert seconds < CUT_WITHIN, f"the answer returned {seconds:.2f} s after the cancel"
    assert got.stats.stop_reason == "cancelled"
    assert 0 < len(got.token_ids) < ROUND_TOKENS
    assert got.token_ids == greedy_reference[: len(got.token_ids)]
    again = engine.complete(ROUND_PROMPT, max_new_tokens=ROUND_TOKENS, temperature=0.0)
    assert again.token_ids == greedy_reference


LONG_PROMPT = "Summarize: speculative decoding drafts tokens with a small model and verifies them. " * 3
CHUNK = 16  # tokens per prefill pass, so that the prompt takes several


@pytest.mark.parametrize("arm_at", [1, 2])
def test_a_cancel_cuts_a_long_prompt_s_prefill_pass(engine, monkeypatch, arm_at):
    """Stop pressed while a prompt longer than one prefill pass is read: the pass under way is cut, the
    cache keeps the passes that were read whole, and the next answer is the target's greedy answer."""
    reference = engine.complete(LONG_PROMPT, max_new_tokens=16, mode="ar", exact=True).token_ids
    engine.bundle.target.reset()
    monkeypatch.setattr(engine, "config", chain(4))
    monkeypatch.setattr(engine.bundle.target, "prefill_chunk", CHUNK)
    got, seconds, passes = _cancel_in_a_pass(engine, monkeypatch, LONG_PROMPT, arm_at=arm_at, max_new_tokens=16)
    assert len(engine.prompt_ids(LONG_PROMPT)) > 3 * CHUNK
    assert passes[:arm_at] == [CHUNK] * arm_at
    assert seconds < CUT_WITHIN, f"the answer returned {seconds:.2f} s after the cancel"
    assert got.stats.stop_reason == "cancelled" and got.token_ids == []
    assert engine.bundle.target.length == CHUNK * (arm_at - 1)  # the passes read whole, not the cut one
    again = engine.complete(LONG_PROMPT, max_new_tokens=16, temperature=0.0)
    assert again.token_ids == reference


def test_an_interrupt_with_no_pass_running_leaves_the_next_pass_alone(engine):
    """Negative control: an interrupt that comes between passes is not carried into the next one."""
    target = engine.bundle.target
    target.reset()
    first = target.forward([5, 6, 7], 3)["logits"]
    target.rewind(0)
    target.interrupt()
    again = target.forward([5, 6, 7], 3)["logits"]
    assert target.length == 3
    np.testing.assert_array_equal(again, first)


@pytest.mark.parametrize("loop", ["chain", "ssd"])
def test_a_cancel_cuts_the_drafter_step_under_way(engine, greedy_reference, monkeypatch, loop):
    """Stop pressed during a drafter step (SSD: while it drafts ahead of the verify pass under way): that
    pass is cut too, and the drafter's cache stays usable for the next answer."""
    config = ROUND_CONFIGS[loop] if loop == "chain" else SsdConfig(gamma=3, speculations=4)
    monkeypatch.setattr(engine, "config", config)
    drafter = engine.bundle.active_drafter(config).decoder
    got, seconds, passes = _cancel_in_a_pass(
        engine, monkeypatch, ROUND_PROMPT, arm_at=8, decoder=drafter, max_new_tokens=ROUND_TOKENS
    )
    assert seconds < CUT_WITHIN, f"the answer returned {seconds:.2f} s after the cancel"
    assert got.stats.stop_reason == "cancelled"
    assert len(got.token_ids) < ROUND_TOKENS
    assert got.token_ids == greedy_reference[: len(got.token_ids)]
    again = engine.complete(ROUND_PROMPT, max_new_tokens=ROUND_TOKENS, temperature=0.0)
    assert again.token_ids == greedy_reference
