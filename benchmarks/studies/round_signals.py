"""Which signals, known before the drafter step, predict that a round's first draft will be rejected?

On a 2-core CPU a drafted round (γ = 1) costs a drafter step plus a two-row verify pass; a round
without drafts costs only the (padded, batch-invariant) two-row pass and still carries a free guess.
Skipping the drafter pays exactly when the draft would have been rejected, so the γ policy gains only
as much as a cheap predictor of rejections can find.  This script collects, for every answer
position of the bench prompts, the signals the runtime has at the start of a round there, and whether
the drafter's and the free guess's token would be the target's:

* greedy answers come from the engine (spec, exact: identical to target-only decoding); with
  ``--temperature T`` sampled answers, drawn by coupled sampling (``verify.coupled``), which makes them
  as independent of the schedule as greedy ones, so they replay exactly too;
* the target's rows come from one teacher-forced pass over prompt + answer (batch-invariant, so the
  same as in decoding; checked: its choices must reproduce the answer);
* the drafter's proposal and confidence at each position come from one teacher-forced drafter pass.

    python benchmarks/studies/round_signals.py [BUNDLE] --head specvocab-r192-k128-of32768 --output bench-results/signals.npz

Then ``--analyze FILE --costs BENCH_JSON`` replays policies offline on those arrays and prints the
speed of each against fixed γ = 1, per category.  The greedy sequence does not depend on the policy
(exact mode), so every policy's rounds can be replayed exactly; each round is priced at the mean
latency a bench run measured for its passes (target rows, drafter catch-up rows) plus the run's mean
time outside ORT per round.  Policies: fixed γ = 1 with and without lookup, the runtime's own
:class:`AdaptiveGamma`, rules on pre-draft signals, a foresight schedule that knows every draft's confidence
before drafting (a bound for schedules driven by it), and the oracle that knows every outcome (an upper
bound for any schedule), and the default told one kind of outcome at a time (where the rest of the
oracle's gain lies: ``informed_policy``).  ``--analyze FILE --fit-on OTHER`` asks whether any recorded signal adds to
the drafter's confidence (a logistic model fitted on OTHER, scored on FILE), and what a schedule could know
of a draft before it pays the step that makes it (``before_the_step``); ``--fit-on halves`` fits on the
answers to FILE's even-numbered prompts and scores on the others.

This file is the command line; the recording and the replay are ``tools/round_replay.py``, where the
tests check that the oracle prices rounds as every replayed schedule is priced.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # tools/ is not installed with the package

from edge_spec.paths import DEFAULT_BUNDLE  # noqa: E402
from edge_spec.runtime.loops.config import ChainConfig  # noqa: E402
from tools.round_replay import (  # noqa: E402
    HALVES,
    add_eagle,
    analyze,
    collect,
    load_signals,
    prompt_halves,
    signal_value,
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle", type=Path, nargs="?", default=DEFAULT_BUNDLE)
    ap.add_argument("--head", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="record sampled answers (coupled sampling, so that they replay exactly), seeded as bench seeds them",
    )
    ap.add_argument("--seed", type=int, default=0, help="with --temperature: prompt i's answer uses seed + i")
    ap.add_argument("--prompts", type=Path, action="append", help="prompt file(s) (default: the bench set)")
    ap.add_argument("--output", type=Path, default=Path("bench-results/signals.npz"))
    ap.add_argument("--add-eagle", type=Path, metavar="FILE", help="add the EAGLE head's drafts to a signals file")
    ap.add_argument("--eagle-head", help="the EAGLE head's LM head for --add-eagle (default: the bundle's)")
    ap.add_argument(
        "--analyze",
        type=Path,
        nargs="+",
        help="replay policies on files this script wrote (several: "
        "one set of answers, e.g. sampled with several seeds), instead of collecting",
    )
    ap.add_argument(
        "--costs",
        type=Path,
        default=Path("bench-results/schedule-final/bench.json"),
        help="bench.json whose measured pass latencies price the replayed rounds",
    )
    ap.add_argument(
        "--gamma-max",
        type=int,
        default=ChainConfig.gamma,
        help="with --analyze: the longest round "
        "the schedule, the foresight and the oracle may plan, and the longest fixed γ replayed "
        "(default: the runtime's ceiling)",
    )
    ap.add_argument(
        "--one-row",
        action="store_true",
        help="with --analyze: price one-row passes as exact (no pad "
        "row: a draft-less round is one row unless its guess pays for a second)",
    )
    ap.add_argument(
        "--warm-up",
        type=Path,
        nargs="+",
        default=[],
        metavar="FILE",
        help="with --analyze: replay "
        "these signals files first, so that the schedule starts from the calibration they leave",
    )
    ap.add_argument("--warm-up-category", help="with --warm-up: only this category's answers (e.g. translation)")
    ap.add_argument(
        "--ignore-drops",
        action="store_true",
        help="with --analyze: the schedule does not learn from "
        "the drafts it dropped (neither the table of later drafts nor a request's first-draft estimate)",
    )
    ap.add_argument(
        "--rate-scale",
        type=float,
        default=1.0,
        help="with --analyze: replay the schedule with its "
        "stop rule's price of time scaled by this (is the rule tuned?)",
    )
    ap.add_argument(
        "--orders",
        type=int,
        default=1,
        help="with --analyze: also replay the schedule over this many "
        "orders of the answers (the file's own, then seeded shuffles) and report the mean and lowest",
    )
    ap.add_argument(
        "--fit-on",
        type=Path,
        metavar="FILE",
        help="with --analyze: fit a model of acceptance on "
        "every signal on this signals file and score it on the analyzed one (see signal_value); "
        f"'{HALVES}': fit on the answers to even-numbered prompts, score on the others",
    )
    ap.add_argument(
        "--machine",
        help="price rounds with another machine's costs instead: target pass ms by rows, "
        "then the drafter step ms, e.g. 48,56,82,100,121/17.4 (the README machine)",
    )
    ap.add_argument(
        "--drafter-ms",
        type=float,
        help="with --analyze: price every drafter step at this many ms "
        "(the same drafts and confidences: what the schedule and the oracle would reach with a "
        "drafter that cheap)",
    )
    args = ap.parse_args()
    if args.drafter_ms is not None and args.drafter_ms <= 0:
        ap.error("--drafter-ms must be positive")
    if args.add_eagle:
        add_eagle(args)
    elif args.analyze and args.fit_on:
        data = load_signals(args.analyze)
        signal_value(*(prompt_halves(data) if args.fit_on == HALVES else (load_signals([args.fit_on]), data)))
    elif args.analyze:
        analyze(
            args.analyze,
            args.costs,
            args.machine,
            args.one_row,
            args.gamma_max,
            args.warm_up,
            args.warm_up_category,
            learn_drops=not args.ignore_drops,
            rate_scale=args.rate_scale,
            orders=args.orders,
            drafter_ms=args.drafter_ms,
        )
    else:
        collect(args)


if __name__ == "__main__":
    main()
