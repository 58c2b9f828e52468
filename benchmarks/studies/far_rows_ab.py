"""Two far-prefetch choices on whole answers: one engine answers each bench prompt asking for the record eight
on from ``--rows A`` and from ``--rows B`` rows (``kernel_choice.set_far_rows``), in turns.

The choice is the native op's, process-wide, and changes no bits, so one engine serves both sides: the order is
reversed every other prompt (a machine speeding up or slowing down falls on both), the suffix cache is emptied
before each answer (the second answer is not drafted from the first), and every answer pair is compared token
for token.  Prints the decode speed ratio B / A per category and overall (geometric mean over prompts).

    python benchmarks/cpu_mask.py avx2 -- python benchmarks/studies/far_rows_ab.py --bundle BUNDLE --rows 4,2
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict
from pathlib import Path

from edge_spec.bench.runs import load_bench_prompts
from edge_spec.paths import DEFAULT_BUNDLE
from edge_spec.prompts import as_messages
from edge_spec.runtime.engine import Engine
from edge_spec.runtime.model import huge_pages
from edge_spec.runtime.model.kernel_choice import far_rows_in_force, set_far_rows
from edge_spec.runtime.model.native_attention import native_library


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundle", type=Path, default=DEFAULT_BUNDLE)
    parser.add_argument("--rows", default="4,2", help="the two choices: fewest rows asking far (0: no pass)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--mode", default="spec")
    args = parser.parse_args()
    a, b = (int(n) for n in args.rows.split(","))
    library = native_library("cpu")
    if library is None:
        raise SystemExit("the native op does not run here")
    engine = Engine.from_bundle(args.bundle, threads=args.threads, mode=args.mode)
    huge_pages.wait_all()
    speed: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    same = 0
    items = list(load_bench_prompts(None, None, None))
    for index, item in enumerate(items):
        answers = {}
        for rows in (a, b) if index % 2 == 0 else (b, a):
            set_far_rows(library, rows)
            assert far_rows_in_force(library) == rows, "a switch in the environment decides over the choice"
            engine.bundle.suffix_cache.clear()
            "".join(engine.generate(as_messages(item["prompt"]), max_new_tokens=args.max_tokens))
            answers[rows] = list(engine.last_token_ids)
            speed[item["category"]][rows].append(engine.last_stats.tokens_per_second)
        same += answers[a] == answers[b]
        print(index, item["category"], {r: round(speed[item["category"]][r][-1], 1) for r in (a, b)}, flush=True)
    ratios = []
    for category, by_rows in speed.items():
        category_ratios = [y / x for x, y in zip(by_rows[a], by_rows[b])]
        ratios += category_ratios
        print(f"{category:15s} from {b} / from {a}: {statistics.geometric_mean(category_ratios):.3f}")
    print(f"overall from {b} / from {a}: {statistics.geometric_mean(ratios):.3f}; answers equal {same}/{len(items)}")


if __name__ == "__main__":
    main()
