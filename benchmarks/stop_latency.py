"""How long ``Engine.cancel()`` takes to end an answer: Stop pressed at a random moment of a long answer.

The bundle is loaded once; each of ``--stops`` answers (greedy, a long coding prompt, each stop its own
prompt so that the suffix cache does not turn them into copies of each other) runs in a thread, and the
main thread calls ``engine.cancel()`` a seeded random 0.3 to 2.0 s after the answer's first text chunk.  A stop's
latency is from the ``cancel()`` call to ``generate`` returning (what a Stop button waits for before the
engine is free for the next answer).  Each stop's line also splits it: ``in_pass_s``, the rest of the
model pass (a target pass or a drafter step) under way at the cancel, which the cancel cuts at ONNX
Runtime's next node (a head or a single native-attention node runs to its end); and
``after_pass_s``, from the end of that pass (or the cancel, when none ran) to ``generate`` returning,
which should stay a few milliseconds whatever the load; ``passes_after`` counts the passes started after
the cancel (0, but for a pass SSD has under way in its worker).  One line per stop, then one JSON line:

    python benchmarks/stop_latency.py --bundle models/bundles/qwen2.5-coder-1.5b-instruct-int4 --threads 2 --stops 16
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np

TOPICS = [
    "a red-black tree with insert, delete and in-order iteration",
    "an LRU cache with a size limit in bytes and per-entry expiry",
    "a tokenizer and recursive-descent parser for arithmetic expressions with variables",
    "a thread pool with futures, cancellation and a bounded queue",
    "a trie that supports prefix search, deletion and counting words",
    "a priority queue backed by a binary heap with decrease-key",
    "an INI file reader and writer that keeps comments and ordering",
    "a rate limiter using the token bucket algorithm, safe across threads",
]


def prompt(index: int) -> list[dict[str, str]]:
    topic = TOPICS[index % len(TOPICS)]
    variant = "" if index < len(TOPICS) else f" Name the main class Variant{index // len(TOPICS)}."
    content = (
        f"Write a complete Python module implementing {topic}, with docstrings, type hints and unit tests.{variant}"
    )
    return [{"role": "user", "content": content}]


class PassClock:
    """When each model pass of the engine's target and drafter began and ended (``perf_counter``)."""

    def __init__(self, decoders) -> None:
        self.passes: list[tuple[float, float]] = []
        self._lock = threading.Lock()
        for decoder in decoders:
            decoder.forward = self._timed(decoder.forward)

    def _timed(self, forward):
        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return forward(*args, **kwargs)
            finally:
                with self._lock:
                    self.passes.append((started, time.perf_counter()))

        return timed

    def split(self, cancelled_at: float, returned_at: float) -> dict:
        """The stop's time in the pass under way at ``cancelled_at``, after it, and the passes begun later."""
        with self._lock:
            passes = list(self.passes)
        under_way = [end for start, end in passes if start <= cancelled_at < end]
        pass_end = max(under_way, default=cancelled_at)
        return {
            "in_pass_s": round(pass_end - cancelled_at, 4),
            "after_pass_s": round(returned_at - pass_end, 4),
            "passes_after": sum(start > cancelled_at for start, _ in passes),
        }


def one_stop(engine, clock: PassClock, index: int, delay: float, max_new_tokens: int) -> dict:
    """One answer stopped ``delay`` seconds after its first text chunk (while it decodes, as a reader
    stops it; a stop during a prompt's reading waits for the pass under way)."""
    first_chunk = threading.Event()
    returned: dict[str, float] = {}
    failure: list[BaseException] = []

    def answer() -> None:
        try:
            for _ in engine.generate(prompt(index), max_new_tokens=max_new_tokens, temperature=0.0):
                first_chunk.set()
        except BaseException as error:  # reported by the main thread
            failure.append(error)
        returned["at"] = time.perf_counter()
        first_chunk.set()

    worker = threading.Thread(target=answer, daemon=True)
    worker.start()
    first_chunk.wait()
    time.sleep(delay)
    cancelled_at = time.perf_counter()
    engine.cancel()
    worker.join()
    if failure:
        raise failure[0]
    stats = engine.last_stats
    ended = returned["at"] <= cancelled_at  # the answer ran to its end first: nothing to measure
    return {
        "stop": index,
        "delay_s": round(delay, 3),
        "latency_s": None if ended else round(returned["at"] - cancelled_at, 4),
        "stop_reason": stats.stop_reason,
        "tokens": stats.new_tokens,
        "target_passes": stats.spec.target_calls if stats.spec else None,
        **({} if ended else clock.split(cancelled_at, returned["at"])),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", type=Path, default=None, help="bundle directory (default: the default bundle)")
    ap.add_argument("--threads", type=int, default=0, help="ONNX Runtime threads (0: ORT picks)")
    ap.add_argument("--stops", type=int, default=16, help="answers to stop")
    ap.add_argument("--mode", default=None, help="ar, spec or ssd (default: the engine's default)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the stop moments")
    ap.add_argument("--max-new-tokens", type=int, default=1024)
    args = ap.parse_args()
    if args.stops < 1:
        sys.exit("error: --stops must be at least 1")

    from edge_spec.errors import EdgeSpecError
    from edge_spec.runtime.engine import Engine

    try:
        engine = Engine.from_bundle(args.bundle, threads=args.threads, mode=args.mode)
    except EdgeSpecError as error:
        sys.exit(f"error: {error}")
    engine.complete("def fib(n):", max_new_tokens=8, temperature=0.0)  # the first answer's one-time checks
    clock = PassClock(
        [engine.bundle.target]
        + ([engine.bundle.active_drafter(engine.config).decoder] if engine.config.mode != "ar" else [])
    )
    delays = np.random.default_rng(args.seed).uniform(0.3, 2.0, args.stops)
    stops = []
    for index, delay in enumerate(delays):
        stop = one_stop(engine, clock, index, float(delay), args.max_new_tokens)
        print(json.dumps(stop), flush=True)
        stops.append(stop)
    bundle, mode = str(engine.bundle.bundle_dir), engine.config.mode
    engine.close()
    measured = [s for s in stops if s["stop_reason"] == "cancelled" and s["latency_s"] is not None]
    stopped = [s["latency_s"] for s in measured]
    summary = {
        "bundle": bundle,
        "mode": mode,
        "threads": args.threads,
        "stops": len(stopped),
        "ended_before_stop": len(stops) - len(stopped),
        "latencies_s": stopped,
        "max_s": max(stopped, default=None),
        "p50_s": statistics.median(stopped) if stopped else None,
        "over_0.5_s": sum(latency > 0.5 for latency in stopped),
        "after_pass_max_s": max((s["after_pass_s"] for s in measured), default=None),
        "passes_after_max": max((s["passes_after"] for s in measured), default=None),
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
