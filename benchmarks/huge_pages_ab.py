"""Decode speed with the models on 2 MiB pages against 4 KiB pages (``runtime/model/huge_pages.py``).

The page size is fixed when a process allocates, so the two sides cannot share a process: each run is a
fresh child process (``EDGE_SPEC_HUGE_PAGES=1`` or ``0``), the two kinds alternating, so that drift on a
shared machine falls on both alike.  A child loads the bundle, waits for the promotion, answers the
prompts in target-only ``ar`` (an engine loaded for it alone) and in the default speculative mode, and
reports decode tokens/s; the answers must be identical across all runs (the pages change nothing else).

    python benchmarks/huge_pages_ab.py [--bundle B] [--runs 4] [--per-category 2] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def child(args: argparse.Namespace) -> None:
    from edge_spec.bench.runs import load_bench_prompts
    from edge_spec.prompts import as_messages
    from edge_spec.runtime.engine import Engine
    from edge_spec.runtime.model import huge_pages

    engines = {
        "ar": Engine.from_bundle(args.bundle, threads=args.threads, mode="ar"),
        "spec": Engine.from_bundle(args.bundle, threads=args.threads, mode="spec"),
    }  # the CLI default
    for engine in engines.values():
        engine.complete("warm up", max_new_tokens=4)
    moved = huge_pages.wait_all()
    items = load_bench_prompts(None, None, args.per_category)
    result = {
        "collapsed_mib": moved.collapsed >> 20,
        "advised_mib": moved.advised >> 20,
        "answers": {},
        "tokens_per_second": {},
    }
    for name, engine in engines.items():
        tokens, seconds, answers = 0, 0.0, []
        for item in items:
            completion = engine.complete(as_messages(item["prompt"]), max_new_tokens=args.max_tokens)
            tokens += completion.stats.new_tokens
            seconds += completion.stats.decode_seconds
            answers.append(completion.token_ids)
        result["tokens_per_second"][name] = tokens / seconds
        result["answers"][name] = answers
    print(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundle", type=Path, default=None)
    parser.add_argument("--runs", type=int, default=4, help="runs of each kind, alternating")
    parser.add_argument("--per-category", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.bundle is None:
        from edge_spec.paths import DEFAULT_BUNDLE

        args.bundle = DEFAULT_BUNDLE
    if args.child:
        child(args)
        return
    runs: dict[str, list[dict]] = {"huge": [], "small": []}
    command = [
        sys.executable,
        __file__,
        "--child",
        "--bundle",
        str(args.bundle),
        "--per-category",
        str(args.per_category),
        "--max-tokens",
        str(args.max_tokens),
        "--threads",
        str(args.threads),
    ]
    for index in range(2 * args.runs):
        kind = ("huge", "small")[index % 2] if index // 2 % 2 == 0 else ("small", "huge")[index % 2]
        env = dict(os.environ, EDGE_SPEC_HUGE_PAGES="1" if kind == "huge" else "0")
        out = subprocess.run(command, env=env, capture_output=True, text=True, check=True).stdout
        run = json.loads(out.strip().splitlines()[-1])
        runs[kind].append(run)
        print(
            f"run {index + 1} ({kind} pages, {run['collapsed_mib']} of {run['advised_mib']} MiB collapsed): "
            + ", ".join(f"{name} {tps:.1f} tok/s" for name, tps in run["tokens_per_second"].items()),
            flush=True,
        )
    reference = runs["small"][0]["answers"]
    same = all(run["answers"] == reference for kind in runs.values() for run in kind)
    for name in ("ar", "spec"):
        huge = statistics.median(r["tokens_per_second"][name] for r in runs["huge"])
        small = statistics.median(r["tokens_per_second"][name] for r in runs["small"])
        paired = [
            h["tokens_per_second"][name] / s["tokens_per_second"][name] for h, s in zip(runs["huge"], runs["small"])
        ]
        print(
            f"{name}: huge pages {huge:.1f} tok/s, small pages {small:.1f} tok/s (medians): {huge / small:.3f}x; "
            f"per back-to-back pair: median {statistics.median(paired):.3f}x, {min(paired):.3f}-{max(paired):.3f}x"
        )
    print(f"answers identical in every run: {same}")


if __name__ == "__main__":
    main()
