"""How ORT's thread spinning should be set for sessions that take turns on the same cores.

A speculative round alternates a drafter step (many small ops) and a target pass (a few large ones) on
the same cores, each session with its own pool of ORT worker threads.  Three policies:

* ``sleep``  -- workers never spin: every op of a pass wakes them (what the engine used to do);
* ``turns``  -- workers spin between a pass's ops and stop when the pass ends (``set_spinning(opts,
  takes_turns=True)``, what the engine does now);
* ``spin``   -- workers spin on after a pass too (ORT's default, right for a lone session): the idle
  session's threads then spin on the cores the other session's pass needs.

Each policy loads the target and the drafter body afresh, then times drafter steps and target passes
over 1..5 rows alternately, as rounds run them (median of ``--repeats``), and the policies take turns
``--rounds`` times, so that a drift of the machine reaches them all alike.

    python benchmarks/studies/thread_spinning.py [BUNDLE] --threads 2
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

from edge_spec.manifest import read_manifest
from edge_spec.paths import DEFAULT_BUNDLE
from edge_spec.runtime.loaded import set_bundle_kernels
from edge_spec.runtime.model import decoder as decoder_module
from edge_spec.runtime.model.decoder import Decoder

POLICIES = {
    "sleep": {"session.intra_op.allow_spinning": "0"},
    "turns": {"session.intra_op.allow_spinning": "1", "session.force_spinning_stop": "1"},
    "spin": {"session.intra_op.allow_spinning": "1", "session.force_spinning_stop": "0"},
}
ROWS = (1, 2, 3, 4, 5)
CONTEXT = 200


def decoder(path: Path, threads: int, policy: str) -> Decoder:
    """A decoder whose session spins as ``policy`` says (in place of the engine's own choice)."""

    def spinning(opts: ort.SessionOptions, takes_turns: bool) -> None:
        for key, value in POLICIES[policy].items():
            opts.add_session_config_entry(key, value)

    original = decoder_module.set_spinning
    decoder_module.set_spinning = spinning
    try:
        return Decoder(path, threads=threads, capacity=1024)
    finally:
        decoder_module.set_spinning = original


def time_policy(bundle: Path, threads: int, policy: str, repeats: int) -> dict:
    manifest = read_manifest(bundle)
    set_bundle_kernels(manifest)  # the prefetch choices a load of the bundle sets
    target = decoder(bundle / manifest["target"]["onnx"], threads, policy)
    drafter = decoder(bundle / manifest["draft"]["onnx"], threads, policy)
    filler = list(range(100, 100 + CONTEXT))
    target.forward(filler, 1)
    drafter.forward(filler, 1)
    passes: dict[int, list[float]] = {n: [] for n in ROWS}
    steps: list[float] = []
    for _ in range(repeats):
        for n in ROWS:
            started = time.perf_counter()
            drafter.forward([5], 1)
            steps.append(time.perf_counter() - started)
            drafter.rewind(CONTEXT)
            started = time.perf_counter()
            target.forward([7] * n, 1)
            passes[n].append(time.perf_counter() - started)
            target.rewind(CONTEXT)
    del target, drafter
    gc.collect()
    return {
        "target_ms": {n: 1e3 * float(np.median(t)) for n, t in passes.items()},
        "drafter_step_ms": 1e3 * float(np.median(steps)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle", type=Path, nargs="?", default=DEFAULT_BUNDLE)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--rounds", type=int, default=2, help="times every policy is timed, in turns")
    ap.add_argument("--output", type=Path)
    args = ap.parse_args()
    results: dict[str, list[dict]] = {policy: [] for policy in POLICIES}
    for _ in range(args.rounds):
        for policy in POLICIES:
            results[policy].append(time_policy(args.bundle, args.threads, policy, args.repeats))
    print(f"ms, {args.threads} threads, median of {args.repeats} alternating drafter steps and target passes")
    print(f"{'policy':8s} {'drafter step':>13s} " + " ".join(f"{f'target {n}':>9s}" for n in ROWS))
    for policy, runs in results.items():
        for run in runs:
            print(
                f"{policy:8s} {run['drafter_step_ms']:13.1f} " + " ".join(f"{run['target_ms'][n]:9.1f}" for n in ROWS)
            )
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
