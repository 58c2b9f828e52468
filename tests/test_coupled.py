"""Coupled sampling: each token fixed by (seed, position), distributed as the target's, equal in every mode."""

from __future__ import annotations

import numpy as np
import pytest

from edge_spec.errors import EdgeSpecError
from edge_spec.runtime.engine import Engine
from edge_spec.runtime.loops.config import SsdConfig, TreeConfig
from edge_spec.runtime.propose.model import ChainDrafter
from edge_spec.runtime.verify.chain import verify_chain
from edge_spec.runtime.verify.coupled import coupled_index, position_noise, verify_coupled
from edge_spec.runtime.verify.sampling import SamplingParams, logits_to_probs
from tests.helpers import PROMPTS, chain, chi_square_pvalue, run

COUPLED = SamplingParams(temperature=0.8, sampler="coupled", seed=11)


def _race_counts(probs: np.ndarray, draws: int, noise_of) -> np.ndarray:
    counts = np.zeros(probs.size)
    for position in range(draws):
        counts[int(np.argmax(probs / noise_of(position)))] += 1
    return counts


def test_race_follows_the_distribution_and_a_wrong_noise_does_not():
    probs = np.array([0.5, 0.25, 0.15, 0.07, 0.03])
    counts = _race_counts(probs, 4000, lambda t: position_noise(3, t, probs.size))
    assert chi_square_pvalue(counts, probs) > 1e-3
    # negative control: uniform instead of exponential noise is a race that favours the likely tokens
    rng = np.random.default_rng(3)
    biased = _race_counts(probs, 4000, lambda t: rng.random(probs.size))
    assert chi_square_pvalue(biased, probs) < 1e-6


def test_noise_is_fixed_by_seed_and_position():
    a = position_noise(5, 17, 1000)
    assert np.array_equal(a, np.random.default_rng([5, 17]).standard_exponential(1000))
    assert not np.array_equal(a, position_noise(5, 18, 1000))
    assert not np.array_equal(a, position_noise(6, 17, 1000))
    with pytest.raises(ValueError):
        a[0] = 1.0  # shared between the drafter and the verifier: nobody may change it


def test_reduced_head_races_on_its_rows_with_the_targets_noise():
    vocab, ids = 50, np.array([3, 9, 20, 41])
    sub = np.array([0.4, 0.3, 0.2, 0.1])
    full = np.zeros(vocab)
    full[ids] = sub
    for position in range(200):
        row = coupled_index(sub, 1, position, vocab, ids)
        assert ids[row] == coupled_index(full, 1, position, vocab)


def test_verify_coupled_accepts_exactly_the_targets_choices():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(4, 30)).astype(np.float32) * 2
    position = 40
    choices = [
        coupled_index(logits_to_probs(row, COUPLED), COUPLED.seed, position + i, 30) for i, row in enumerate(logits)
    ]
    assert verify_coupled(choices[:3], logits, COUPLED, position) == (3, choices)
    wrong = (choices[1] + 1) % 30
    assert verify_coupled([choices[0], wrong, 0], logits, COUPLED, position) == (1, [choices[0], choices[1]])
    result = verify_chain(choices[:3], [], logits, COUPLED, rng, position)  # no q rows needed
    assert (result.accepted, result.tokens) == (3, choices)


def test_unseeded_coupled_request_draws_a_seed_and_bad_sampler_is_refused():
    assert SamplingParams(temperature=0.7, sampler="coupled").seed is not None
    assert SamplingParams(temperature=0.7).seed is None
    assert SamplingParams(sampler="coupled").regime == "greedy"  # temperature 0: argmax, nothing to couple
    with pytest.raises(EdgeSpecError, match="sampler must be one of"):
        SamplingParams(temperature=0.7, sampler="gumbel")


@pytest.fixture(scope="module")
def engine(int4_bundle):
    return Engine.from_bundle(int4_bundle, threads=1, mode="spec", draft_head="trim-64")


@pytest.mark.parametrize(
    "config",
    [chain(1), chain(3), chain(6, adaptive=True, lookup=True), SsdConfig(gamma=2)],
    ids=["γ1", "γ3", "adaptive+lookup", "ssd"],
)
def test_coupled_speculative_answer_equals_coupled_target_only(engine, config):
    engine.bundle.target.min_rows = engine.bundle.pass_rows("spec")  # the exact passes generate runs coupled spec with
    rejected = 0
    for seed, prompt in enumerate(PROMPTS):
        params = SamplingParams(temperature=0.8, sampler="coupled", seed=seed)
        ids = engine.bundle.tokenizer.encode(prompt)
        reference, _ = run(engine, ids, params, 40, None)
        got, stats = run(engine, ids, params, 40, config, seed=1000 + seed)  # another rng: unused
        assert got == reference, (config, prompt)
        rejected += sum(d - a for d, a in zip(stats.drafted, stats.accepted))
    assert rejected > 0, "every draft passed: rejection was not exercised"


def test_rejection_sampling_is_not_coupled(engine):
    """Negative control: the same seed through rejection sampling parts from the coupled answer."""
    engine.bundle.target.min_rows = engine.bundle.pass_rows("spec")
    parted = 0
    for seed, prompt in enumerate(PROMPTS):
        ids = engine.bundle.tokenizer.encode(prompt)
        coupled, _ = run(engine, ids, SamplingParams(temperature=0.8, sampler="coupled", seed=seed), 40, None)
        plain, _ = run(engine, ids, SamplingParams(temperature=0.8, seed=seed), 40, chain(3), seed=seed)
        parted += coupled != plain
    assert parted > 0


def test_engine_gives_the_same_coupled_answer_in_every_mode_and_another_for_another_seed(int4_bundle):
    engine = Engine.from_bundle(int4_bundle, threads=1, config=chain(4, adaptive=True, lookup=True))
    ask = dict(max_new_tokens=30, temperature=0.9, sampler="coupled")
    messages = [{"role": "user", "content": "The quick brown fox"}]
    answers = {mode: engine.complete(messages, seed=4, mode=mode, **ask).token_ids for mode in ("spec", "ar", "ssd")}
    assert answers["spec"] == answers["ar"] == answers["ssd"]
    assert engine.complete(messages, seed=5, mode="ar", **ask).token_ids != answers["ar"]


def test_multi_draft_tree_refuses_coupled_sampling_in_one_line(int4_bundle):
    engine = Engine.from_bundle(int4_bundle, threads=1, config=TreeConfig(gamma=2, drafts=2))
    with pytest.raises(EdgeSpecError, match="--sampler coupled applies to"):
        engine.complete("The quick", max_new_tokens=5, temperature=0.8, sampler="coupled")


class _FixedDrafter(ChainDrafter):
    """A drafter whose head gives the same logits at every step (what ChainDrafter.propose draws from)."""

    name = "fixed"

    def __init__(self, logits: np.ndarray) -> None:
        super().__init__(logits.size)
        self.logits = logits

    def start(self, committed):
        return self.logits, None, 1

    def step(self, token):
        return self.logits, None


def test_drafter_races_with_the_noise_of_the_position_it_drafts():
    """Draft i after a prefix of L tokens is the race at sequence index L + i: a drafter that agrees with
    the target then drafts exactly the target's coupled tokens."""
    from edge_spec.runtime.propose.base import DraftRule

    logits = np.random.default_rng(2).normal(size=64).astype(np.float32)
    drafter = _FixedDrafter(logits)
    committed = list(range(9))
    block = drafter.propose(committed, 5, DraftRule(COUPLED, np.random.default_rng(0), 5))
    probs = logits_to_probs(logits, COUPLED)
    assert block.tokens == [coupled_index(probs, COUPLED.seed, len(committed) + i, 64) for i in range(5)]
    assert block.q_rows == []  # matching needs no q


def test_unlikely_tokens_win_the_race_as_rarely_as_their_probability():
    """Over a real-sized vocabulary almost all mass sits on 3 tokens; the other 150k (1e-6 together) must
    win at about that rate.  Noise that can be exactly 0 (numpy's float32 exponentials) lets one of
    them win at about 1% of positions."""
    vocab = 151936
    probs = np.full(vocab, 1e-6 / (vocab - 3))
    probs[[5, 77, 901]] = (1 - 1e-6) / 3
    outside = sum(coupled_index(probs, 8, position, vocab) not in (5, 77, 901) for position in range(1500))
    assert outside <= 1
    with np.errstate(divide="ignore"):
        zero_prone = sum(
            int(np.argmax(probs / np.random.default_rng([8, t]).standard_exponential(vocab, dtype=np.float32)))
            not in (5, 77, 901)
            for t in range(1500)
        )
    assert zero_prone >= 3  # the negative control: the flaw this guards against is real


@pytest.mark.slow
def test_coupled_speculative_answers_follow_the_targets_joint_law(engine):
    """Across seeds, the first three tokens of coupled speculative decoding (drafts verified by matching) have
    the joint law of target-only sampling (a temperature of 0.85 instead of 1 fails it at p ~ 1e-15); a coupled
    sampler that reused one seed for every answer would give a single answer (the negative control: the law
    needs fresh noise per request)."""
    from tests.helpers import chi_square_same_distribution, first_tokens

    engine.bundle.target.min_rows = engine.bundle.pass_rows("spec")
    ids = engine.bundle.tokenizer.encode("The quick")
    target = first_tokens(engine, ids, SamplingParams(temperature=1.0), None, 1500)
    coupled = [
        tuple(run(engine, ids, SamplingParams(temperature=1.0, sampler="coupled", seed=seed), 3, chain(2))[0])
        for seed in range(10**6, 10**6 + 1500)
    ]
    assert chi_square_same_distribution(target, coupled) > 1e-3
    same_seed = [
        tuple(run(engine, ids, SamplingParams(temperature=1.0, sampler="coupled", seed=7), 3, chain(2))[0])
        for _ in range(20)
    ]
    assert len(set(same_seed)) == 1 and len(set(coupled)) > 20


def test_an_unseeded_coupled_answer_reports_the_seed_that_remakes_it(int4_bundle):
    engine = Engine.from_bundle(int4_bundle, threads=1, config=chain(3, adaptive=True))
    first = engine.complete("The quick brown fox", max_new_tokens=20, temperature=0.9, sampler="coupled")
    seed = first.stats.coupled_seed
    assert seed is not None
    again = engine.complete(
        "The quick brown fox", max_new_tokens=20, temperature=0.9, sampler="coupled", seed=seed, mode="ar"
    )
    assert again.token_ids == first.token_ids and again.stats.coupled_seed == seed
    plain = engine.complete("The quick brown fox", max_new_tokens=20, temperature=0.9)
    assert plain.stats.coupled_seed is None  # rejection sampling has no such seed
