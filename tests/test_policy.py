"""The round planner: whole-round plans against a measured, tiled row-cost curve."""

import pytest

from edge_spec.runtime.schedule.acceptance import AcceptanceCalibration, RequestAcceptance
from edge_spec.runtime.schedule.policy import (
    AdaptiveGamma,
    CostModel,
    DraftRound,
    RoundOverhead,
    chain_tokens,
    guess_row_pays,
    plan_round,
    reach,
)

CPU = CostModel(draft=0.033, verify={1: 0.050, 2: 0.062, 4: 0.086})
# two machines of the same kind: a measured reference machine and a more memory-bound one
README_MACHINE = CostModel(draft=0.0174, verify={1: 0.048, 2: 0.056, 3: 0.082, 4: 0.100, 5: 0.121})
MEMORY_BOUND = CostModel(draft=0.0194, verify={1: 0.064, 2: 0.070, 3: 0.085, 4: 0.097, 5: 0.109})
# two-row tiles: the third row costs a whole pass over the weights, the fourth almost nothing
TILED = CostModel(draft=0.003, verify={1: 0.048, 2: 0.056, 3: 0.082, 4: 0.086, 5: 0.112})


def expected_tokens(alpha: float, gamma: int) -> float:
    """Tokens of a round of γ drafts each accepted with probability α."""
    return chain_tokens(alpha, alpha, gamma)


def best_gamma(alpha: float, costs: CostModel, gamma_max: int) -> int:
    return plan_round(alpha, alpha, costs, gamma_max).gamma


def estimates(first: float = 0.6, **calibration) -> RequestAcceptance:
    return RequestAcceptance(AcceptanceCalibration(**calibration), first=first)


def test_expected_tokens_geometric():
    assert expected_tokens(0.0, 5) == 1
    assert expected_tokens(1.0, 3) == 4
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    assert chain_tokens(0.5, 1.0, 3) == pytest.approx(2.5)  # a first draft at 0.5, then certain ones


def test_verify_cost_interpolates_and_extends_the_curve_s_last_slope():
    assert CPU.verify_cost(3) == pytest.approx(0.074)
    assert CPU.verify_cost(6) == pytest.approx(0.086 + 2 * 0.012)
    assert CostModel(draft=0.01, verify={4: 0.1}).verify_cost(1) == pytest.approx(0.1)


def test_plan_is_the_exact_argmax_of_tokens_per_second():
    for alpha in [0.05, 0.3, 0.5, 0.7, 0.9, 0.99]:
        for costs in (CPU, README_MACHINE, MEMORY_BOUND, TILED):
            rates = [expected_tokens(alpha, g) / costs.round_cost(g) for g in range(5)]
            plan = plan_round(alpha, alpha, costs, 4)
            best = max(range(1, 5), key=lambda g: rates[g])
            assert plan.gamma in (0, best)
            assert plan.gamma == best or rates[0] > rates[best]
            assert plan.rate == pytest.approx(rates[plan.gamma])


def test_the_machine_decides_the_draft_length():
    # the numbers: on the README machine one draft is best even at α = 0.95; on the
    # memory-bound one the cost model favours four (21.8 / 23.0 / 23.9 / 24.1 tok/s)
    assert best_gamma(0.95, README_MACHINE, 4) == 1
    assert best_gamma(0.95, MEMORY_BOUND, 4) == 4
    assert best_gamma(0.05, CPU, 4) == 0  # nearly every draft rejected: plain decoding


# 2026-11-25 AMD EPYC profile of the first-command bundle: one-row pass 28 ms, about 6.5 ms a row after
# the second, drafter step 7.4 ms (edge-spec info --costs --gamma 8)
AMD_2026_11_25 = CostModel(
    draft=0.0074,
    verify={1: 0.028, 2: 0.0333, 3: 0.041, 4: 0.0473, 5: 0.0541, 6: 0.0605, 7: 0.0693, 8: 0.0738, 9: 0.0809},
)


def test_a_cheap_row_curve_plans_past_four_drafts_where_an_expensive_one_does_not():
    # where a verify row costs less than a draft step saves, confident stretches pay for long rounds
    assert best_gamma(0.98, AMD_2026_11_25, 8) > 4
    assert best_gamma(0.98, AMD_2026_11_25, 8) > best_gamma(0.98, AMD_2026_11_25, 4) == 4
    assert best_gamma(0.80, AMD_2026_11_25, 8) <= 4  # the ceiling is no target: middling acceptance stays short
    assert best_gamma(0.98, README_MACHINE, 8) <= 2  # rows that cost a pass each: long rounds never pay


def test_how_far_a_round_may_reach_follows_the_row_cost_curve():
    # cheap rows: past four drafts; rows that cost a pass each: the floor of four, whatever the ceiling
    assert reach(AMD_2026_11_25, 8) > 4 and reach(MEMORY_BOUND, 8) == 8
    assert reach(README_MACHINE, 8) == 4 and reach(README_MACHINE, 3) == 3  # never above the configured ceiling
    confident = AcceptanceCalibration()
    for _ in range(200):
        confident.record([0.999] * 4, 4)
    for costs, expected in ((README_MACHINE, 4), (AMD_2026_11_25, reach(AMD_2026_11_25, 8))):
        policy = AdaptiveGamma(gamma_max=8, estimates=RequestAcceptance(confident, first=0.99))
        rule = policy.begin_round(costs)
        assert rule is not None and rule.gamma_max == expected
        steps = [rule.add(0.999) for _ in range(expected)]
        assert steps[-1] == (True, False)  # the round stops at its reach, not at the configured ceiling


def test_a_request_whose_streaks_never_break_reaches_further_and_one_whose_streaks_break_does_not():
    """The reach is set for the average request; one whose drafter reproduces the target (every later
    draft accepted) earns a longer reach from its own rounds, up to the ceiling, where rows are cheap.
    Controls: streaks that break in every round keep the machine's reach, and rows that cost a pass
    each keep the floor however long the streaks."""
    calibration = AcceptanceCalibration()

    def reach_after(costs: CostModel, rounds: int, accepted_of_each: int) -> tuple[int, int]:
        policy = AdaptiveGamma(gamma_max=16, estimates=RequestAcceptance(calibration))
        first = policy.ceiling(costs)
        for _ in range(rounds):
            drafts = policy.ceiling(costs)
            policy.update(drafts, min(accepted_of_each, drafts), [0.99] * drafts)
        return first, policy.ceiling(costs)

    base, grown = reach_after(AMD_2026_11_25, 12, accepted_of_each=16)
    assert base == reach(AMD_2026_11_25, 16) and base < grown <= 16
    assert reach_after(AMD_2026_11_25, 12, accepted_of_each=3) == (base, base)  # a rejection every round
    assert reach_after(README_MACHINE, 12, accepted_of_each=16) == (4, 4)


def test_look_ahead_skips_the_expensive_third_row_to_reach_the_cheap_fourth():
    rate = plan_round(0.9, 0.9, TILED, 3).rate
    rule = DraftRound(TILED, gamma_max=3, rate=rate, estimates=estimates())
    # a one-step rule sees +26 ms for a second draft and stops; the third draft costs only 4 ms more
    assert rule.best_length(acceptance=0.9, following=0.9, allow_drop=True) == 3
    myopic_gain = 0.9 * 0.9 - rate * (TILED.draft + TILED.verify_cost(3) - TILED.verify_cost(2))
    assert myopic_gain < 0  # the negative control: looking one draft ahead would have stopped at one


def test_confident_drafts_extend_a_round_past_a_pessimistic_plan():
    calibration = AcceptanceCalibration()
    for _ in range(200):  # this pair: confident drafts are accepted and so are the ones after them
        calibration.record([0.999, 0.999, 0.999], 3)
    rule = DraftRound(
        MEMORY_BOUND,
        gamma_max=4,
        rate=plan_round(0.5, 0.5, MEMORY_BOUND, 4).rate,
        estimates=RequestAcceptance(calibration, first=0.5),
    )
    steps = [rule.add(0.999) for _ in range(4)]
    assert [keep for keep, _ in steps] == [True] * 4 and [more for _, more in steps] == [True] * 3 + [False]


def test_a_request_whose_streaks_hold_escapes_a_calibration_whose_streaks_broke():
    """The trap: a calibration carried from translation (confident first drafts accepted, the drafts
    after them rejected) plans a request one draft a round, and one-draft rounds never teach the table of
    later drafts.  The request's own first-draft average is the floor of a later draft's estimate, as when
    the round is planned, so a request whose first drafts keep being accepted goes on drafting."""
    calibration = AcceptanceCalibration()
    for _ in range(300):
        calibration.record([0.999, 0.999], 1)  # streaks break after one draft
    assert calibration.next_after(0.999) < 0.2
    policy = AdaptiveGamma(gamma_max=8, estimates=RequestAcceptance(calibration))
    lengths = []
    for _ in range(40):  # this request: every first draft accepted, one draft a round while the trap holds
        rule = policy.begin_round(MEMORY_BOUND)
        drafted = 0
        while True:
            keep, more = rule.add(0.999)
            drafted += keep
            if not (keep and more):
                break
        lengths.append(drafted)
        policy.update(drafted, accepted=drafted, confidences=[0.999] * drafted)
    assert lengths[0] == 1  # the carried calibration's word, until the request's own outcomes outweigh it
    assert max(lengths[-10:]) >= 3
    # the negative control: the table alone (no floor) would keep every round at one draft
    assert policy.estimates.agreement.scale(calibration.next_after(0.999)) < policy.estimates.next_after(0.999)


def test_a_draft_that_does_not_pay_for_its_row_is_dropped_when_greedy_only():
    rule = DraftRound(CPU, gamma_max=4, rate=plan_round(0.8, 0.8, CPU, 4).rate, estimates=estimates(0.8))
    assert rule.add(0.01) == (False, False)  # prior acceptance ≈ its confidence: not worth 12 ms of verify
    assert rule.kept == 0
    rule = DraftRound(CPU, gamma_max=4, rate=plan_round(0.8, 0.8, CPU, 4).rate, estimates=estimates(0.8))
    keep, more = rule.add(0.01, may_drop=False)  # sampling: a drawn draft is never dropped for its value
    assert keep and not more and rule.kept == 1


def test_cheap_rows_and_high_acceptance_draft_to_the_limit():
    cheap = CostModel(draft=0.005, verify={1: 0.050, 2: 0.052, 8: 0.060})
    rule = DraftRound(cheap, gamma_max=6, rate=plan_round(0.95, 0.95, cheap, 6).rate, estimates=estimates(0.95))
    steps = [rule.add(0.97) for _ in range(6)]
    assert all(keep for keep, _ in steps) and [more for _, more in steps] == [True] * 5 + [False]


def test_probes_back_off_while_plain_decoding_wins_and_stop_when_drafts_are_accepted():
    calibration = AcceptanceCalibration()
    policy = AdaptiveGamma(gamma_max=4, estimates=RequestAcceptance(calibration, first=0.9))
    for _ in range(30):
        policy.update(drafted=3, accepted=0, confidences=[0.5, 0.5, 0.5])  # every first draft rejected
    assert policy.estimates.first < 0.05
    rounds = [policy.begin_round(CPU) for _ in range(4 + 8 + 16 + 32)]
    probes = [i for i, r in enumerate(rounds) if r is not None]
    assert probes == [3, 11, 27, 59]  # probes back off: 4, 8, 16, 32 rounds
    assert all(rounds[i].forced and rounds[i].gamma_max == 1 for i in probes)
    for _ in range(30):
        policy.update(drafted=3, accepted=3, confidences=[0.9, 0.9, 0.9])
    assert policy.begin_round(CPU) is not None and not policy.probing


def test_a_request_whose_every_draft_is_dropped_stops_paying_for_the_step():
    """Rounds whose only draft the stop rule drops (the drafter unsure at every step) teach the
    first-draft estimate what those drafts were worth (their estimated acceptance), so the plan stops
    paying a step to drop a draft; a confident draft dropped only for a likely guess does not count
    against the drafter."""

    def steps_paid(told: bool) -> int:
        policy = AdaptiveGamma(gamma_max=4, estimates=RequestAcceptance(AcceptanceCalibration(), first=0.8))
        paid = 0
        for _ in range(40):
            rule = policy.begin_round(README_MACHINE)
            if rule is None or rule.forced:
                continue
            paid += 1
            assert rule.add(0.05) == (False, False)  # dropped: not worth its verify row
            if told:
                policy.update(0, 0, dropped=True)
        return paid

    assert 0 < steps_paid(told=True) <= 8
    assert steps_paid(told=False) == 40  # negative control: a plan never told pays a step every round
    calibration = AcceptanceCalibration()
    before = calibration.first_draft()
    unsure, confident = RequestAcceptance(calibration, first=0.8), RequestAcceptance(calibration, first=0.8)
    unsure.record_dropped_first(0.05)
    confident.record_dropped_first(0.99)  # dropped only because the free guess was worth more
    assert unsure.first == pytest.approx(0.8 + 0.1 * (unsure.acceptance(0.05) - 0.8)) and unsure.first < 0.73
    assert confident.first > 0.8  # what such a draft was worth: more than the request's average
    assert calibration.first_draft() == before  # the carried estimate is the verified drafts' alone


def test_a_draft_less_round_is_worth_its_free_guess():
    # exact passes: a round without drafts still verifies two rows, the second a free guess
    exact = CostModel(draft=0.013, verify={1: 0.052, 2: 0.052, 3: 0.069, 4: 0.083})
    assert plan_round(0.45, 0.45, exact, 3).gamma == 1  # the guess ignored: the drafter looks better
    assert plan_round(0.45, 0.45, exact, 3, spare=0.3).gamma == 0  # the guess beats a doubtful draft
    assert plan_round(0.9, 0.9, exact, 3, spare=0.3).gamma > 0  # a confident drafter still drafts
    policy = AdaptiveGamma(3, estimates(first=0.45, first_prior=0.45))
    assert policy.begin_round(exact) is not None and policy.begin_round(exact, spare=0.3) is None


def test_a_draft_less_round_that_carries_a_guess_pays_for_two_rows():
    """Where one-row passes are exact and nothing pads them, a draft-less round's guess rides a
    second row, which the plan must price (with a pad row, one and two rows cost the same)."""
    one_row = CostModel(draft=0.010, verify={1: 0.045, 2: 0.052, 3: 0.065})
    assert one_row.expected_cost(0.5, 0.5, 0, spare=0.2) == pytest.approx(0.052)
    assert one_row.expected_cost(0.5, 0.5, 0) == pytest.approx(0.045)


def test_a_guess_rides_a_second_row_only_where_it_pays_for_that_row():
    """The second row's price is measured, not assumed: after a 2,800-token prompt it costs 44% of a
    one-row pass on the default target (42.2 against 29.4 ms), after a short one a few percent; a guess
    right 27% of the time pays for the cheap row and not for the dear one."""
    long_context = CostModel(draft=0.0098, verify={1: 0.0294, 2: 0.0422, 3: 0.0467}, catch_up=0.0026)
    short_context = CostModel(draft=0.0098, verify={1: 0.0331, 2: 0.0337, 3: 0.0364}, catch_up=0.0026)
    assert not guess_row_pays(long_context, 0.27)
    assert guess_row_pays(short_context, 0.27)
    assert guess_row_pays(long_context, 0.6)  # a guess right more often than the row's premium pays for it
    assert not guess_row_pays(short_context, 0.0)  # a row that buys nothing is never carried
    padded = CostModel(draft=0.0098, verify={1: 0.0337, 2: 0.0337})  # a pad row costs nothing more
    assert guess_row_pays(padded, 0.01)


def test_dropping_the_only_draft_prices_the_round_it_leaves():
    """A round that drops its only draft runs a one-row pass, or two rows with the guess: the stop rule
    must price it so, or where the second row is dear it keeps doubtful drafts to avoid a pass it thinks
    as dear as the two-row one."""
    costs = CostModel(draft=0.0098, verify={1: 0.0294, 2: 0.0422, 3: 0.0467}, catch_up=0.0026)
    rate = 1 / costs.expected_cost(0.4, 0.4, 0)
    rule = DraftRound(costs, gamma_max=4, rate=rate, estimates=estimates(0.4))
    assert rule.best_length(0.4, 0.4, allow_drop=True) == 0  # its second row costs more than the draft buys
    assert rule.best_length(0.9, 0.9, allow_drop=True) > 0  # control: a likely draft is kept
    guessing = DraftRound(costs, gamma_max=4, rate=rate, estimates=estimates(0.4), spare=0.3)
    dropped = guessing.best_length(0.4, 0.4, allow_drop=True)
    kept_value = 1.4 - rate * (costs.draft + costs.verify_cost(2) + 0.4 * costs.catch_up)
    guess_value = 1.3 - rate * (costs.draft + costs.verify_cost(2) + 0.3 * costs.catch_up)  # the guess's two rows
    assert dropped == (0 if guess_value > kept_value else 1)


# this machine's fast-layout bundle: a drafter step that reads two tokens costs 1.9 ms more than one
CATCH_UP = CostModel(draft=0.0101, verify={1: 0.0446, 2: 0.0522, 3: 0.0649, 4: 0.0754, 5: 0.0887}, catch_up=0.0019)


def test_a_round_is_charged_for_the_tokens_it_leaves_the_drafter_to_read():
    costs = CATCH_UP
    # the drafter's own drafts: one extra token to read only when every draft was accepted
    assert costs.expected_cost(0.8, 0.5, 2) == pytest.approx(costs.round_cost(2) + 0.8 * 0.5 * 0.0019)
    # a draft-less round: every token it makes (its own, and the spare row's guess when right)
    assert costs.expected_cost(0.8, 0.5, 0, spare=0.3) == pytest.approx(
        costs.round_cost(0, guessed=True) + 1.3 * 0.0019
    )
    # lookup drafts: the drafter read none of them
    lookup = CostModel(0.0, costs.verify, costs.catch_up, drafter_drafts=False)
    assert lookup.expected_cost(0.8, 0.5, 2) == pytest.approx(lookup.round_cost(2) + chain_tokens(0.8, 0.5, 2) * 0.0019)
    # no catch-up measured: the plain round cost
    assert CostModel(costs.draft, costs.verify).expected_cost(0.8, 0.5, 2) == pytest.approx(costs.round_cost(2))


def test_the_catch_up_row_moves_confident_rounds_past_one_draft():
    # a γ = 1 round at α = 0.8 leaves its two tokens unread four times in five; two drafts amortize that
    assert plan_round(0.8, 0.8, CATCH_UP, 4).gamma == 2
    assert plan_round(0.8, 0.8, CostModel(CATCH_UP.draft, CATCH_UP.verify), 4).gamma == 1  # control: no catch-up
    # the stop rule: once the drafter proposed draft k it has read draft k - 1, so dropping a doubtful
    # draft k leaves nothing extra to read, while keeping it leaves two tokens whenever it is right
    slow_second_row = CostModel(CATCH_UP.draft, CATCH_UP.verify, catch_up=0.010)
    rate = plan_round(0.8, 0.8, CostModel(CATCH_UP.draft, CATCH_UP.verify), 4).rate
    lengths = []
    for costs in (slow_second_row, CostModel(CATCH_UP.draft, CATCH_UP.verify)):
        rule = DraftRound(costs, gamma_max=4, rate=rate, estimates=estimates(0.8))
        rule.add(0.8)
        lengths.append(rule.best_length(acceptance=0.6, following=0.6, allow_drop=True))
    assert lengths == [1, 2]


def test_the_drafter_prices_its_second_row_from_its_own_passes():
    from types import SimpleNamespace

    from edge_spec.runtime.model.decoder import DecoderStats
    from edge_spec.runtime.propose.model import ModelDrafter

    stats = DecoderStats()
    drafter = ModelDrafter(SimpleNamespace(stats=stats), head=None, vocab_size=8)
    assert drafter.catch_up_seconds == 0.0  # nothing measured
    for _ in range(3):
        stats.add(1, 0.010)
    assert drafter.catch_up_seconds == 0.0  # no two-row step yet
    for _ in range(3):
        stats.add(2, 0.012)
    assert drafter.catch_up_seconds == pytest.approx(0.002)
    for _ in range(30):
        stats.add(2, 0.009)  # a second row that costs nothing (noise below the one-row step) is free, not a refund
    assert drafter.catch_up_seconds == 0.0


def test_the_round_overhead_favours_fewer_longer_rounds():
    # time spent outside the models is the same for every round: at α = 0.83 on the memory-bound
    # machine one draft wins without it, two drafts with 2 ms of it (control: the same plan, no overhead)
    assert plan_round(0.83, 0.83, MEMORY_BOUND, 4).gamma == 1
    with_overhead = CostModel(MEMORY_BOUND.draft, MEMORY_BOUND.verify, overhead=0.002)
    assert with_overhead.round_cost(1) == pytest.approx(MEMORY_BOUND.round_cost(1) + 0.002)
    assert plan_round(0.83, 0.83, with_overhead, 4).gamma == 2


def test_the_round_overhead_is_a_moving_average_from_its_first_round():
    overhead = RoundOverhead()
    overhead.record(0.004)
    assert overhead.seconds == pytest.approx(0.004)  # the first round sets it
    for _ in range(60):
        overhead.record(0.001)
    assert overhead.seconds == pytest.approx(0.001, abs=1e-5)
