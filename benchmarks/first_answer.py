"""Time to the first answer of a new install: ``edge-spec generate`` as a user runs it, from the process start
to its first byte of answer, and the answer's decode speed, for the first run and for the warm runs after it.

The first run is whatever state the caches are in (after ``edge-spec export`` they hold its measurement of the
machine; ``--fresh-cache`` gives every first run an empty cache of its own, ``--start-cache DIR`` a copy of
``DIR``, e.g. the cache directory as an export left it); the warm runs follow it with the same caches.  Runs alternate first/warm in rounds (``--rounds``), so a drift of the machine's speed falls on both.

    python benchmarks/first_answer.py --edge-spec .venv/bin/edge-spec --rounds 3 --fresh-cache
    python benchmarks/first_answer.py --edge-spec VENV/bin/edge-spec --start-cache SAVED_CACHE --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

STATS = re.compile(r"\[(\d+) tokens, ([\d.]+) tok/s")
PROMPT = "Write a Python function that checks whether a number is prime."


def run_once(command: list[str], env: dict[str, str]) -> dict:
    """One ``generate``: seconds to the first byte on stdout (the answer streams there), total seconds, and the
    stats line's tokens and tok/s (stderr)."""
    started = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    first = process.stdout.read(1)
    first_byte = time.perf_counter() - started if first else None
    rest, err = process.communicate()
    total = time.perf_counter() - started
    if process.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed ({process.returncode}):\n{err.decode(errors='replace')}")
    found = STATS.findall(err.decode(errors="replace"))
    tokens, rate = found[-1] if found else (0, 0.0)
    return {
        "first_byte_s": first_byte,
        "total_s": total,
        "tokens": int(tokens),
        "tok_s": float(rate),
        "answer": (first + rest).decode(errors="replace"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--edge-spec", default="edge-spec", help="the edge-spec executable (a venv's bin/edge-spec)")
    parser.add_argument("--bundle", default=None, help="bundle path (default: the default bundle)")
    parser.add_argument("--prompt", default=PROMPT)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=0, help="0: the default (as a user runs it)")
    parser.add_argument("--rounds", type=int, default=3, help="first runs (each followed by --warm warm runs)")
    parser.add_argument("--warm", type=int, default=1, help="warm runs after each first run")
    parser.add_argument("--fresh-cache", action="store_true", help="an empty cache directory for every first run")
    parser.add_argument("--start-cache", type=Path, default=None, help="every first run starts on a copy of this cache")
    parser.add_argument("--output", type=Path, default=None, help="write every run as JSON here")
    args = parser.parse_args()

    command = [args.edge_spec, "generate"] + ([args.bundle] if args.bundle else [])
    command += [args.prompt, "--max-tokens", str(args.max_tokens)]
    command += ["--threads", str(args.threads)] if args.threads else []
    runs = []
    for round_ in range(args.rounds):
        env = dict(os.environ)
        if args.fresh_cache or args.start_cache:
            env["EDGE_SPEC_CACHE"] = tempfile.mkdtemp(prefix="edge-spec-first-answer-")
            if args.start_cache:
                shutil.copytree(args.start_cache, env["EDGE_SPEC_CACHE"], dirs_exist_ok=True)
        for i in range(1 + args.warm):
            record = {"round": round_, "kind": "first" if i == 0 else "warm", **run_once(command, env)}
            runs.append(record)
            print(
                f"round {round_} {record['kind']:5s}: first byte {record['first_byte_s']:.2f} s, "
                f"{record['tokens']} tokens at {record['tok_s']:.1f} tok/s, total {record['total_s']:.1f} s",
                flush=True,
            )
    summary = {}
    for kind in ("first", "warm"):
        chosen = [r for r in runs if r["kind"] == kind]
        if chosen:
            firsts = [r["first_byte_s"] for r in chosen]
            summary[kind] = {
                "runs": len(chosen),
                "first_byte_s": {"min": min(firsts), "median": statistics.median(firsts), "max": max(firsts)},
                "tok_s_mean": statistics.fmean(r["tok_s"] for r in chosen),
            }
    if "first" in summary and "warm" in summary:
        summary["first_over_warm_tok_s"] = summary["first"]["tok_s_mean"] / summary["warm"]["tok_s_mean"]
        same = all(r["answer"] == runs[0]["answer"] for r in runs)
        summary["answers_equal"] = same
    print(json.dumps(summary, indent=2))
    if args.output:
        args.output.write_text(json.dumps({"command": command, "runs": runs, "summary": summary}, indent=2))


if __name__ == "__main__":
    sys.exit(main())
