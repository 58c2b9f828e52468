"""Two builds of the native ops on the real target, in one process, their passes interleaved.

A kernel change is measured against the kernel it replaces: each build loads its own copy of the bundle's
target (the native library is registered per session), both read the same prompt, then passes of each row
count alternate between them, so that a neighbour's load on a shared machine falls on both.  Reported: the
median pass by rows and context, what each row past the first adds, and the time to read a long prompt in
passes of 512 (fastest of three).  Sessions stop their threads' spinning after each run, as the
runtime's target and drafter do, so the idle copy does not take the cores of the one that runs.

    python benchmarks/native_ab.py --before REV [--bundle BUNDLE] [--context 256,2800] [--rows 1,2,4,8,16]

``--before REV`` builds the native sources of a git revision (the working tree's build is the other side);
``--libraries A.so,B.so`` compares two built libraries instead.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from edge_spec.manifest import read_manifest  # noqa: E402
from edge_spec.native import build  # noqa: E402
from edge_spec.paths import DEFAULT_BUNDLE  # noqa: E402
from edge_spec.runtime.model.decoder import Decoder  # noqa: E402


def build_revision(revision: str, into: Path) -> Path:
    """The native library built from ``revision``'s sources (``git show``), with the runtime's own flags."""
    names = [build.SOURCE.name, *build.OTHER_SOURCES, *(f"include/{h.name}" for h in build.HEADERS)]
    for name in names:
        text = subprocess.run(
            ["git", "show", f"{revision}:edge_spec/native/{name}"], cwd=ROOT, capture_output=True, check=True
        ).stdout
        (into / name).parent.mkdir(parents=True, exist_ok=True)
        (into / name).write_bytes(text)
    library = into / "before.so"
    sources = [str(into / name) for name in [build.SOURCE.name, *build.OTHER_SOURCES]]
    subprocess.run([build.compiler(), *build.FLAGS, f"-I{into / 'include'}", "-o", str(library), *sources], check=True)
    return library


def random_ids(rng: np.random.Generator, count: int) -> list[int]:
    """``count`` token ids drawn from the vocabulary's common middle (timing does not depend on which)."""
    return [int(t) for t in rng.integers(100, 20000, count)]


def target_with(library: Path, bundle: Path, manifest: dict, threads: int) -> Decoder:
    """The bundle's target with ``library`` as its native ops."""
    chosen = build.library_path
    build.library_path = lambda: library
    try:
        return Decoder(
            bundle / manifest["target"]["onnx"],
            threads=threads,
            capacity=manifest["context_length"],
            takes_turns=True,
        )
    finally:
        build.library_path = chosen


def passes(decoders: list[Decoder], context: int, rows: list[int], repeats: int, rng) -> list[dict[int, float]]:
    """Median ms of a pass of each row count after ``context`` prompt tokens, per decoder."""
    prompt = random_ids(rng, context)
    for decoder in decoders:
        decoder.reset()
        decoder.prefill(prompt)
    times: list[dict[int, list[float]]] = [{n: [] for n in rows} for _ in decoders]
    for _ in range(repeats):
        for n in rows:
            ids = random_ids(rng, n)
            for decoder, timed in zip(decoders, times):
                start = time.perf_counter()
                decoder.forward(ids, n)
                timed[n].append(time.perf_counter() - start)
                decoder.rewind(context)
    return [{n: statistics.median(t[n]) * 1e3 for n in rows} for t in times]


def prefill_seconds(decoders: list[Decoder], tokens: int, repeats: int, rng) -> list[float]:
    """Fastest read of a ``tokens``-token prompt (passes of 512), per decoder, the decoders taking turns."""
    prompt = random_ids(rng, tokens)
    best = [float("inf")] * len(decoders)
    for _ in range(repeats):
        for i, decoder in enumerate(decoders):
            decoder.reset()
            start = time.perf_counter()
            decoder.prefill(prompt)
            best[i] = min(best[i], time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundle", type=Path, default=DEFAULT_BUNDLE)
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--before", help="a git revision whose native sources are the other side")
    which.add_argument("--libraries", help="two built libraries, comma separated")
    parser.add_argument("--context", default="256,2800", help="prompt tokens before the timed passes (comma list)")
    parser.add_argument("--rows", default="1,2,4,8,16")
    parser.add_argument("--repeats", type=int, default=12, help="passes of each row count per build")
    parser.add_argument("--prefill", type=int, default=2000, help="tokens of the timed prompt read (0: none)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    rows = [int(n) for n in args.rows.split(",")]
    with tempfile.TemporaryDirectory(prefix="edge-spec-native-ab-") as scratch:
        if args.before:
            current = build.library_path()
            if current is None:
                raise SystemExit("the native ops do not build here")
            libraries = {f"{args.before} (before)": build_revision(args.before, Path(scratch)), "working tree": current}
        else:
            paths = [Path(p) for p in args.libraries.split(",")]
            libraries = {p.name: p for p in paths}
        manifest = read_manifest(args.bundle)
        decoders = [target_with(lib, args.bundle, manifest, args.threads) for lib in libraries.values()]
        rng = np.random.default_rng(0)
        for decoder in decoders:  # page the weights in before anything is timed
            decoder.prefill(random_ids(rng, 64))
        print(f"{args.bundle.name}, {args.threads} threads, medians of {args.repeats} passes, ms")
        for context in (int(c) for c in args.context.split(",")):
            print(
                f"\nafter {context} tokens    " + "".join(f"{n:>4} rows" for n in rows) + "   each row past the first"
            )
            for name, med in zip(libraries, passes(decoders, context, rows, args.repeats, rng)):
                extra = " ".join(f"{(med[n] - med[rows[0]]) / (n - rows[0]):.1f}" for n in rows[1:])
                print(f"{name:22s}" + "".join(f"{med[n]:9.1f}" for n in rows) + f"   {extra}")
        if args.prefill:
            print(f"\nreading a {args.prefill}-token prompt in passes of 512, fastest of 3")
            for name, seconds in zip(libraries, prefill_seconds(decoders, args.prefill, 3, rng)):
                print(f"{name:22s} {seconds:6.2f} s  ({args.prefill / seconds:.0f} tokens/s)")


if __name__ == "__main__":
    main()
