"""Tests for edge_spec.runtime.verify.chain: exact cases and distribution tests.

The Monte Carlo tests check the property that makes speculative decoding
lossless: whatever the drafter proposes, the emitted tokens follow the
target.  A toy "language model" over V = 5 tokens supplies explicit
distributions, and the same chi-square harness is shown to *reject*
deliberately broken verifiers, so a pass means something.
"""

from __future__ import annotations

import bisect
import itertools
import os
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest

from edge_spec.runtime.verify import chain as verification
from edge_spec.runtime.verify.chain import (
    RESIDUAL_MIN_MASS,
    VerifyResult,
    residual_distribution,
    verify_chain,
    verify_greedy,
    verify_speculative,
)
from edge_spec.runtime.verify.sampling import (
    NonFiniteLogits,
    SamplingParams,
    logits_to_probs,
    sample,
    scatter_probs,
)
from tests.helpers import FixedUniform, chi_square_pvalue

# ---------------------------------------------------------------------------
# verify_greedy
# ---------------------------------------------------------------------------


def one_hot_rows(ids: list[int], vocab: int = 6) -> np.ndarray:
    rows = np.zeros((len(ids), vocab), dtype=np.float32)
    rows[np.arange(len(ids)), ids] = 1.0
    return rows


def test_greedy_all_accepted_appends_bonus_from_last_row() -> None:
    result = verify_greedy([2, 4, 1], one_hot_rows([2, 4, 1, 5]))
    assert result == VerifyResult(accepted=3, tokens=[2, 4, 1, 5])


def test_greedy_first_draft_rejected_gives_correction_only() -> None:
    result = verify_greedy([2, 4, 1], one_hot_rows([3, 4, 1, 5]))
    assert result == VerifyResult(accepted=0, tokens=[3])


def test_greedy_rejection_in_the_middle_ignores_later_rows() -> None:
    result = verify_greedy([2, 4, 1], one_hot_rows([2, 0, 1, 5]))
    assert result == VerifyResult(accepted=1, tokens=[2, 0])


def test_greedy_without_drafts_is_plain_greedy() -> None:
    assert verify_greedy([], one_hot_rows([4])) == VerifyResult(accepted=0, tokens=[4])


def test_greedy_ties_break_to_the_first_maximum_like_np_argmax() -> None:
    logits = np.array([[1.0, 7.0, 3.0, 7.0], [2.0, 2.0, 2.0, 2.0]], dtype=np.float32)
    assert verify_greedy([3], logits) == VerifyResult(accepted=0, tokens=[1])  # 3 ties but is not first
    assert verify_greedy([1], logits) == VerifyResult(accepted=1, tokens=[1, 0])


def test_greedy_accepts_numpy_token_arrays() -> None:
    result = verify_greedy(np.array([2, 4], dtype=np.int64), one_hot_rows([2, 4, 0]))
    assert result.tokens == [2, 4, 0] and all(type(t) is int for t in result.tokens)


@pytest.mark.parametrize(
    "drafts, rows",
    [([1, 2], one_hot_rows([1, 2])), ([1], one_hot_rows([1, 2, 3])), ([9], one_hot_rows([1, 2])), ([1], np.zeros(6))],
)
def test_greedy_rejects_mismatched_inputs(drafts: list[int], rows: np.ndarray) -> None:
    with pytest.raises(ValueError):
        verify_greedy(drafts, rows)


def toy_target_logits(prefix: tuple[int, ...], vocab: int = 6) -> np.ndarray:
    """Deterministic 'model': few distinct logit values, so ties are common."""
    seed = hash(prefix) & 0xFFFFFFFF
    return np.random.default_rng(seed).integers(0, 3, vocab).astype(np.float32)


def test_greedy_speculative_loop_equals_target_only_greedy() -> None:
    """End to end over a toy model with many ties: token-for-token equal."""
    rng = np.random.default_rng(0)
    prompt, length, gamma = (1, 2), 300, 4

    plain = list(prompt)
    while len(plain) < len(prompt) + length:
        plain.append(int(np.argmax(toy_target_logits(tuple(plain)))))

    spec, steps = list(prompt), 0
    while len(spec) < len(prompt) + length:
        drafts: list[int] = []
        for _ in range(gamma):  # drafter: often right, often the *last* tied max, sometimes random
            logits = toy_target_logits(tuple(spec + drafts))
            ties = np.flatnonzero(logits == logits.max())
            choice = rng.random()
            drafts.append(int(ties[0] if choice < 0.6 else ties[-1] if choice < 0.8 else rng.integers(6)))
        rows = np.stack([toy_target_logits(tuple(spec + drafts[:i])) for i in range(gamma + 1)])
        result = verify_greedy(drafts, rows)
        assert result.tokens[: result.accepted] == drafts[: result.accepted]
        spec.extend(result.tokens)
        steps += 1
    assert spec[: len(plain)] == plain
    assert steps < length  # drafts were actually accepted along the way


# ---------------------------------------------------------------------------
# residual_distribution and deterministic verify_speculative cases
# ---------------------------------------------------------------------------


def test_residual_is_normalised_positive_part_of_p_minus_q() -> None:
    p = np.array([0.5, 0.2, 0.3, 0.0])
    q = np.array([0.2, 0.4, 0.1, 0.3])
    np.testing.assert_allclose(residual_distribution(p, q), [0.6, 0.0, 0.4, 0.0], rtol=1e-12)


def test_residual_with_no_mass_falls_back_to_p() -> None:
    p = np.array([0.25, 0.75])
    np.testing.assert_array_equal(residual_distribution(p, p), p)
    tiny = p + np.array([RESIDUAL_MIN_MASS / 2, -RESIDUAL_MIN_MASS / 2])
    np.testing.assert_allclose(residual_distribution(tiny, p), tiny, rtol=1e-12)


def test_residual_does_not_modify_inputs() -> None:
    p, q = np.array([0.5, 0.5]), np.array([0.9, 0.1])
    residual_distribution(p, q)
    np.testing.assert_array_equal(p, [0.5, 0.5])
    np.testing.assert_array_equal(q, [0.9, 0.1])


def test_identical_distributions_accept_every_draft() -> None:
    rng = np.random.default_rng(0)
    p = rng.dirichlet(np.ones(7), size=4)
    for _ in range(200):
        drafts = [int(rng.choice(7, p=row)) for row in p[:3]]
        result = verify_speculative(drafts, p[:3], p, rng)
        assert result.accepted == 3 and result.tokens[:3] == drafts


def test_draft_with_zero_target_probability_is_always_replaced() -> None:
    p = np.array([[0.0, 0.5, 0.5], [1.0, 0.0, 0.0]])
    q = np.array([[0.9, 0.1, 0.0]])
    rng = np.random.default_rng(1)
    for _ in range(200):
        result = verify_speculative([0], q, p, rng)
        assert result.accepted == 0 and result.tokens[0] in (1, 2)


def test_acceptance_threshold_is_min_one_p_over_q() -> None:
    """u < p/q accepts, u >= p/q rejects (then the residual is sampled)."""
    p = np.array([[0.2, 0.8], [1.0, 0.0]])
    q = np.array([[0.8, 0.2]])  # p/q = 0.25 for token 0; residual = one-hot at 1
    assert verify_speculative([0], q, p, FixedUniform(0.2499, 0.5)) == VerifyResult(1, [0, 0])
    assert verify_speculative([0], q, p, FixedUniform(0.25, 0.5)) == VerifyResult(0, [1])
    assert verify_speculative([1], q, p, FixedUniform(0.9999, 0.5)) == VerifyResult(1, [1, 0])  # p >= q


def test_greedy_params_through_the_speculative_path_behave_like_greedy() -> None:
    """With one-hot p and q (temperature 0) rejection sampling is greedy verification."""
    rng = np.random.default_rng(3)
    greedy = SamplingParams()
    for _ in range(100):
        target_logits = rng.integers(0, 4, size=(4, 6)).astype(np.float32)
        draft_logits = rng.integers(0, 4, size=(3, 6)).astype(np.float32)
        p, q = logits_to_probs(target_logits, greedy), logits_to_probs(draft_logits, greedy)
        drafts = [int(i) for i in np.argmax(draft_logits, axis=-1)]
        assert verify_speculative(drafts, q, p, rng) == verify_greedy(drafts, target_logits)


def test_same_seed_gives_same_result_and_fixed_randomness_use() -> None:
    """Exactly gamma + 1 uniforms per call, whatever the outcome."""
    p = np.random.default_rng(0).dirichlet(np.ones(5), size=4)
    q = np.random.default_rng(1).dirichlet(np.ones(5), size=3)
    outcomes = set()
    for seed in range(40):
        first = verify_speculative([0, 1, 2], q, p, np.random.default_rng(seed))
        rng = np.random.default_rng(seed)
        assert verify_speculative([0, 1, 2], q, p, rng) == first
        reference = np.random.default_rng(seed)
        reference.random(4)
        assert rng.random() == reference.random()
        outcomes.add(first.accepted)
    assert len(outcomes) >= 3  # several outcomes covered, all with the same usage


def test_speculative_without_drafts_samples_from_target_row_zero() -> None:
    p = np.array([[0.0, 0.0, 1.0]])
    result = verify_speculative([], np.zeros((0, 3)), p, np.random.default_rng(0))
    assert result == VerifyResult(accepted=0, tokens=[2])


def test_full_size_vocabulary_round_trip() -> None:
    """Qwen-sized rows, reduced-vocabulary drafter: valid output, target support only."""
    rng = np.random.default_rng(4)
    vocab, params = 151936, SamplingParams(temperature=0.8, top_k=50, top_p=0.95)
    target = logits_to_probs(rng.standard_normal((4, vocab)).astype(np.float32) * 3, params)
    ids = np.sort(rng.choice(vocab, 32768, replace=False))
    drafter = logits_to_probs(rng.standard_normal((3, ids.size)).astype(np.float32) * 3, params)
    q = scatter_probs(drafter, ids, vocab)
    for _ in range(20):
        drafts = [sample(row, rng) for row in q]
        result = verify_speculative(drafts, q, target, rng)
        assert result.tokens[: result.accepted] == drafts[: result.accepted]
        assert target[result.accepted, result.tokens[-1]] > 0


def test_zero_draft_probability_for_the_drafted_token_is_an_error() -> None:
    p = np.full((2, 3), 1 / 3)
    with pytest.raises(ValueError, match="zero drafter probability"):
        verify_speculative([2], np.array([[0.5, 0.5, 0.0]]), p, np.random.default_rng(0))


@pytest.mark.parametrize(
    "drafts, q_shape, p_shape",
    [([0, 1], (2, 4), (2, 4)), ([0], (2, 4), (2, 4)), ([0], (1, 3), (2, 4)), ([4], (1, 4), (2, 4))],
)
def test_speculative_rejects_mismatched_shapes(drafts: list[int], q_shape: tuple, p_shape: tuple) -> None:
    with pytest.raises(ValueError):
        verify_speculative(drafts, np.full(q_shape, 0.25), np.full(p_shape, 0.25), np.random.default_rng(0))


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.0, top_k=5),
        SamplingParams(temperature=0.9, top_p=0.8),
    ],
)
def test_point_mass_drafts_verify_from_logits_as_their_one_hot_rows_do(params: SamplingParams) -> None:
    # the chain loop's path (q None for a point mass, the target's rows converted one at a time) against the
    # reference (dense one-hot q rows, every target row converted): the same tokens and the same randomness
    # used, round after round, with drafter rows mixed in
    data = np.random.default_rng(11)
    vocab, outcomes = 40, set()
    for trial in range(400):
        gamma = int(data.integers(1, 7))
        logits = (data.normal(size=(gamma + 1, vocab)) * 3).astype(np.float32)
        target = logits_to_probs(logits, params)
        drafts, lazy, dense = [], [], []
        for i in range(gamma):
            if data.random() < 0.7:  # a copy: mostly the target's likely token, sometimes not
                token = int(np.argmax(target[i])) if data.random() < 0.6 else int(data.integers(vocab))
                lazy.append(None)
                dense.append(np.eye(vocab)[token])
            else:  # a drafter's sample from its own distribution
                q = logits_to_probs(logits[i] + data.normal(size=vocab).astype(np.float32), params)
                token = int(data.choice(vocab, p=q))
                lazy.append(q)
                dense.append(q)
            drafts.append(token)
        got_rng, want_rng = np.random.default_rng(trial), np.random.default_rng(trial)
        got = verify_chain(drafts, lazy, logits, params, got_rng, position=0)
        want = verify_speculative(drafts, np.array(dense), target, want_rng)
        assert got == want
        assert got_rng.random() == want_rng.random()
        outcomes.add("all" if got.accepted == gamma else "rejected")
    assert outcomes == {"all", "rejected"}  # both the bonus and the residual path were compared


def test_rows_after_the_first_rejection_are_never_turned_into_probabilities(monkeypatch) -> None:
    converted = []
    real = verification.row_probs
    monkeypatch.setattr(
        verification, "row_probs", lambda row, peak, params: converted.append(1) or real(row, peak, params)
    )
    logits = np.zeros((5, 8), dtype=np.float32)
    logits[0, 3] = 50.0  # draft 0 (token 3) certain to pass
    logits[1, 4] = -np.inf  # draft 1 (token 4) certain to fail
    result = verify_chain(
        [3, 4, 5, 6], [None] * 4, logits, SamplingParams(temperature=0.7), np.random.default_rng(0), 0
    )
    assert result.accepted == 1 and result.tokens[1] != 4
    assert len(converted) == 2  # rows 0 and 1, not the three after the rejection
    logits[3, 0] = np.nan  # but a damaged row anywhere is still found before any is used
    with pytest.raises(NonFiniteLogits):
        verify_chain([3, 4, 5, 6], [None] * 4, logits, SamplingParams(temperature=0.7), np.random.default_rng(0), 0)


# ---------------------------------------------------------------------------
# Monte Carlo: the emitted tokens follow the target
# ---------------------------------------------------------------------------
#
# Toy language model over V = 5 tokens, first-order Markov: the target's
# distribution for absolute position ``pos`` given the previous token ``prev``
# is ``TARGET[pos, prev]`` = BASE_P[pos] rotated by ``prev``; the drafter is
# built the same way from BASE_Q.  Target rows independent of
# the drafted tokens would do; making them depend on the previous token is stronger: a
# verifier that used the wrong row (e.g. for the bonus token) is caught.
# The rows deliberately include a token the target forbids but the drafter
# likes (target top-k), and a token the drafter can never propose (reduced
# drafter vocabulary, q = 0), which only the residual can emit.

V = 5
PROMPT_LAST = 0  # the prompt's last token; position 0 is conditioned on it

BASE_P = np.array(
    [
        [0.35, 0.25, 0.20, 0.00, 0.20],  # token 3 cut by target top-k
        [0.10, 0.40, 0.15, 0.25, 0.10],
        [0.30, 0.05, 0.30, 0.15, 0.20],
        [0.20, 0.20, 0.20, 0.20, 0.20],
    ]
)
BASE_Q = np.array(
    [
        [0.15, 0.45, 0.10, 0.30, 0.00],  # never proposes token 4
        [0.30, 0.30, 0.20, 0.20, 0.00],
        [0.25, 0.25, 0.25, 0.25, 0.00],
    ]
)


def markov_table(base: np.ndarray) -> np.ndarray:
    """table[pos, prev] = base[pos] rotated by prev."""
    return np.stack([np.stack([np.roll(row, prev) for prev in range(V)]) for row in base])


TARGET = markov_table(BASE_P)
DRAFTER = markov_table(BASE_Q)

Verifier = Callable[[list[int], np.ndarray, np.ndarray, np.random.Generator], VerifyResult]


@dataclass
class Counts:
    first_two: np.ndarray  # (V, V): joint counts of the first two emitted tokens
    accepted: np.ndarray  # (gamma + 1,): accepted-draft counts of the first round


def expected_first_two() -> np.ndarray:
    """Target-only decoding: P(t0 = a, t1 = b) = TARGET[0, prompt, a] * TARGET[1, a, b]."""
    return TARGET[0, PROMPT_LAST][:, None] * TARGET[1]


def expected_accepted(gamma: int) -> np.ndarray:
    """Exact distribution of the first round's accepted count, by enumeration.

    Drafting x and accepting it has probability q(x) * min(1, p(x)/q(x)) =
    min(p, q)(x); the round stops at draft i with probability
    1 - sum(min(p_i, q_i)) given the drafts before it.
    """
    dist = np.zeros(gamma + 1)

    def walk(i: int, prev: int, weight: float) -> None:
        if i == gamma:
            dist[gamma] += weight
            return
        overlap = np.minimum(TARGET[i, prev], DRAFTER[i, prev])
        dist[i] += weight * (1.0 - overlap.sum())
        for x in np.flatnonzero(overlap):
            walk(i + 1, int(x), weight * overlap[x])

    walk(0, PROMPT_LAST, 1.0)
    return dist


def drafter_cdfs() -> list[list[list[float]]]:
    return [[list(itertools.accumulate(row)) for row in position] for position in DRAFTER]


def draw(cdf: list[float], u: float) -> int:
    """Inverse CDF over a small Python list (faster than numpy per call)."""
    return min(bisect.bisect_right(cdf, u * cdf[-1]), len(cdf) - 1)


def round_rows(pos: int, prevs: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Drafter rows (gamma, V) and target rows (gamma + 1, V) for one round.

    Row i is conditioned on prevs[i]: the token before position pos + i.
    """
    positions = pos + np.arange(len(prevs))
    return DRAFTER[positions[:-1], prevs[:-1]], TARGET[positions, prevs]


def run_harness(verify: Verifier, gamma: int, trials: int, seed: int) -> Counts:
    """Decode until two tokens are out, ``trials`` times; count what came out.

    Each round drafts ``gamma`` tokens from the drafter given the prefix and
    verifies them against the target rows for the same prefixes.  If the
    first round emits only one token, a second round starts after it, as the
    real decoding loop would.
    """
    cdfs = drafter_cdfs()
    draft_rng, verify_rng = np.random.default_rng(seed), np.random.default_rng(seed + 1)
    uniforms = iter(draft_rng.random(trials * 2 * gamma).tolist())
    first_two = np.zeros((V, V), dtype=np.int64)
    accepted = np.zeros(gamma + 1, dtype=np.int64)
    rows: dict[tuple[int, ...], tuple[np.ndarray, np.ndarray]] = {}  # built once per prefix
    for _ in range(trials):
        emitted: list[int] = []
        prev = PROMPT_LAST
        while len(emitted) < 2:
            pos, drafts = len(emitted), []
            for i in range(gamma):
                drafts.append(draw(cdfs[pos + i][drafts[-1] if drafts else prev], next(uniforms)))
            key = (pos, prev, *drafts)
            if key not in rows:
                rows[key] = round_rows(pos, [prev] + drafts)
            result = verify(drafts, *rows[key], verify_rng)
            if not emitted:
                accepted[result.accepted] += 1
            emitted.extend(result.tokens)
            prev = emitted[-1]
        first_two[emitted[0], emitted[1]] += 1
    return Counts(first_two, accepted)


@dataclass
class Verdict:
    first: float  # p-value: first emitted token ~ target row 0
    first_two: float  # p-value: joint of the first two tokens ~ target
    accepted: float  # p-value: first-round acceptance counts ~ exact formula


def judge(counts: Counts, gamma: int) -> Verdict:
    joint = expected_first_two()
    return Verdict(
        first=chi_square_pvalue(counts.first_two.sum(axis=1), joint.sum(axis=1)),
        first_two=chi_square_pvalue(counts.first_two, joint),
        accepted=chi_square_pvalue(counts.accepted, expected_accepted(gamma)),
    )


# Trial counts.  One trial costs ~20-40 us (one or two verify calls), so
# 200k trials per configuration would blow the test-time budget; 50k is the
# default and EDGE_SPEC_MC_TRIALS=200000 runs the full-size check.
# Power at 50k: the rarest joint cell (p = 0.02) expects 1000 counts; a
# chi-square at p < 1e-3 flags an absolute error of ~0.005 in one joint cell
# (p = 0.05) or ~0.008 in one first-token cell.  Real bugs are far larger:
# the broken variants below are off by >= 0.05 somewhere and score p-values
# below 1e-200 with only 10k trials, while the control shows that the same
# 10k trials accept a correct verifier.
POSITIVE_TRIALS = int(os.environ.get("EDGE_SPEC_MC_TRIALS", "50000"))
NEGATIVE_TRIALS = 10_000
PASS = 1e-3  # fixed seeds make every run identical, so this cannot flake
REJECT = 1e-6


def test_expected_accepted_sums_to_one_and_matches_closed_form_for_gamma_1() -> None:
    np.testing.assert_allclose(expected_accepted(1)[1], np.minimum(TARGET[0, 0], DRAFTER[0, 0]).sum())
    for gamma in (1, 2, 3):
        assert expected_accepted(gamma).sum() == pytest.approx(1.0)


@pytest.mark.slow
@pytest.mark.parametrize("gamma, seed", [(1, 10), (2, 20)])
def test_emitted_tokens_follow_the_target(gamma: int, seed: int) -> None:
    counts = run_harness(verify_speculative, gamma, POSITIVE_TRIALS, seed)
    forbidden = expected_first_two() == 0
    assert counts.first_two[forbidden].sum() == 0, "emitted a token the target forbids"
    assert counts.first_two[:, 4].sum() > 0, "the residual never produced the token the drafter cannot propose"
    verdict = judge(counts, gamma)
    assert verdict.first > PASS and verdict.first_two > PASS and verdict.accepted > PASS, verdict


# --- deliberately broken verifiers -----------------------------------------


def variant(accept: Callable[[float, float, float], bool]) -> Verifier:
    """Test-local re-implementation of rejection sampling with a pluggable rule."""

    def verify(drafts: list[int], q: np.ndarray, p: np.ndarray, rng: np.random.Generator) -> VerifyResult:
        uniforms = rng.random(len(drafts))
        for i, x in enumerate(drafts):
            if not accept(uniforms[i], p[i, x], q[i, x]):
                return VerifyResult(i, drafts[:i] + [sample(residual_distribution(p[i], q[i]), rng)])
        return VerifyResult(len(drafts), drafts + [sample(p[-1], rng)])

    return verify


correct_rule = variant(lambda u, p, q: u * q < p)  # min(1, p/q): the control
inverted_rule = variant(lambda u, p, q: u * p < q)  # min(1, q/p): wrong


def bonus_from_previous_row(drafts: list[int], q: np.ndarray, p: np.ndarray, rng: np.random.Generator) -> VerifyResult:
    """Real verifier, but the bonus token comes from row gamma - 1."""
    return verify_speculative(drafts, q, np.vstack([p[:-1], p[-2:-1]]), rng)


@pytest.mark.slow
def test_control_reimplementation_passes_at_the_negative_trial_count() -> None:
    verdict = judge(run_harness(correct_rule, 2, NEGATIVE_TRIALS, seed=30), 2)
    assert verdict.first > PASS and verdict.first_two > PASS and verdict.accepted > PASS, verdict


@pytest.mark.slow
def test_harness_rejects_inverted_acceptance_ratio() -> None:
    verdict = judge(run_harness(inverted_rule, 2, NEGATIVE_TRIALS, seed=40), 2)
    assert verdict.first_two < REJECT and verdict.accepted < REJECT, verdict


@pytest.mark.slow
def test_harness_rejects_resampling_from_p_instead_of_the_residual(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(verification, "residual_distribution", lambda p, q, token=None: p)
    verdict = judge(run_harness(verify_speculative, 2, NEGATIVE_TRIALS, seed=50), 2)
    assert verdict.first < REJECT and verdict.first_two < REJECT, verdict
    assert verdict.accepted > PASS  # the acceptance rule itself is untouched


@pytest.mark.slow
def test_harness_rejects_bonus_from_the_wrong_row() -> None:
    # gamma = 1: the bonus is the second emitted token, inside the joint.
    verdict = judge(run_harness(bonus_from_previous_row, 1, NEGATIVE_TRIALS, seed=60), 1)
    assert verdict.first_two < REJECT, verdict
    assert verdict.first > PASS  # only the bonus is wrong
