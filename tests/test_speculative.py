"""Speculative loop on tiny models: token-identical greedy output, exact sampling distribution."""

from __future__ import annotations

import pytest

from edge_spec.runtime.engine import Engine
from edge_spec.runtime.verify.sampling import SamplingParams
from tests.helpers import PROMPTS, chain, run, sampled_matches_target

HEADS = ["full", "trim-160", "trim-64", "specvocab-r16-k48", "trim32+specvocab-r16-k48", "specvocab-r16-k48-of160"]


@pytest.fixture(scope="module", params=HEADS)
def any_engine(request, int4_bundle):
    return Engine.from_bundle(int4_bundle, threads=1, mode="spec", draft_head=request.param)


@pytest.fixture(scope="module")
def engine(int4_bundle):
    return Engine.from_bundle(int4_bundle, threads=1, mode="spec", draft_head="full")


@pytest.mark.parametrize("gamma", range(1, 9))
def test_greedy_speculative_equals_autoregressive(any_engine, gamma):
    engine = any_engine
    greedy = SamplingParams()
    total_rejections = 0
    outside_head = 0
    outside_candidates = 0
    kept = (
        set(engine.bundle.drafter.head.vocab_ids.tolist()) if engine.bundle.drafter.head.vocab_ids is not None else None
    )
    for prompt in PROMPTS:
        ids = engine.bundle.tokenizer.encode(prompt)
        reference, _ = run(engine, ids, greedy, 40, None)
        got, stats = run(engine, ids, greedy, 40, chain(gamma))
        assert got == reference, f"head={engine.bundle.draft_head} γ={gamma} prompt={prompt!r}"
        total_rejections += sum(d - a for d, a in zip(stats.drafted, stats.accepted))
        assert max(stats.drafted) <= gamma
        outside_candidates += stats.candidate_checks - stats.candidate_hits
        if kept is not None:
            outside_head += sum(t not in kept for t in reference)
    assert total_rejections > 0, "the drafter never disagreed: test would not exercise rollback"
    if engine.bundle.draft_head == "trim-64":
        assert outside_head > 0, "no target token fell outside the trimmed head: case not exercised"
    if "specvocab" in engine.bundle.draft_head and gamma == 4:
        assert outside_candidates > 0, "the target's token was always a candidate: case not exercised"


def test_greedy_with_confidence_cutoff_equals_autoregressive(engine):
    ids = engine.bundle.tokenizer.encode(PROMPTS[0])
    reference, _ = run(engine, ids, SamplingParams(), 40, None)
    got, stats = run(engine, ids, SamplingParams(), 40, chain(6, min_confidence=0.6))
    assert got == reference
    assert min(stats.drafted) < 6


def test_engine_spec_mode_matches_ar_and_reports_tau(int4_bundle):
    engine = Engine.from_bundle(int4_bundle, threads=1, config=chain(3))
    spec = engine.complete([{"role": "user", "content": "def is_prime"}], max_new_tokens=30)
    ar = engine.complete([{"role": "user", "content": "def is_prime"}], max_new_tokens=30, mode="ar")
    assert spec.token_ids == ar.token_ids
    extra = spec.stats.spec
    assert 1.0 <= extra.tau <= 4.0
    assert extra.mbsu == pytest.approx(extra.tau / (extra.param_ratio * extra.mean_gamma + 1))


@pytest.mark.slow
def test_sampled_speculative_matches_target_distribution(any_engine):
    """Tokens 2-3 go through draft verification (max_new=3 leaves room for one draft + its
    correction/bonus), so their joint law with token 1 must equal target-only sampling."""
    sampled_matches_target(any_engine, chain(3))


def test_adaptive_gamma_is_lossless(any_engine):
    engine = any_engine
    for prompt in PROMPTS:
        ids = engine.bundle.tokenizer.encode(prompt)
        reference, _ = run(engine, ids, SamplingParams(), 40, None)
        got, stats = run(engine, ids, SamplingParams(), 40, chain(5, adaptive=True))
        assert got == reference
        assert max(stats.drafted) <= 5
