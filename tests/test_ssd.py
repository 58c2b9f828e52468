"""Speculative speculative decoding: outcome prediction, greedy identity across thread splits, forced
cache hits and misses giving identical output, exact sampling distribution."""

from __future__ import annotations

import pytest

from edge_spec.errors import EdgeSpecError
from edge_spec.runtime.engine import Engine
from edge_spec.runtime.sampling import SamplingParams
from edge_spec.runtime.speculative import DraftBlock, SpecConfig
from edge_spec.runtime.ssd import generate_ssd, predict_outcomes
from tests.test_speculative import PROMPTS, _chi_square_same_distribution, run


def test_predict_outcomes_excludes_the_draft_and_ranks_by_probability():
    block = DraftBlock(tokens=[5, 7], confidences=[0.8, 0.5],
                       alternatives=[[(5, 0.8), (2, 0.1), (3, 0.05)], [(7, 0.5), (9, 0.3), (1, 0.1)]])
    outcomes = predict_outcomes(block, bonus=[(4, 0.6), (6, 0.2)], fan_out=2)
    keys = [o for _, o in outcomes]
    assert (0, 5) not in keys and (1, 7) not in keys  # a rejected draft is never the correction
    probs = dict((o, p) for p, o in outcomes)
    assert probs[(2, 4)] == pytest.approx(0.8 * 0.5 * 0.6)
    assert probs[(0, 2)] == pytest.approx(0.2 * 0.1 / 0.2)
    assert probs[(1, 9)] == pytest.approx(0.8 * 0.5 * 0.3 / 0.5)
    assert [p for p, _ in outcomes] == sorted((p for p, _ in outcomes), reverse=True)
    assert sum(probs.values()) <= 1.0 + 1e-12


def run_ssd(engine: Engine, ids, params, n, spec: SpecConfig, seed=0):
    return run(engine, ids, params, n, spec, seed, loop=generate_ssd)


@pytest.fixture(scope="module", params=[(1, 1), (2, 1), (1, 2)], ids=["1+1", "2+1", "1+2"])
def split_engine(request, int4_bundle):
    threads, draft_threads = request.param
    return Engine.from_bundle(int4_bundle, threads=threads, draft_threads=draft_threads, mode="ssd",
                              draft_head="trim-160")


@pytest.mark.parametrize("gamma", [1, 2, 4])
@pytest.mark.parametrize("speculations", [-1, 0, 50])
def test_greedy_ssd_equals_autoregressive(split_engine, gamma, speculations):
    engine = split_engine
    hits = misses = 0
    for prompt in PROMPTS:
        ids = engine.tokenizer.encode(prompt)
        reference, _ = run(engine, ids, SamplingParams(), 40, None)
        got, stats = run_ssd(engine, ids, SamplingParams(), 40, SpecConfig(gamma=gamma, speculations=speculations))
        assert got == reference, f"γ={gamma} speculations={speculations} prompt={prompt!r}"
        hits += stats.speculation_hits
        misses += stats.speculation_misses
    if speculations == 0:
        assert hits == 0  # forced miss: every round drafted on the spot
    if speculations == 50:
        assert hits > 0  # forced hit: every predicted outcome prepared (tiny random models rarely agree,
        # so most outcomes are still unpredictable)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_forced_hit_and_forced_miss_give_identical_output(fp32_bundle, temperature):
    """Drafts come from a stream keyed by the prefix, so a prepared block and one drafted on the spot
    are the same tokens: output cannot depend on what the speculation cache held."""
    engine = Engine.from_bundle(fp32_bundle, threads=1, draft_threads=1, mode="ssd")
    params = SamplingParams(temperature=temperature)
    hits = 0
    for seed, prompt in enumerate(PROMPTS):
        ids = engine.tokenizer.encode(prompt)
        miss, miss_stats = run_ssd(engine, ids, params, 32, SpecConfig(gamma=3, speculations=0), seed=seed)
        # a wide fan-out, so that the flat distributions of a random tiny model still give hits
        hit, hit_stats = run_ssd(engine, ids, params, 32, SpecConfig(gamma=3, speculations=200, fan_out=24),
                                 seed=seed)
        timed, _ = run_ssd(engine, ids, params, 32, SpecConfig(gamma=3), seed=seed)
        assert miss == hit == timed
        assert miss_stats.speculation_hits == 0
        hits += hit_stats.speculation_hits
    assert hits > 0


def test_sampled_ssd_matches_target_distribution(int4_bundle):
    engine = Engine.from_bundle(int4_bundle, threads=1, draft_threads=1, mode="ssd", draft_head="trim-64")
    params = SamplingParams(temperature=1.0)
    ids = engine.tokenizer.encode("The quick")
    n = 1500
    ar = [tuple(run(engine, ids, params, 3, None, seed=s)[0]) for s in range(n)]
    ssd = [tuple(run_ssd(engine, ids, params, 3, SpecConfig(gamma=1, speculations=6), seed=10**6 + s)[0])
           for s in range(n)]
    assert _chi_square_same_distribution(ar, ssd) > 1e-3


def test_engine_ssd_mode_reports_hit_rate(int4_bundle):
    engine = Engine.from_bundle(int4_bundle, threads=1, draft_threads=1, mode="ssd", spec=SpecConfig(gamma=2))
    got = engine.complete("def is_prime", max_new_tokens=24)
    ar = engine.complete("def is_prime", max_new_tokens=24, mode="ar")
    assert got.token_ids == ar.token_ids
    extra = got.stats.extra
    assert 0.0 <= extra["cache_hit_rate"] <= 1.0 and extra["tau"] >= 1.0


def test_ssd_refuses_multi_draft_in_one_line(int4_bundle):
    with pytest.raises(EdgeSpecError, match="spec mode only"):
        Engine.from_bundle(int4_bundle, threads=1, mode="ssd", spec=SpecConfig(gamma=2, drafts=2))
    engine = Engine.from_bundle(int4_bundle, threads=1, mode="spec", spec=SpecConfig(gamma=2, drafts=2))
    with pytest.raises(EdgeSpecError, match="spec mode only"):
        engine.complete("def is_prime", max_new_tokens=4, mode="ssd")


def test_engine_refuses_negative_thread_counts(int4_bundle):
    for threads, draft_threads in ((-1, None), (1, -2)):
        with pytest.raises(EdgeSpecError, match="threads must be 0"):
            Engine.from_bundle(int4_bundle, threads=threads, draft_threads=draft_threads, mode="ssd")
