"""Multi-draft verifiers (RRS with/without replacement, SpecHub): exact enumeration and Monte Carlo.

The exact tests enumerate every draft tuple with its probability under the draft scheme (computed
here from first principles, not by the code under test) and sum the verifier's exact output
distribution over them: the result must equal p to 1e-9.  Negative controls pair a verifier with
the wrong draft scheme and check that the same harness catches it.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from edge_spec.runtime.verify.tree import (
    Ladder,
    draw_first_tokens,
    ladder_for,
    rrs_ladder,
    spechub_ladder,
    spechub_pair,
)
from tests.helpers import chi_square_pvalue


def random_pair(seed: int, vocab: int = 5, sharp: float = 1.0, zeros: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(p, q) over a small vocabulary; ``sharp`` > 1 concentrates q on its top token, ``zeros``
    zeroes that many entries of each (as top-k/top-p truncation and trimmed heads do)."""
    rng = np.random.default_rng(seed)
    p = rng.dirichlet(np.ones(vocab))
    q = rng.dirichlet(np.ones(vocab)) ** sharp
    for dist in (p, q):
        dist[rng.choice(vocab, zeros, replace=False)] = 0.0
    return p / p.sum(), q / q.sum()


def iid_tuples(q: np.ndarray, k: int):
    for tup in itertools.product(range(len(q)), repeat=k):
        yield list(tup), float(np.prod(q[list(tup)]))


def without_replacement_tuples(q: np.ndarray, k: int):
    support = [i for i in range(len(q)) if q[i] > 0]
    for tup in itertools.permutations(support, min(k, len(support))):
        prob, used = 1.0, []
        for token in tup:
            prob *= q[token] / np.delete(q, used).sum()
            used.append(token)
        yield list(tup), prob


def spechub_tuples(q: np.ndarray):
    hub = int(np.argmax(q))
    for i in range(len(q)):
        if i != hub and q[i] > 0:
            yield [i, hub], q[i]
            yield [hub, i], q[hub] * q[i] / (1.0 - q[hub])


def emitted_distribution(tuples, scheme: str, q: np.ndarray, p: np.ndarray) -> np.ndarray:
    total = np.zeros(len(p))
    mass = 0.0
    for drafts, prob in tuples:
        if prob > 0:
            total += prob * ladder_for(scheme, drafts, q, p).distribution()
            mass += prob
    assert mass == pytest.approx(1.0, abs=1e-12)
    return total


CASES = [
    dict(seed=s, vocab=v, sharp=sh, zeros=z)
    for s, v, sh, z in [(0, 4, 1.0, 0), (1, 5, 3.0, 0), (2, 5, 0.3, 0), (3, 6, 2.0, 2), (4, 3, 8.0, 0), (5, 6, 1.0, 1)]
]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("k", [1, 2, 3])
def test_rrs_with_replacement_is_exact(case: dict, k: int) -> None:
    p, q = random_pair(**case)
    np.testing.assert_allclose(emitted_distribution(iid_tuples(q, k), "rrs", q, p), p, atol=1e-9)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_rrs_without_replacement_is_exact(case: dict, k: int) -> None:
    p, q = random_pair(**case)
    np.testing.assert_allclose(emitted_distribution(without_replacement_tuples(q, k), "rrs-wor", q, p), p, atol=1e-9)


@pytest.mark.parametrize("case", CASES)
def test_spechub_is_exact(case: dict) -> None:
    p, q = random_pair(**case)
    np.testing.assert_allclose(emitted_distribution(spechub_tuples(q), "spechub", q, p), p, atol=1e-9)


def test_spechub_with_a_certain_hub_is_a_single_draft() -> None:
    q = np.array([0.0, 1.0, 0.0])
    p = np.array([0.2, 0.5, 0.3])
    assert spechub_pair(q, np.random.default_rng(0)) == [1]
    np.testing.assert_allclose(spechub_ladder([1], q, p).distribution(), p, atol=1e-12)


@pytest.mark.parametrize("wrong", ["rrs-wor", "spechub"])
def test_wrong_draft_scheme_is_detected(wrong: str) -> None:
    """Negative control: i.i.d. drafts verified as if drawn another way do not give p."""
    p, q = random_pair(seed=1, vocab=5, sharp=3.0)
    tuples = [(d, w) for d, w in iid_tuples(q, 2) if wrong != "spechub" or (int(np.argmax(q)) in d and d[0] != d[1])]
    scale = sum(w for _, w in tuples)
    tuples = [(d, w / scale) for d, w in tuples]
    out = emitted_distribution(tuples, wrong, q, p)
    assert np.abs(out - p).max() > 1e-3


def test_rrs_as_without_replacement_is_detected() -> None:
    p, q = random_pair(seed=2, vocab=5, sharp=0.3)
    out = emitted_distribution(without_replacement_tuples(q, 2), "rrs", q, p)
    assert np.abs(out - p).max() > 1e-3


def first_token_acceptance(tuples, scheme: str, q: np.ndarray, p: np.ndarray) -> float:
    """Probability that the node emits one of the drafts (not a residual sample)."""
    accepted = 0.0
    for drafts, prob in tuples:
        ladder = ladder_for(scheme, drafts, q, p)
        reach = 1.0
        for _, probability in ladder.tests:
            accepted += prob * reach * probability
            reach *= 1.0 - probability
    return accepted


def test_spechub_accepts_more_than_rrs_when_the_drafter_is_peaked() -> None:
    """SpecHub's gain (METHODS.md): per-node acceptance p(a) + Σ min(p(i), q(i)/(1 - q(a))), above
    both RRS variants when q's top token carries much mass."""
    rates = {"rrs": [], "rrs-wor": [], "spechub": []}
    for seed in range(20):
        p, q = random_pair(seed=seed, vocab=6, sharp=3.0)
        rates["rrs"].append(first_token_acceptance(iid_tuples(q, 2), "rrs", q, p))
        rates["rrs-wor"].append(first_token_acceptance(without_replacement_tuples(q, 2), "rrs-wor", q, p))
        rates["spechub"].append(first_token_acceptance(spechub_tuples(q), "spechub", q, p))
        hub = int(np.argmax(q))
        others = [i for i in range(6) if i != hub]
        bound = p[hub] + sum(min(p[i], q[i] / (1 - q[hub])) for i in others)
        assert rates["spechub"][-1] <= bound + 1e-12
    mean = {k: float(np.mean(v)) for k, v in rates.items()}
    assert mean["spechub"] > mean["rrs-wor"] > mean["rrs"]


@pytest.mark.slow
@pytest.mark.parametrize("scheme,k", [("rrs", 2), ("rrs-wor", 3), ("spechub", 2)])
def test_sampled_ladder_matches_its_distribution(scheme: str, k: int) -> None:
    """Monte Carlo through draw_first_tokens + Ladder.sample, the path the runtime takes."""
    p, q = random_pair(seed=7, vocab=5, sharp=2.0)
    rng = np.random.default_rng(123)
    counts = np.zeros(5)
    for _ in range(20_000):
        drafts = draw_first_tokens(q, k, scheme, rng)
        token, _ = ladder_for(scheme, drafts, q, p).sample(rng)
        counts[token] += 1
    assert chi_square_pvalue(counts, p) > 1e-3


@pytest.mark.slow
def test_sampled_harness_rejects_plain_q() -> None:
    """Negative control for the Monte Carlo harness: emitting the first draft as is follows q, not p."""
    p, q = random_pair(seed=7, vocab=5, sharp=2.0)
    rng = np.random.default_rng(123)
    counts = np.zeros(5)
    for _ in range(20_000):
        counts[draw_first_tokens(q, 2, "spechub", rng)[0]] += 1
    assert chi_square_pvalue(counts, p) < 1e-6


@pytest.mark.slow
def test_spechub_pairs_follow_the_sparse_joint() -> None:
    p, q = random_pair(seed=3, vocab=4, sharp=2.0)
    rng = np.random.default_rng(5)
    joint = dict((tuple(d), w) for d, w in spechub_tuples(q))
    keys = sorted(joint)
    counts = dict.fromkeys(keys, 0)
    for _ in range(20_000):
        counts[tuple(spechub_pair(q, rng))] += 1
    assert chi_square_pvalue(np.array([counts[k] for k in keys]), np.array([joint[k] for k in keys])) > 1e-3


def test_bad_inputs_raise() -> None:
    q = np.array([0.5, 0.3, 0.2])
    with pytest.raises(ValueError, match="unknown multi-draft verifier"):
        draw_first_tokens(q, 2, "beam", np.random.default_rng(0))
    with pytest.raises(ValueError, match="exactly two"):
        draw_first_tokens(q, 3, "spechub", np.random.default_rng(0))
    with pytest.raises(ValueError, match="hub"):
        spechub_ladder([1, 2], q, q)


def test_ladder_distribution_sums_to_one() -> None:
    ladder = Ladder([(0, 0.3), (2, 0.5)], np.array([0.1, 0.6, 0.3]))
    out = ladder.distribution()
    assert out.sum() == pytest.approx(1.0)
    assert out[0] == pytest.approx(0.3 + 0.7 * 0.5 * 0.1)


def test_without_replacement_stops_when_q_is_exhausted() -> None:
    q = np.array([0.0, 1.0, 0.0])
    assert draw_first_tokens(q, 3, "rrs-wor", np.random.default_rng(0)) == [1]
    assert len(rrs_ladder([1], q, np.array([0.3, 0.3, 0.4]), without_replacement=True).tests) == 1


@pytest.mark.parametrize("case", CASES + [dict(seed=9, vocab=7, sharp=0.2, zeros=3)])
def test_expected_acceptance_matches_enumeration(case: dict) -> None:
    from edge_spec.runtime.verify.tree import expected_acceptance

    p, q = random_pair(**case)
    assert expected_acceptance("single", q, p) == pytest.approx(np.minimum(p, q).sum(), abs=1e-12)
    for scheme, tuples in (
        ("rrs", iid_tuples(q, 2)),
        ("rrs-wor", without_replacement_tuples(q, 2)),
        ("spechub", spechub_tuples(q)),
    ):
        exact = first_token_acceptance(tuples, scheme, q, p)
        assert expected_acceptance(scheme, q, p) == pytest.approx(exact, abs=1e-9), scheme
