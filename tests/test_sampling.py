"""Tests for edge_spec.runtime.verify.sampling: pure numpy, no models, fast.

The chi-square helpers they use live in ``tests/helpers.py``, shared with the verification tests.
"""

from __future__ import annotations

import numpy as np
import pytest

from edge_spec.errors import EdgeSpecError
from edge_spec.runtime.verify.sampling import (
    SamplingParams,
    check_vocab_ids,
    logits_to_probs,
    sample,
    scatter_probs,
)
from tests.helpers import FixedUniform, chi2_sf, chi_square_pvalue


def test_chi2_sf_matches_scipy() -> None:
    from scipy import special  # scipy is in the test extra: missing, this fails rather than skips

    for dof in (1, 2, 3, 4, 7, 19, 24):
        for stat in (0.5, 3.0, 10.0, 40.0, 120.0, 400.0):
            assert chi2_sf(stat, dof) == pytest.approx(special.chdtrc(dof, stat), rel=1e-9, abs=1e-300)


# ---------------------------------------------------------------------------
# SamplingParams
# ---------------------------------------------------------------------------


def test_params_defaults_are_greedy() -> None:
    params = SamplingParams()
    assert params.greedy
    assert not SamplingParams(temperature=0.7).greedy


@pytest.mark.parametrize(
    "kwargs, word",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": -0.5}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"top_p": float("nan")}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"top_k": True}, "top_k"),
        ({"seed": -3}, "seed"),
    ],
)
def test_params_validation_is_one_clear_line(kwargs: dict, word: str) -> None:
    with pytest.raises(EdgeSpecError) as info:
        SamplingParams(**kwargs)
    message = str(info.value)
    assert word in message and "\n" not in message


def test_params_accept_boundaries_and_numpy_scalars() -> None:
    SamplingParams(temperature=0.0, top_p=1.0, top_k=0)
    SamplingParams(temperature=np.float32(0.5), top_k=np.int64(5), top_p=1e-9, seed=0)


# ---------------------------------------------------------------------------
# logits_to_probs
# ---------------------------------------------------------------------------


def softmax(x: np.ndarray) -> np.ndarray:
    z = np.asarray(x, dtype=np.float64)
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def random_logits(shape: tuple[int, ...], seed: int = 0, scale: float = 3.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


@pytest.mark.parametrize("temperature", [0.3, 1.0, 2.5])
def test_temperature_matches_softmax_of_scaled_logits(temperature: float) -> None:
    logits = random_logits((4, 1000))
    probs = logits_to_probs(logits, SamplingParams(temperature=temperature))
    assert probs.dtype == np.float64 and probs.shape == logits.shape
    np.testing.assert_allclose(probs, softmax(logits.astype(np.float64) / temperature), rtol=1e-5, atol=1e-14)
    np.testing.assert_allclose(probs.sum(axis=-1), 1.0, rtol=0, atol=1e-12)


def test_one_dimensional_input_gives_one_dimensional_output() -> None:
    logits = random_logits((50,))
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0))
    assert probs.shape == (50,)
    np.testing.assert_allclose(probs, softmax(logits), rtol=1e-5)


def test_float64_logits_keep_float64_precision() -> None:
    logits = np.random.default_rng(1).standard_normal(200) * 4
    probs = logits_to_probs(logits, SamplingParams(temperature=0.7))
    np.testing.assert_allclose(probs, softmax(logits / 0.7), rtol=1e-12)


def test_numerically_stable_for_huge_logits_and_tiny_temperature() -> None:
    logits = np.array([1e30, 1e30 - 1e24, -1e30, 3.0e38], dtype=np.float32)
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0))
    assert np.all(np.isfinite(probs)) and probs[3] == 1.0
    probs = logits_to_probs(np.array([1.0, 2.0, 2.0 - 1e-6], dtype=np.float64), SamplingParams(temperature=1e-300))
    assert np.all(np.isfinite(probs)) and probs[1] == 1.0


def test_minus_infinity_logits_get_zero_probability() -> None:
    logits = np.array([0.0, -np.inf, 1.0, -np.inf], dtype=np.float32)
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=3))
    assert probs[1] == 0.0 and probs[3] == 0.0
    np.testing.assert_allclose(probs[[0, 2]], softmax(np.array([0.0, 1.0])), rtol=1e-6)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_logits_are_rejected(bad: float) -> None:
    logits = np.array([[0.0, 1.0], [bad, 1.0]], dtype=np.float32)
    with pytest.raises(ValueError, match="finite"):
        logits_to_probs(logits, SamplingParams(temperature=1.0))


def test_all_minus_infinity_row_is_rejected() -> None:
    with pytest.raises(ValueError, match="finite"):
        logits_to_probs(np.full(4, -np.inf, dtype=np.float32), SamplingParams(temperature=1.0))


@pytest.mark.parametrize("shape", [(), (2, 3, 4), (0,)])
def test_bad_shapes_are_rejected(shape: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match="shape"):
        logits_to_probs(np.zeros(shape, dtype=np.float32), SamplingParams(temperature=1.0))


def test_greedy_gives_one_hot_at_first_maximum() -> None:
    logits = np.array([[1.0, 3.0, 3.0, 2.0], [5.0, 0.0, 5.0, 5.0]], dtype=np.float32)
    probs = logits_to_probs(logits, SamplingParams(temperature=0.0, top_k=2, top_p=0.5))
    np.testing.assert_array_equal(probs, [[0, 1, 0, 0], [1, 0, 0, 0]])


@pytest.mark.parametrize("k", [1, 2, 10, 999])
def test_top_k_keeps_exactly_the_k_largest(k: int) -> None:
    logits = random_logits((3, 1000), seed=k)  # continuous: no ties
    probs = logits_to_probs(logits, SamplingParams(temperature=0.8, top_k=k))
    for row_logits, row in zip(logits, probs):
        kept = np.flatnonzero(row)
        expected = np.sort(np.argsort(row_logits)[::-1][:k])
        np.testing.assert_array_equal(kept, expected)
        np.testing.assert_allclose(row[kept], softmax(row_logits[kept].astype(np.float64) / 0.8), rtol=1e-5)


def test_top_k_not_smaller_than_vocab_is_a_no_op() -> None:
    logits = random_logits((2, 30))
    base = logits_to_probs(logits, SamplingParams(temperature=1.0))
    for k in (30, 31, 10_000):
        np.testing.assert_array_equal(logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=k)), base)


def test_top_k_keeps_all_ties_with_the_kth_value() -> None:
    logits = np.array([4.0, 1.0, 3.0, 3.0, 0.0, 3.0], dtype=np.float32)
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    np.testing.assert_array_equal(np.flatnonzero(probs), [0, 2, 3, 5])
    assert probs[2] == probs[3] == probs[5]


def nucleus_reference(probs: np.ndarray, top_p: float) -> np.ndarray:
    """Brute force: full sort, keep the shortest prefix with mass >= top_p."""
    order = np.argsort(probs, kind="stable")[::-1]
    cumulative = np.cumsum(probs[order])
    n = min(int(np.searchsorted(cumulative, top_p, side="left")) + 1, probs.size)
    return np.sort(order[:n])


def test_top_p_explicit_small_example() -> None:
    logits = np.log(np.array([0.05, 0.5, 0.15, 0.3]))
    for top_p, kept in [(0.4, [1]), (0.5 - 1e-9, [1]), (0.75, [1, 3]), (0.81, [1, 2, 3]), (0.96, [0, 1, 2, 3])]:
        probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=top_p))
        np.testing.assert_array_equal(np.flatnonzero(probs), kept)
        assert probs.sum() == pytest.approx(1.0, abs=1e-12)
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=0.75))
    np.testing.assert_allclose(probs[[1, 3]], [0.5 / 0.8, 0.3 / 0.8], rtol=1e-12)


def test_top_p_always_keeps_at_least_one_token() -> None:
    logits = random_logits((5, 100))
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=1e-9))
    np.testing.assert_array_equal(np.count_nonzero(probs, axis=-1), 1)
    np.testing.assert_array_equal(np.argmax(probs, axis=-1), np.argmax(logits, axis=-1))


@pytest.mark.parametrize(
    "vocab, scale, temperature, top_p",
    [
        (50, 3.0, 1.0, 0.9),
        (5000, 3.0, 0.8, 0.5),
        (5000, 3.0, 0.8, 0.95),  # nucleus far beyond the first window: window growth
        (5000, 0.01, 1.0, 0.999),  # almost flat: nucleus is nearly the whole vocabulary
        (151936, 3.0, 1.0, 0.9),
    ],
)
def test_top_p_keeps_the_minimal_nucleus(vocab: int, scale: float, temperature: float, top_p: float) -> None:
    logits = random_logits((2, vocab), seed=vocab, scale=scale)
    probs = logits_to_probs(logits, SamplingParams(temperature=temperature, top_p=top_p))
    unfiltered = logits_to_probs(logits, SamplingParams(temperature=temperature))
    for row, full in zip(probs, unfiltered):
        kept = np.flatnonzero(row)
        np.testing.assert_array_equal(kept, nucleus_reference(full, top_p))
        assert full[kept].sum() >= top_p - 1e-12
        assert full[kept].sum() - full[kept].min() < top_p  # dropping any kept token breaks it
        np.testing.assert_allclose(row[kept], full[kept] / full[kept].sum(), rtol=1e-9)


def test_top_k_then_top_p_applies_nucleus_to_the_renormalised_top_k() -> None:
    logits = random_logits((3, 2000), seed=7)
    params = SamplingParams(temperature=0.9, top_k=40, top_p=0.8)
    probs = logits_to_probs(logits, params)
    top_k_only = logits_to_probs(logits, SamplingParams(temperature=0.9, top_k=40))
    for row, after_k in zip(probs, top_k_only):
        np.testing.assert_array_equal(np.flatnonzero(row), nucleus_reference(after_k, 0.8))
        assert 1 <= np.count_nonzero(row) <= 40


def test_top_p_keeps_ties_with_the_boundary_token() -> None:
    logits = np.log(np.array([0.4, 0.2, 0.2, 0.2]))
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=0.5))
    np.testing.assert_array_equal(np.flatnonzero(probs), [0, 1, 2, 3])


def test_rows_are_processed_independently() -> None:
    logits = random_logits((4, 300), seed=3)
    params = SamplingParams(temperature=0.7, top_k=50, top_p=0.9)
    batched = logits_to_probs(logits, params)
    for row_logits, row in zip(logits, batched):
        np.testing.assert_array_equal(logits_to_probs(row_logits, params), row)


def test_input_logits_are_not_modified() -> None:
    logits = random_logits((2, 100))
    before = logits.copy()
    logits_to_probs(logits, SamplingParams(temperature=0.5, top_k=10, top_p=0.9))
    logits_to_probs(logits, SamplingParams(temperature=0.5, top_p=0.9))
    np.testing.assert_array_equal(logits, before)


# ---------------------------------------------------------------------------
# sample
# ---------------------------------------------------------------------------


def test_sample_extreme_uniforms_never_pick_zero_probability_tokens() -> None:
    probs = np.array([0.0, 0.3, 0.0, 0.7, 0.0])
    below_one = float(np.nextafter(1.0, 0.0))
    assert sample(probs, FixedUniform(0.0)) == 1
    assert sample(probs, FixedUniform(below_one)) == 3
    assert sample(probs, FixedUniform(0.3)) == 3
    assert sample(probs, FixedUniform(0.3 - 1e-12)) == 1


def test_sample_is_robust_to_rows_not_summing_to_one() -> None:
    probs = np.array([0.0, 2.0, 0.0, 2.0, 0.0]) * (1 + 1e-9)
    assert sample(probs, FixedUniform(0.49)) == 1
    assert sample(probs, FixedUniform(0.51)) == 3
    assert sample(probs, FixedUniform(float(np.nextafter(1.0, 0.0)))) == 3


def test_sample_uses_exactly_one_uniform() -> None:
    rng, reference = np.random.default_rng(5), np.random.default_rng(5)
    sample(np.full(10_000, 1e-4), rng)
    reference.random()
    assert rng.random() == reference.random()


@pytest.mark.parametrize("bad", [np.zeros(4), np.array([0.5, np.nan]), np.zeros((2, 2)), np.zeros(0)])
def test_sample_rejects_unusable_rows(bad: np.ndarray) -> None:
    with pytest.raises(ValueError):
        sample(bad, np.random.default_rng(0))


@pytest.mark.slow
def test_sample_frequencies_follow_the_distribution() -> None:
    probs = np.array([0.1, 0.0, 0.25, 0.05, 0.6])
    rng = np.random.default_rng(11)
    draws = [sample(probs, rng) for _ in range(20_000)]
    counts = np.bincount(draws, minlength=probs.size)
    assert chi_square_pvalue(counts, probs) > 1e-3


def sparse_large_row(vocab: int = 151936) -> np.ndarray:
    """Mass on block edges, inside blocks and at the end of the row."""
    probs = np.zeros(vocab)
    ids = [0, 1023, 1024, 2047, 5000, 77_777, vocab - 1025, vocab - 1]
    probs[ids] = [0.05, 0.1, 0.2, 0.05, 0.15, 0.25, 0.1, 0.1]
    return probs


def test_large_row_sampling_matches_a_full_inverse_cdf() -> None:
    """The two-level path must return exactly what one big cumsum would."""
    rng = np.random.default_rng(2)
    for probs in (sparse_large_row(), rng.dirichlet(np.full(151936, 0.05)), rng.dirichlet(np.ones(9000))):
        cdf = np.cumsum(probs)
        for u in np.linspace(0.0, 1.0, 400, endpoint=False)[1:]:
            position = u * cdf[-1]
            if np.min(np.abs(cdf - position)) < 1e-9:
                continue  # on a CDF boundary: summation order may decide either way
            expected = int(np.searchsorted(cdf, position, side="right"))
            assert sample(probs, FixedUniform(float(u))) == expected


def test_large_row_extreme_uniforms_land_on_tokens_with_mass() -> None:
    probs = sparse_large_row()
    assert sample(probs, FixedUniform(0.0)) == 0
    assert sample(probs, FixedUniform(float(np.nextafter(1.0, 0.0)))) == probs.size - 1
    probs[-1] = 0.0
    assert sample(probs, FixedUniform(float(np.nextafter(1.0, 0.0)))) == probs.size - 1025


# ---------------------------------------------------------------------------
# reduced-vocabulary drafters
# ---------------------------------------------------------------------------


def test_scatter_probs_places_mass_at_the_mapped_ids() -> None:
    sub = np.array([0.5, 0.3, 0.2])
    full = scatter_probs(sub, np.array([7, 2, 4]), 10)
    assert full.shape == (10,) and full.dtype == np.float64
    np.testing.assert_array_equal(full, [0, 0, 0.3, 0, 0.2, 0, 0, 0.5, 0, 0])


def test_scatter_probs_rows() -> None:
    sub = np.array([[0.5, 0.5], [0.9, 0.1]])
    full = scatter_probs(sub, [3, 0], 4, validate=False)
    np.testing.assert_array_equal(full, [[0.5, 0, 0, 0.5], [0.1, 0, 0, 0.9]])


def test_scattered_drafter_distribution_samples_only_mapped_ids() -> None:
    ids = np.array([5, 9, 1000])
    params = SamplingParams(temperature=1.0)
    q = scatter_probs(logits_to_probs(np.array([0.0, 1.0, 2.0], dtype=np.float32), params), ids, 151936)
    rng = np.random.default_rng(0)
    assert {sample(q, rng) for _ in range(200)} == {5, 9, 1000}


@pytest.mark.parametrize(
    "ids, match",
    [([1, 1, 2], "duplicate"), ([0, 10], "outside"), ([-1, 2], "outside"), ([[1, 2]], "1-D"), ([0.5, 1.0], "integer")],
)
def test_bad_vocabulary_maps_are_user_errors(ids: list, match: str) -> None:
    with pytest.raises(EdgeSpecError, match=match):
        check_vocab_ids(np.array(ids), 10)


def test_scatter_probs_rejects_shape_mismatch() -> None:
    with pytest.raises(ValueError, match="shape"):
        scatter_probs(np.array([0.5, 0.5]), [1, 2, 3], 10)
