"""Where does a verify pass's second, third and fourth row go?  ORT's profiler, by projection and bit width.

The schedule prices a round by the target's pass over ``γ + 1`` rows (``cost_profile``); this says which
nodes make a row dear.  The bundle's target (``Decoder``, as the engine runs it) reads a 60-token prompt,
then runs passes over 1..``--rows`` tokens, interleaved and rolled back after each, ``--steps`` times;
each node's kernel time is the median over its calls for that row count (single calls spike on a shared
machine), summed per MatMulNBits role and bit width (``down/8bit``: the carried Q6_K down projections) or
per op type.

    python benchmarks/verify_rows_profile.py [--bundle DIR] [--threads 2] [--steps 40] [--rows 4]

``--context N`` runs the passes after a prompt of N tokens instead: attention grows with the cache and
with the rows alike, so a long request's passes cost more per row than the profile (taken on a short
cache) says; ``--rows 1,11,17,33`` times only those row counts, as the default ceiling's rounds reach.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from edge_spec.bench.ort_profile import ProfileMismatch, bundle_target, profile_rows
from edge_spec.paths import DEFAULT_BUNDLE


def row_counts(text: str) -> int | list[int]:
    """``--rows``: one number (every count up to it) or a comma list of counts, each at least 1."""
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a row count or a comma list of them: {text!r}") from None
    if min(counts) < 1:
        raise argparse.ArgumentTypeError("row counts start at 1")
    return counts[0] if len(counts) == 1 else counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundle", type=Path, default=DEFAULT_BUNDLE)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40, help="passes of each row count")
    parser.add_argument(
        "--rows", type=row_counts, default=4, help="longest pass (rows 1..this), or a comma list of row counts"
    )
    parser.add_argument("--context", type=int, default=60, help="prompt tokens before the passes")
    parser.add_argument("--top", type=int, default=14, help="how many groups to list")
    args = parser.parse_args()
    if args.context < 1 or args.steps < 1:
        raise SystemExit("--context and --steps must be at least 1")

    onnx_path, kernels = bundle_target(args.bundle)
    try:
        profile = profile_rows(onnx_path, args.threads, args.steps, args.rows, prompt_tokens=args.context)
    except ProfileMismatch as error:
        raise SystemExit(str(error)) from None
    counts = sorted(profile.walls)
    groups = profile.groups

    print(
        f"{onnx_path}, {args.threads} threads, after a {args.context}-token prompt, "
        f"{args.steps} passes of each row count (medians, ms)"
    )
    if kernels:
        print(kernels)
    header = f"{'':<34}" + "".join(f"{r:>6} row{'s' if r > 1 else ' '}" for r in counts)
    print(header)
    print(f"{'pass (model_run)':<34}" + "".join(f"{np.median(profile.walls[r]) / 1e3:10.2f}" for r in counts))
    print(f"{'sum of node medians':<34}" + "".join(f"{sum(groups[r].values()):10.2f}" for r in counts))
    largest = groups[counts[-1]]
    for group in sorted(largest, key=lambda g: -largest[g])[: args.top]:
        print(f"{group:<34}" + "".join(f"{groups[r].get(group, 0.0):10.3f}" for r in counts))


if __name__ == "__main__":
    main()
