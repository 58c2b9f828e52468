"""A cancel requested at any moment after a generation starts stops it: during the checks and cost
measurements a first request runs before its prompt is read, not only once tokens flow."""

from __future__ import annotations

import time

import pytest

from edge_spec.runtime.engine import Engine


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
