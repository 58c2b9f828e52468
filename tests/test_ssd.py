"""Speculative speculative decoding: outcome prediction, greedy identity across thread splits, forced
cache hits and misses giving identical output, exact sampling distribution."""

from __future__ import annotations

import pytest

from edge_spec.errors import EdgeSpecError
from edge_spec.runtime.engine import Engine
from edge_spec.runtime.loops.config import SsdConfig, TreeConfig, loop_config
from edge_spec.runtime.loops.ssd import predict_outcomes
from edge_spec.runtime.propose.base import DraftBlock
from edge_spec.runtime.verify.sampling import SamplingParams
from tests.helpers import PROMPTS, chi_square_same_distribution, run


def test_predict_outcomes_excludes_the_draft_and_ranks_by_probability():
    block = DraftBlock(
        tokens=[5, 7],
        confidences=[0.8, 0.5],
        alternatives=[[(5, 0.8), (2, 0.1), (3, 0.05)], [(7, 0.5), (9, 0.3), (1, 0.1)]],
    )
    outcomes = predict_outcomes(block, bonus=[(4, 0.6), (6, 0.2)], fan_out=2)
    keys = [o for _, o in outcomes]
    assert (0, 5) not in keys and (1, 7) not in keys  # a rejected draft is never the correction
    assert len(keys) == len(set(keys)) == 6  # fan_out = 2 corrections per draft position, 2 bonus tokens
    probs = dict((o, p) for p, o in outcomes)
    # P(stop at draft j with correction c) = P(drafts before j accepted) * P(draft j rejected) * q(c | not draft j)
    assert probs == pytest.approx(
        {
            (0, 2): 0.2 * 0.1 / 0.2,
            (0, 3): 0.2 * 0.05 / 0.2,  # draft 5 rejected (1 - 0.8)
            (1, 9): 0.8 * 0.5 * 0.3 / 0.5,
            (1, 1): 0.8 * 0.5 * 0.1 / 0.5,  # 5 accepted, 7 rejected
            (2, 4): 0.8 * 0.5 * 0.6,
            (2, 6): 0.8 * 0.5 * 0.2,  # both accepted: the bonus token
        }
    )
    assert [p for p, _ in outcomes] == sorted((p for p, _ in outcomes), reverse=True)


@pytest.fixture(scope="module", params=[(1, 1), (2, 1), (1, 2)], ids=["1+1", "2+1", "1+2"])
def split_engine(request, int4_bundle):
    threads, draft_threads = request.param
    return Engine.from_bundle(
        int4_bundle, threads=threads, draft_threads=draft_threads, mode="ssd", draft_head="trim-160"
    )


@pytest.mark.parametrize("gamma", [1, 2, 4])
@pytest.mark.parametrize("speculations", [-1, 0, 50])
def test_greedy_ssd_equals_autoregressive(split_engine, gamma, speculations):
    engine = split_engine
    hits = misses = 0
    for prompt in PROMPTS:
        ids = engine.bundle.tokenizer.encode(prompt)
        reference, _ = run(engine, ids, SamplingParams(), 40, None)
        got, stats = run(engine, ids, SamplingParams(), 40, SsdConfig(gamma=gamma, speculations=speculations))
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
        ids = engine.bundle.tokenizer.encode(prompt)
        miss, miss_stats = run(engine, ids, params, 32, SsdConfig(gamma=3, speculations=0), seed=seed)
        # a wide fan-out, so that the flat distributions of a random tiny model still give hits
        hit, hit_stats = run(engine, ids, params, 32, SsdConfig(gamma=3, speculations=200, fan_out=24), seed=seed)
        timed, _ = run(engine, ids, params, 32, SsdConfig(gamma=3), seed=seed)
        assert miss == hit == timed
        assert miss_stats.speculation_hits == 0
        hits += hit_stats.speculation_hits
    assert hits > 0


@pytest.mark.slow
def test_sampled_ssd_matches_target_distribution(int4_bundle):
    engine = Engine.from_bundle(int4_bundle, threads=1, draft_threads=1, mode="ssd", draft_head="trim-64")
    params = SamplingParams(temperature=1.0)
    ids = engine.bundle.tokenizer.encode("The quick")
    n = 1500
    ar = [tuple(run(engine, ids, params, 3, None, seed=s)[0]) for s in range(n)]
    ssd = [tuple(run(engine, ids, params, 3, SsdConfig(gamma=1, speculations=6), seed=10**6 + s)[0]) for s in range(n)]
    assert chi_square_same_distribution(ar, ssd) > 1e-3


def test_engine_ssd_mode_reports_hit_rate(int4_bundle):
    # forced hits (every predicted outcome prepared, a wide fan-out) and forced misses (none prepared): the
    # reported rate must follow; timed speculation would leave it to the machine's speed
    forced_hit = SsdConfig(gamma=2, speculations=200, fan_out=24)
    engine = Engine.from_bundle(int4_bundle, threads=1, draft_threads=1, config=forced_hit)
    n = 24
    ar = engine.complete("def is_prime", max_new_tokens=n, mode="ar")
    got = engine.complete("def is_prime", max_new_tokens=n)
    assert got.token_ids == ar.token_ids
    assert got.stats.stop_reason == "length"  # no eos: all n tokens were decoded
    spec = got.stats.spec
    assert spec.cache_hit_rate > 0
    # τ is tokens per target call: n - 1 tokens after the prefill's one, in target_calls verify passes
    assert spec.tau * spec.target_calls == pytest.approx(n - 1)
    engine.config = SsdConfig(gamma=2, speculations=0)
    missed = engine.complete("def is_prime", max_new_tokens=n)
    assert missed.token_ids == ar.token_ids and missed.stats.spec.cache_hit_rate == 0.0


def test_ssd_counts_every_head_it_runs_as_a_draft_step(int4_bundle):
    """Drafts prepared off the critical path run the head too: head time and draft steps must cover the
    same steps, or the bench's head ms per step is inflated (it counted critical-path steps only)."""
    engine = Engine.from_bundle(
        int4_bundle,
        threads=1,
        draft_threads=1,
        config=SsdConfig(gamma=2, speculations=200, fan_out=24),
        draft_head="trim-160",
    )
    head = engine.bundle.drafter.head
    calls = []
    run_head = head.session.run
    head.session.run = lambda *args, **kwargs: calls.append(1) or run_head(*args, **kwargs)
    done = engine.complete("def is_prime", max_new_tokens=24)
    spec = done.stats.spec
    assert spec.speculations_prepared > 0  # heads ran off the critical path
    assert spec.draft_steps == len(calls)


def test_ssd_refuses_multi_draft_in_one_line(int4_bundle):
    with pytest.raises(EdgeSpecError, match="^--drafts does not apply to --mode ssd"):
        loop_config("ssd", drafts=2)
    with pytest.raises(EdgeSpecError, match="does not match the TreeConfig"):
        Engine.from_bundle(int4_bundle, threads=1, mode="ssd", config=TreeConfig(gamma=2, drafts=2))


def test_engine_refuses_negative_thread_counts(int4_bundle):
    for threads, draft_threads in ((-1, None), (1, -2)):
        with pytest.raises(EdgeSpecError, match="threads must be 0"):
            Engine.from_bundle(int4_bundle, threads=threads, draft_threads=draft_threads, mode="ssd")


def test_speculation_near_the_end_of_the_context_stays_inside_it(int4_bundle):
    """Drafts prepared for the next round must fit the context too: a prompt that leaves a few tokens of
    room, forced speculation on every outcome, and the answer still runs to the context's end, equal to ar."""
    engine = Engine.from_bundle(
        int4_bundle, threads=1, draft_threads=1, config=SsdConfig(gamma=4, speculations=200, fan_out=24)
    )
    capacity = engine.bundle.target.capacity
    words = "def is_prime(n): return n > 1 and all(n % d for d in range(2, n))\n"
    prompt = words * 40
    while len(engine.prompt_ids(prompt, check_length=False)) > capacity - 12:
        prompt = prompt[:-8]
    ar = engine.complete(prompt, max_new_tokens=64, mode="ar", exact=True)
    got = engine.complete(prompt, max_new_tokens=64)
    assert got.token_ids == ar.token_ids
    assert got.stats.spec.speculations_prepared > 0
