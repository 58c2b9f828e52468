"""γ policy on synthetic cost models, and losslessness with adaptive γ."""

from __future__ import annotations

import pytest

from edge_spec.runtime.schedule.policy import (
    AdaptiveGamma,
    ConfidenceAcceptance,
    CostModel,
    DraftRound,
    best_gamma,
    expected_tokens,
)

# roughly this machine: target 1 row 50 ms, +12 ms per extra row, drafter step 33 ms
CPU = CostModel(draft=0.033, verify={1: 0.050, 2: 0.062, 4: 0.086})


def test_expected_tokens_geometric():
    assert expected_tokens(0.0, 5) == 1
    assert expected_tokens(1.0, 3) == 4
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)


def test_verify_cost_interpolates_and_extrapolates():
    assert CPU.verify_cost(3) == pytest.approx(0.074)
    assert CPU.verify_cost(6) == pytest.approx(0.086 * (1 + 0.25 * 5) / (1 + 0.25 * 3))
    only_four = CostModel(draft=0.01, verify={4: 0.1})
    assert only_four.verify_cost(1) == pytest.approx(0.1 / 1.75)


def test_low_acceptance_falls_back_to_autoregressive():
    assert best_gamma(0.3, CPU, 6) == 0


def test_high_acceptance_with_cheap_drafter_drafts_long():
    cheap = CostModel(draft=0.005, verify={1: 0.050, 2: 0.052, 8: 0.060})
    assert best_gamma(0.95, cheap, 6) == 6


def test_choice_is_the_argmax_of_rate_with_a_margin_for_drafting():
    for alpha in (0.5, 0.7, 0.85, 0.95):
        g = best_gamma(alpha, CPU, 5)
        rates = [expected_tokens(alpha, k) / CPU.round_cost(k) for k in range(6)]
        best_drafting = max(rates[1:])
        if g == 0:
            assert rates[0] > 1.03 * best_drafting
        else:  # the shortest drafting length within 3% of the best
            assert rates[g] * 1.03 >= best_drafting and rates[g] * 1.03 >= rates[0]
            assert all(rates[k] * 1.03 < best_drafting for k in range(1, g))
        assert best_gamma(alpha, CPU, 5, prefer_drafting=0.0, prefer_shorter=0.0) == max(
            range(6), key=lambda k: (rates[k], -k))


def test_near_break_even_the_shorter_round_wins():
    """γ = 2 beats γ = 1 by under 1% here: noise in α must not buy the longer, riskier round."""
    costs = CostModel(draft=0.018, verify={1: 0.062, 2: 0.076, 3: 0.096})
    rates = [expected_tokens(0.9, g) / costs.round_cost(g) for g in (1, 2)]
    assert 1.0 < rates[1] / rates[0] < 1.03
    assert best_gamma(0.9, costs, 2, prefer_shorter=0.0) == 2
    assert best_gamma(0.9, costs, 2) == 1


def test_acceptance_estimate_tracks_rounds_and_probes():
    policy = AdaptiveGamma(gamma_max=4, alpha=0.9)
    for _ in range(20):
        policy.update(drafted=3, accepted=0)  # every first draft rejected
    assert policy.alpha < 0.05
    choices = [policy.choose(CPU) for _ in range(4 + 8 + 16 + 32)]
    probes = [i for i, g in enumerate(choices) if g == 1]
    assert probes == [3, 11, 27, 59] and set(choices) == {0, 1}  # probes back off: 4, 8, 16, 32 rounds
    for _ in range(20):
        policy.update(drafted=3, accepted=3)
    assert policy.alpha > 0.9


def test_draft_round_drops_a_draft_that_does_not_pay_for_its_verify_row():
    rule = DraftRound(CPU, gamma_max=4, next_acceptance=0.8)
    assert rule.add(0.05) == (False, False)  # a near-certain reject is not worth 12 ms of verify
    assert rule.kept == 0


def test_draft_round_keeps_sampled_drafts_whatever_their_confidence():
    rule = DraftRound(CPU, gamma_max=4, next_acceptance=0.8)
    keep, more = rule.add(0.05, may_drop=False)
    assert keep and not more and rule.kept == 1


def test_draft_round_drafts_on_while_acceptance_is_high_and_verify_rows_are_cheap():
    cheap = CostModel(draft=0.005, verify={1: 0.050, 2: 0.052, 8: 0.060})
    rule = DraftRound(cheap, gamma_max=6, next_acceptance=0.95)
    steps = [rule.add(0.95) for _ in range(6)]
    assert all(keep for keep, _ in steps) and [more for _, more in steps] == [True] * 5 + [False]
    assert rule.expected == pytest.approx(expected_tokens(0.95, 6))


def test_draft_round_stops_when_the_next_row_costs_more_than_it_can_bring():
    rule = DraftRound(CPU, gamma_max=4, next_acceptance=0.6)
    keep, more = rule.add(0.9)
    # kept: (1 + 0.9) / (33 + 62 ms) beats 1 / (33 + 50 ms); another: +0.54 tokens for 45 ms, below the rate
    assert keep and not more


def test_confidence_bins_learn_separate_acceptance_rates():
    table = ConfidenceAcceptance()
    assert table.estimate(0.99, prior=0.7) == pytest.approx(0.7)  # no data: the prior
    for _ in range(20):
        table.update(0.99, True)
        table.update(0.2, False)
    assert table.estimate(0.99, prior=0.5) > 0.95
    assert table.estimate(0.2, prior=0.5) < 0.05
    assert table.estimate(0.6, prior=0.5) == pytest.approx(0.5)  # an untouched bin keeps the prior


def test_adaptive_policy_updates_confidence_bins_only_for_observed_drafts():
    policy = AdaptiveGamma(gamma_max=4)
    policy.update(drafted=4, accepted=1, confidences=[0.99, 0.2, 0.99, 0.99])
    assert policy.by_confidence.counts[ConfidenceAcceptance.bin(0.99)] == 1  # 3rd/4th never verified
    assert policy.by_confidence.counts[ConfidenceAcceptance.bin(0.2)] == 1


def test_a_round_never_drafts_past_the_geometric_optimum():
    policy = AdaptiveGamma(gamma_max=6, alpha=0.85)
    rule = policy.begin_round(CPU)
    assert rule is not None and rule.gamma_max == best_gamma(0.85, CPU, 6) < 6
    policy.alpha = 0.1
    assert policy.begin_round(CPU) is None  # plain decoding
