"""Can the drafter run while the target verifies on this CPU?  Per-pass latency with 1 vs 2 threads,
alone and side by side.

Speculative speculative decoding (SSD / Saguaro) hides drafting behind verification by running the two
models at the same time.  On a 2-core laptop that means splitting the cores 1 + 1, so it pays only
if a pass on one thread (while the other core drafts) costs less than the sequential round it
replaces.  This script measures exactly those numbers on the bundle:

* target passes over n = 1..3 new tokens and a drafter step (body + head), each alone with 2 threads
  and with 1 thread;
* the same with both sessions pinned to 1 thread and running concurrently (a drafter loop in a second
  thread while the target passes run): memory-bandwidth contention shows up here;
* the resulting round times for γ = 1, 2: sequential ``γ·draft(2t) + verify(2t)`` against the SSD
  best case ``max(verify(1t, contended), γ·draft(1t, contended))`` (every speculation a cache hit).

    python benchmarks/studies/thread_split.py [BUNDLE] [--head specvocab-r192-k128-of32768]
"""

from __future__ import annotations

import argparse
import threading
import time
from pathlib import Path

import numpy as np

from edge_spec.paths import DEFAULT_BUNDLE
from edge_spec.runtime.engine import Engine

PREFIX = 300  # cache length the passes run at


def load(bundle: Path, threads: int, head: str | None) -> Engine:
    engine = Engine.from_bundle(bundle, threads=threads, mode="ar", draft_head=head)
    engine.bundle.drafter  # load the drafter now
    return engine


def prime(engine: Engine) -> None:
    ids = list(range(1000, 1000 + PREFIX))
    engine.bundle.target.reset()
    engine.bundle.target.forward(ids)
    engine.bundle.drafter.body.reset()
    engine.bundle.drafter.next_logits(ids)


def target_pass(engine: Engine, n: int) -> float:
    started = time.perf_counter()
    engine.bundle.target.forward(list(range(2000, 2000 + n)), n)
    elapsed = time.perf_counter() - started
    engine.bundle.target.rewind(PREFIX)
    return elapsed


def draft_step(engine: Engine) -> float:
    started = time.perf_counter()
    engine.bundle.drafter.next_logits(list(range(1000, 1000 + PREFIX)) + [3000])
    elapsed = time.perf_counter() - started
    engine.bundle.drafter.body.rewind(PREFIX)
    return elapsed


def median_ms(fn, repeats: int) -> float:
    fn()
    return 1e3 * float(np.median([fn() for _ in range(repeats)]))


def contended(engine: Engine, n: int, repeats: int) -> tuple[float, float]:
    """Target passes over n tokens while a drafter loop runs in another thread (both 1-thread sessions)."""
    stop = threading.Event()
    draft_times: list[float] = []

    def drafter_loop() -> None:
        while not stop.is_set():
            draft_times.append(draft_step(engine))

    worker = threading.Thread(target=drafter_loop)
    worker.start()
    time.sleep(0.05)
    target_times = [target_pass(engine, n) for _ in range(repeats)]
    stop.set()
    worker.join()
    return 1e3 * float(np.median(target_times)), 1e3 * float(np.median(draft_times[1:] or draft_times))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle", type=Path, nargs="?", default=DEFAULT_BUNDLE)
    ap.add_argument("--head", default=None)
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    rows = {}
    for threads in (2, 1):
        engine = load(args.bundle, threads, args.head)
        prime(engine)
        rows[threads] = {n: median_ms(lambda: target_pass(engine, n), args.repeats) for n in (1, 2, 3)}
        rows[threads]["draft"] = median_ms(lambda: draft_step(engine), args.repeats)
        if threads == 1:
            rows["1+1"] = {}
            for n in (1, 2, 3):
                rows["1+1"][n], rows["1+1"]["draft"] = contended(engine, n, args.repeats)
    print(f"{'setting':22s} {'target n=1':>10s} {'n=2':>8s} {'n=3':>8s} {'draft step':>10s}   (median ms)")
    labels = {2: "2 threads, alone", 1: "1 thread, alone", "1+1": "1 + 1, side by side"}
    for key, label in labels.items():
        r = rows[key]
        print(f"{label:22s} {r[1]:10.1f} {r[2]:8.1f} {r[3]:8.1f} {r['draft']:10.1f}")
    print("\nround time per emitted round (ms): sequential spec on 2 threads vs SSD best case on 1 + 1")
    for gamma in (1, 2):
        sequential = gamma * rows[2]["draft"] + rows[2][gamma + 1]
        ssd = max(rows["1+1"][gamma + 1], gamma * rows["1+1"]["draft"])
        print(f"γ = {gamma}: sequential {sequential:6.1f}   SSD (all hits) {ssd:6.1f}   ratio {sequential / ssd:5.2f}")


if __name__ == "__main__":
    main()
