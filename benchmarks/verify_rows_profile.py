"""Where does a verify pass's second, third and fourth row go?  ORT's profiler, by projection and bit width.

The schedule prices a round by the target's pass over ``γ + 1`` rows (``cost_profile``); this says which
nodes make a row dear.  The bundle's target (``Decoder``, as the engine runs it) reads a 60-token prompt,
then runs passes over 1..``--rows`` tokens, interleaved and rolled back after each, ``--steps`` times;
each node's kernel time is the median over its calls for that row count (single calls spike on a shared
machine), summed per MatMulNBits role and bit width (``down/8bit``: the carried Q6_K down projections) or
per op type.

    python benchmarks/verify_rows_profile.py [--bundle DIR] [--threads 2] [--steps 40] [--rows 4]
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import numpy as np  # noqa: E402
import onnx  # noqa: E402

from edge_spec.manifest import read_manifest  # noqa: E402
from edge_spec.paths import DEFAULT_BUNDLE  # noqa: E402
from profile_step import parse_profile, profiled_decoder, role_of  # noqa: E402


def matmul_bits(onnx_path: Path) -> dict[str, int]:
    model = onnx.load(str(onnx_path), load_external_data=False)
    return {node.name: next(a.i for a in node.attribute if a.name == "bits")
            for node in model.graph.node if node.op_type == "MatMulNBits"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundle", type=Path, default=DEFAULT_BUNDLE)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40, help="passes of each row count")
    parser.add_argument("--rows", type=int, default=4, help="longest pass (rows 1..this)")
    parser.add_argument("--top", type=int, default=14, help="how many groups to list")
    args = parser.parse_args()

    onnx_path = args.bundle / read_manifest(args.bundle)["target"]["onnx"]
    decoder = profiled_decoder(onnx_path, args.threads)
    decoder.reset()
    decoder.forward(list(range(100, 160)))
    row_counts = range(1, args.rows + 1)
    order = []
    for step in range(args.steps):
        for rows in row_counts:
            decoder.forward([1000 + step] * rows, rows)
            decoder.rewind(decoder.length - rows)
            order.append(rows)
    runs = parse_profile(Path(decoder.session.end_profiling()))[1:]  # the prompt's pass first
    if len(runs) != len(order):
        raise SystemExit(f"expected {len(order)} passes in the profile, found {len(runs)}")

    bits = matmul_bits(onnx_path)
    calls: dict[int, dict[tuple[str, str], list[float]]] = {r: defaultdict(list) for r in row_counts}
    walls: dict[int, list[float]] = {r: [] for r in row_counts}
    for rows, run in zip(order, runs):
        walls[rows].append(run["dur"])
        for node, op, duration in run["kernels"]:
            calls[rows][node, op].append(duration)
    groups: dict[int, dict[str, float]] = {r: defaultdict(float) for r in row_counts}
    for rows in row_counts:
        for (node, op), durations in calls[rows].items():
            group = f"{role_of(node)}/{bits[node]}bit" if op == "MatMulNBits" else op
            groups[rows][group] += float(np.median(durations)) / 1e3

    print(f"{onnx_path}, {args.threads} threads, {args.steps} passes of each row count (medians, ms)")
    header = f"{'':<34}" + "".join(f"{r:>6} row{'s' if r > 1 else ' '}" for r in row_counts)
    print(header)
    print(f"{'pass (model_run)':<34}" + "".join(f"{np.median(walls[r]) / 1e3:10.2f}" for r in row_counts))
    print(f"{'sum of node medians':<34}" + "".join(f"{sum(groups[r].values()):10.2f}" for r in row_counts))
    for group in sorted(groups[1], key=lambda g: -groups[1][g])[:args.top]:
        print(f"{group:<34}" + "".join(f"{groups[r][group]:10.3f}" for r in row_counts))


if __name__ == "__main__":
    main()
