"""Greedy answers of one bundle's default mode against another bundle's `ar --exact`, on the bench prompts.

Why: a re-export (another exporter version, another layout of the same target) must not change what the
target says; the default mode is lossless, so its greedy answers on the new bundle must equal the old
bundle's target-only exact answers token for token.

    python benchmarks/bundle_greedy_ab.py NEW_BUNDLE OLD_BUNDLE --per-category 2 --max-tokens 64
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

from edge_spec.runtime.engine import Engine

PROMPTS = Path(__file__).resolve().parents[1] / "edge_spec" / "data" / "bench" / "prompts.jsonl"


def chosen_prompts(per_category: int) -> list[dict]:
    """The first ``per_category`` bench prompts of each category, in file order."""
    seen: dict[str, int] = defaultdict(int)
    chosen = []
    for line in PROMPTS.read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        if seen[row["category"]] < per_category:
            seen[row["category"]] += 1
            chosen.append(row)
    return chosen


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("new_bundle")
    parser.add_argument("old_bundle")
    parser.add_argument("--per-category", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    old = Engine.from_bundle(args.old_bundle, threads=args.threads, mode="ar")
    new = Engine.from_bundle(args.new_bundle, threads=args.threads)
    prompts = chosen_prompts(args.per_category)
    same, seconds, tokens = 0, [0.0, 0.0], [0, 0]
    for row in prompts:
        answers = []
        for i, (engine, settings) in enumerate(((old, {"exact": True}), (new, {}))):
            start = time.perf_counter()
            answers.append(engine.complete(row["prompt"], max_new_tokens=args.max_tokens, **settings).token_ids)
            seconds[i] += time.perf_counter() - start
            tokens[i] += len(answers[-1])
        same += answers[0] == answers[1]
        print(row["category"], "same" if answers[0] == answers[1] else "DIFFERENT", len(answers[0]), flush=True)
    print(
        f"{same}/{len(prompts)} identical; old ar --exact {tokens[0] / seconds[0]:.2f} tok/s, "
        f"new default {tokens[1] / seconds[1]:.2f} tok/s (wall, prefill included)"
    )
    return 0 if same == len(prompts) else 1


if __name__ == "__main__":
    sys.exit(main())
