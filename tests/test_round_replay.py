"""The replay's oracle is a ceiling: no schedule replayed on the same answers, priced the same way, may
beat it.

The round-signals study (``tools/round_replay.py``, run by ``benchmarks/studies/round_signals.py``) reports
how much of the oracle's gain over fixed γ = 1 the runtime's schedule reaches.  That ratio only means
something if the oracle prices a round exactly as the replay prices the schedule's rounds -- in particular
the drafter's catch-up, which is one row after a rejected draft, two after a fully accepted round, and
every token of a round the drafter did not draft.
"""

from __future__ import annotations

import numpy as np
import pytest

from tools import round_replay as signals
from tools import with_constant


def recorded_answers(seed: int, prompts: int = 12, length: int = 48) -> dict[str, np.ndarray]:
    """Answers with confident streaks (drafts right), unsure stretches, and copied spans for lookup."""
    rng = np.random.default_rng(seed)
    columns: dict[str, list] = {
        k: []
        for k in (
            "prompt",
            "category",
            "draft_ok",
            "draft_conf",
            "guess_ok",
            "guess_match",
            "lookup_len",
            "lookup_run",
            "lookup_match",
        )
    }
    for p in range(prompts):
        easy = rng.random(length) < 0.5
        easy = np.convolve(easy, np.ones(4), "same") >= 2  # streaks
        conf = np.where(easy, rng.uniform(0.85, 1.0, length), rng.uniform(0.1, 0.8, length))
        ok = rng.random(length) < np.where(easy, 0.92, 0.35)
        copied = rng.random(length) < 0.15
        run = np.where(copied, rng.integers(0, 6, length), 0)
        columns["prompt"] += [p] * length
        columns["category"] += [("code", "chat", "translation")[p % 3]] * length
        columns["draft_ok"] += list(ok)
        columns["draft_conf"] += list(conf)
        columns["guess_ok"] += list(rng.random(length) < 0.2)
        columns["guess_match"] += list(rng.integers(0, 4, length))
        columns["lookup_len"] += list(np.where(copied, 6, 0))
        columns["lookup_run"] += list(run)
        columns["lookup_match"] += list(np.where(copied, rng.integers(1, 5, length), 0))
    return {k: np.asarray(v) for k, v in columns.items()}


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("catch_up", [0.005, 0.020])
def test_no_replayed_schedule_beats_the_oracle(seed, catch_up):
    data = recorded_answers(seed)
    # a drafter step over two rows costs more than over one: the catch-up the oracle must price as replayed
    drafter = {1: 0.008, 2: 0.008 + catch_up, 3: 0.008 + 1.5 * catch_up}
    prices = signals.Prices({1: 0.030, 2: 0.031, 3: 0.036, 4: 0.041, 5: 0.046}, drafter, head=0.0005, outside=0.001)
    policies = {f"fixed γ={g}": (lambda g: lambda i, state: ("draft", g))(g) for g in (1, 2, 4)}
    policies["lookup when matched"] = lambda i, state: ("lookup", 2) if data["lookup_len"][i] else ("draft", 1)
    policies["guess only"] = lambda i, state: ("guess", 1)
    policies["adaptive"] = signals.adaptive_policy(data, prices, lookup=True, gamma_max=4)
    policies["foresight"] = signals.foresight_policy(data, prices, gamma_max=4)
    policies["told every confidence"] = signals.peeking_policy(data, prices, gamma_max=4)
    for know in signals.KNOWLEDGE:  # told one kind of outcome, still no faster than told them all
        schedule = signals.adaptive_policy(data, prices, lookup=True, gamma_max=4)
        policies[f"told {know}"] = signals.informed_policy(data, schedule, know, gamma_max=4)
    ceiling = signals.oracle(data, prices, gamma_max=4)
    for name, policy in policies.items():
        replayed = signals.replay(data, prices, policy)
        for category, (seconds, tokens) in replayed.items():
            assert ceiling[category][1] == tokens
            assert ceiling[category][0] <= seconds + 1e-12, (name, category, ceiling[category][0], seconds)


def test_the_oracle_gains_where_outcomes_vary():
    """Negative control: knowing the outcomes is worth something on these answers (the ceiling is not
    merely equal to the best fixed γ)."""
    data = recorded_answers(0)
    prices = signals.Prices({1: 0.030, 2: 0.031, 3: 0.036, 4: 0.041, 5: 0.046}, {1: 0.008, 2: 0.013, 3: 0.016})
    total = lambda result: sum(s for s, _ in result.values())
    best_fixed = min(
        total(signals.replay(data, prices, (lambda g: lambda i, state: ("draft", g))(g))) for g in (1, 2, 3, 4)
    )
    assert total(signals.oracle(data, prices, gamma_max=4)) < 0.95 * best_fixed


def test_when_every_draft_is_right_the_oracle_is_the_replayed_chain():
    """Every draft right, no guesses or lookups: the best one-draft schedule drafts every round, and the
    oracle must price it exactly as the replay does -- the first round's drafter step reads one token,
    every later one two (the previous draft and the bonus token)."""
    data = recorded_answers(0, prompts=3)
    data["draft_ok"][:] = True
    data["guess_ok"][:] = False
    data["lookup_len"][:] = 0
    prices = signals.Prices({1: 0.030, 2: 0.031, 3: 0.036}, {1: 0.008, 2: 0.020, 3: 0.024})
    chained = signals.replay(data, prices, lambda i, state: ("draft", 1))
    ceiling = signals.oracle(data, prices, gamma_max=1)
    for category, (seconds, _) in chained.items():
        assert ceiling[category][0] == pytest.approx(seconds, rel=1e-12)


def test_the_schedule_told_where_chains_break_drafts_exactly_the_accepted_run():
    """The decomposition of the oracle's gain is only as good as what each informed schedule is told:
    told where chains break, a round whose first draft is accepted drafts exactly the accepted run (up to
    the ceiling), so no such round verifies a rejected draft; and that knowledge is worth time (the
    schedule untold is slower on these answers)."""
    data = recorded_answers(1)
    prices = signals.Prices({1: 0.030, 2: 0.031, 3: 0.036, 4: 0.041, 5: 0.046}, {1: 0.008, 2: 0.010, 3: 0.012})
    told = signals.informed_policy(data, signals.adaptive_policy(data, prices, lookup=True, gamma_max=4), "stop", 4)
    rounds = []

    def watched(i, state):
        choice = told(i, state)
        rounds.append((i, choice))
        return choice

    informed = signals.replay(data, prices, watched)
    drafted = [(i, n) for i, (kind, n) in rounds if kind == "draft" and data["draft_ok"][i]]
    assert drafted
    for i, n in drafted:
        same = data["prompt"] == data["prompt"][i]
        assert all(data["draft_ok"][i : i + n]) and same[i : i + n].all()
        assert n == 4 or i + n >= len(same) or not same[i + n] or not data["draft_ok"][i + n]
    untold = signals.replay(data, prices, signals.adaptive_policy(data, prices, lookup=True, gamma_max=4))
    total = lambda result: sum(s for s, _ in result.values())
    assert total(informed) < 0.97 * total(untold)


def test_the_schedule_told_every_confidence_pays_no_step_it_drops_and_gains_where_confidence_tells():
    """``peeking_policy`` bounds what learning confidences before their steps could add to the runtime's
    schedule: it must never be charged a step whose draft it does not keep, and where the confidence says
    exactly which drafts the target rejects it must beat the schedule that pays to learn them.  Negative
    control: where every confidence is the same, knowing it early changes nothing about the rounds."""
    data = recorded_answers(2)
    data["draft_conf"] = np.where(data["draft_ok"], 0.97, 0.08)  # the confidence tells the outcome
    prices = signals.Prices({1: 0.030, 2: 0.031, 3: 0.036, 4: 0.041, 5: 0.046}, {1: 0.008, 2: 0.010, 3: 0.012})
    peeking = signals.peeking_policy(data, prices, gamma_max=4)
    charged = []

    def watched(i, state):
        kind, drafts = peeking(i, state)
        charged.append(kind == "dropped" or bool(state.get("dropped")))
        return kind, drafts

    told = signals.replay(data, prices, watched)
    assert charged and not any(charged)
    untold = signals.replay(data, prices, signals.adaptive_policy(data, prices, lookup=True, gamma_max=4))
    total = lambda result: sum(s for s, _ in result.values())
    assert total(told) < 0.97 * total(untold)
    flat = recorded_answers(2)
    flat["draft_conf"][:] = 0.9
    early = total(signals.replay(flat, prices, signals.peeking_policy(flat, prices, gamma_max=4)))
    late = total(signals.replay(flat, prices, signals.adaptive_policy(flat, prices, lookup=True, gamma_max=4)))
    assert early == pytest.approx(late, rel=0.03)


def test_a_draft_the_stop_rule_drops_costs_its_step():
    """The schedule can draft a draft and then drop it (its confidence too low to verify): the drafter's
    step ran, so the replay charges it, exactly one step per dropped draft, and the schedule's replay
    therefore costs what its rounds cost live."""
    data = recorded_answers(0, prompts=3)
    prices = signals.Prices({1: 0.030, 2: 0.031, 3: 0.036}, {1: 0.008, 2: 0.012})

    def one_draft(drop: bool):
        def policy(i, state):
            if drop:
                state["dropped"] = True  # as adaptive_policy marks a round that dropped its second draft
            return "draft", 1

        return policy

    kept, dropped = signals.replay(data, prices, one_draft(False)), signals.replay(data, prices, one_draft(True))
    rounds = {c: 0 for c in kept}
    for prompt in np.unique(data["prompt"]):  # one-draft rounds: one per rejected draft, one per accepted pair
        rows = np.flatnonzero(data["prompt"] == prompt)
        j = 0
        while j < len(rows):
            rounds[str(data["category"][rows[0]])] += 1
            j += 1 + int(data["draft_ok"][rows[j]])
    for category in kept:
        assert dropped[category][0] - kept[category][0] == pytest.approx(rounds[category] * 0.008, rel=1e-9)


def test_a_cheaper_drafter_is_priced_step_by_step_and_only_the_drafter_moves():
    """``--drafter-ms`` asks what the same drafts would be worth from a cheaper drafter: each fixed-γ round
    then saves exactly the drafter steps it runs (the catch-up pass included), the target's passes cost what
    they did, and the oracle's ceiling can only fall; priced at the drafter's own cost nothing moves
    (negative control)."""
    data = recorded_answers(0, prompts=4)
    prices = signals.Prices(
        {1: 0.030, 2: 0.031, 3: 0.036, 4: 0.041, 5: 0.046}, {1: 0.008, 2: 0.008, 3: 0.008}, head=0.0, outside=0.001
    )
    cheap, same = prices.with_drafter(0.002), prices.with_drafter(0.008)
    assert cheap.target == prices.target and cheap.outside == prices.outside and cheap.min_rows == prices.min_rows
    total = lambda result: sum(s for s, _ in result.values())
    for gamma in (1, 3):
        policy = lambda i, state, g=gamma: ("draft", g)
        base, fast = signals.replay(data, prices, policy), signals.replay(data, cheap, policy)
        assert total(signals.replay(data, same, policy)) == pytest.approx(total(base), rel=1e-12)
        steps = (total(base) - total(fast)) / 0.006  # every step saved the same 6 ms: a whole number of steps
        assert steps == pytest.approx(round(steps), abs=1e-6) and round(steps) >= len(data["prompt"]) / (gamma + 1)
    assert total(signals.oracle(data, cheap, gamma_max=4)) < total(signals.oracle(data, prices, gamma_max=4))
    assert total(signals.oracle(data, same, gamma_max=4)) == pytest.approx(
        total(signals.oracle(data, prices, gamma_max=4))
    )


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_recorded_answers_are_reproduced_by_the_teacher_forced_pass(int4_bundle, tmp_path, temperature):
    """Recording checks that the target's choices over the teacher-forced pass give the engine's answer (it
    exits otherwise), greedy and coupled-sampled; the drafter's proposals are right at some positions only."""
    import argparse
    import json

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"category": "code", "prompt": p}) + "\n" for p in ("def is_prime(n):", "The quick brown fox")
        )
    )
    output = tmp_path / "signals.npz"
    signals.collect(
        argparse.Namespace(
            bundle=int4_bundle,
            threads=1,
            head="trim-64",
            prompts=[prompts],
            max_tokens=24,
            temperature=temperature,
            seed=3,
            output=output,
        )
    )
    data = np.load(output)
    assert len(data["prompt"]) == 2 * 23
    assert 0 < data["draft_ok"].mean() < 1


def probe_answers(seed: int, informative: bool, n: int = 3000, width: int = 6) -> dict[str, np.ndarray]:
    """Drafts whose acceptance the confidence predicts in part; with ``informative`` one direction of the
    drafter's hidden state carries the rest, else the hidden state is noise."""
    rng = np.random.default_rng(seed)
    conf = rng.uniform(0.05, 0.99, n)
    hidden = rng.normal(size=(n, width))
    logit = np.log(conf / (1 - conf)) + (2.5 * hidden[:, 0] if informative else 0.0)
    ok = rng.random(n) < 1 / (1 + np.exp(-logit))
    return {
        "prompt": np.arange(n) // 40,
        "draft_ok": ok,
        "draft_conf": conf,
        "target_top": rng.uniform(0.2, 1, n),
        "target_margin": rng.uniform(0, 1, n),
        "target_entropy": rng.uniform(0, 3, n),
        "draft_second": rng.uniform(0, 0.3, n) * (1 - conf),
        "draft_entropy": rng.uniform(0, 2, n),
        "draft_hidden": hidden.astype(np.float16),
    }


def held_out_aucs(capsys, train: dict, test: dict) -> dict[str, float]:
    signals.signal_value(train, test)
    lines = capsys.readouterr().out.splitlines()
    return {line.split(" from ")[1].split(":")[0]: float(line.rsplit("AUC ", 1)[1]) for line in lines}


def test_the_hidden_state_probe_finds_what_the_confidence_misses_and_only_that(capsys):
    """The probe behind the README's 'a probe on the drafter's hidden state adds nothing': it must find
    acceptance carried by the hidden state when it is there (held out), and not invent it from noise."""
    found = held_out_aucs(capsys, probe_answers(1, True), probe_answers(2, True))
    probe = "drafter confidence + its hidden state (ridge 0.003)"
    assert found[probe] > found["drafter confidence"] + 0.05
    noise = held_out_aucs(capsys, probe_answers(3, False), probe_answers(4, False))
    assert abs(noise[probe] - noise["drafter confidence"]) < 0.02
    old = probe_answers(5, True)
    del old["draft_hidden"], old["draft_second"], old["draft_entropy"]  # a file recorded before these fields
    assert set(held_out_aucs(capsys, old, old)) == {
        "drafter confidence",
        "drafter confidence + target top-p, margin, entropy, previous outcome",
        "the previous draft's confidence",
        "the target's top-p, margin and entropy at the correction",
        "its own confidence, which its step reveals",
    }


def step_answers(seed: int, informative: bool, n: int = 4000, width: int = 6) -> dict[str, np.ndarray]:
    """Answers whose drafts the confidence predicts in part (as ``probe_answers``); with ``informative`` one
    direction of each step's hidden state also carries the next draft's fate (something the drafter knows a
    step ahead), and the drafter's probability of the pending token carries the first draft's after a
    rejection; else both are noise."""
    data = probe_answers(seed, False, n, width)
    rng = np.random.default_rng(seed + 100)
    hidden = data["draft_hidden"].astype(np.float64)
    ahead = np.r_[0.0, 2.5 * hidden[:-1, 0]] if informative else 0.0
    pending_q = rng.uniform(0.01, 0.99, n)
    after_miss = np.r_[False, ~data["draft_ok"][:-1]]
    pending = np.where(after_miss, np.log(pending_q / (1 - pending_q)), 0.0) if informative else 0.0
    conf = data["draft_conf"]
    logit = np.log(conf / (1 - conf)) + ahead + 2.0 * pending
    data["draft_ok"] = rng.random(n) < 1 / (1 + np.exp(-logit))
    data["pending_q"] = pending_q
    return data


def before_step_aucs(capsys, data: dict) -> dict[str, float]:
    signals.before_the_step(*signals.prompt_halves(data))
    lines = capsys.readouterr().out.splitlines()
    return {
        line.split("' (before its step) from ")[0].split("'")[1] + ": " + line.split(" from ")[1].split(":")[0]: float(
            line.rsplit("AUC ", 1)[1]
        )
        for line in lines
    }


def test_before_the_step_finds_what_a_paid_step_or_the_correction_tells_and_only_that(capsys):
    """The analysis behind the README's 'nothing known before a step predicts its draft': where the previous
    step's hidden state (or the drafter's probability of the target's correction) carries the next draft's
    fate, the held-out models must find it; where they are noise, they must not invent it.  The draft's own
    confidence, which only its step reveals, stays ahead of any model of what came before it."""
    next_probe = "next draft accepted: the previous draft's confidence and hidden state (ridge 0.3)"
    next_plain = "next draft accepted: the previous draft's confidence"
    first_probe = "first draft after a rejection accepted: those and the drafter's probability of the correction"
    first_plain = "first draft after a rejection accepted: the target's top-p, margin and entropy at the correction"
    found = before_step_aucs(capsys, step_answers(1, True))
    assert found[next_probe] > found[next_plain] + 0.1
    assert found[first_probe] > found[first_plain] + 0.1
    noise = before_step_aucs(capsys, step_answers(2, False))
    assert abs(noise[next_probe] - noise[next_plain]) < 0.03
    assert abs(noise[first_probe] - noise[first_plain]) < 0.03
    revealed = "next draft accepted: its own confidence, which its step reveals"
    assert noise[revealed] > noise[next_probe] + 0.1
    halves = signals.prompt_halves(step_answers(3, False))
    assert not set(halves[0]["prompt"]) & set(halves[1]["prompt"])  # no answer on both sides


def test_a_dearer_price_of_time_makes_the_replayed_rounds_shorter():
    """``--rate-scale`` reaches the stop rule: a round that must beat a higher rate drafts fewer tokens
    (the question it answers, whether ρ is tuned, needs the knob to move the schedule both ways)."""
    data = recorded_answers(0)
    prices = signals.Prices({1: 0.030, 2: 0.031, 3: 0.036, 4: 0.041, 5: 0.046}, {1: 0.008, 2: 0.013, 3: 0.016})

    def drafted(scale: float) -> float:
        policy, counts = signals.adaptive_policy(data, prices, lookup=False, gamma_max=4, rate_scale=scale), []

        def counted(i, state):
            choice = policy(i, state)
            counts.append(choice[1] if choice[0] == "draft" else 0)
            return choice

        signals.replay(data, prices, counted)
        return float(np.mean(counts))

    assert drafted(0.5) > drafted(1.0) > drafted(2.0)


def test_another_order_meets_the_same_answers_and_moves_only_what_the_carried_calibration_learnt(capsys):
    """``--orders``: a shuffled order keeps every answer whole and in its own order (only the prompts'
    numbers change), so fixed γ, which carries nothing from one answer to the next, replays exactly as
    before; and the spread line reports each adaptive mode once."""
    data = recorded_answers(0)
    again = signals.shuffled(data, 3)
    assert not np.array_equal(again["prompt"], data["prompt"])
    for prompt in np.unique(data["prompt"]):
        rows = np.flatnonzero(data["prompt"] == prompt)
        renumbered = np.unique(again["prompt"][rows])
        assert len(renumbered) == 1 and np.array_equal(np.flatnonzero(again["prompt"] == renumbered[0]), rows)
    prices = signals.Prices({1: 0.030, 2: 0.031, 3: 0.036, 4: 0.041, 5: 0.046}, {1: 0.008, 2: 0.013, 3: 0.016})
    fixed = lambda i, state: ("draft", 2)
    before, after = signals.replay(data, prices, fixed), signals.replay(again, prices, fixed)
    assert {c: (pytest.approx(s), n) for c, (s, n) in before.items()} == after
    schedule = lambda lookup, answers: signals.adaptive_policy(answers, prices, lookup, gamma_max=4)
    signals.order_spread(data, prices, [1, 2, 4], 3, schedule)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and all(", 3 orders: " in line for line in lines)


def test_with_constant_sets_a_schedule_number_and_refuses_anything_else():
    from edge_spec.runtime.schedule import acceptance

    saved = acceptance.CAUTION_FADE
    try:
        with_constant.override("CAUTION_FADE=24")
        assert acceptance.CAUTION_FADE == 24.0 and isinstance(acceptance.CAUTION_FADE, float)
    finally:
        acceptance.CAUTION_FADE = saved
    for bad in ("NO_SUCH_NAME=1", "CAUTION_FADE", "Agreement=1"):
        with pytest.raises(SystemExit):
            with_constant.override(bad)
