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
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from edge_spec.bench.interleaved import fastest_prefill, interleaved_passes, random_ids  # noqa: E402
from edge_spec.bench.native_builds import build_revision, native_library  # noqa: E402
from edge_spec.manifest import read_manifest  # noqa: E402
from edge_spec.native import build  # noqa: E402
from edge_spec.paths import DEFAULT_BUNDLE  # noqa: E402
from edge_spec.runtime.model import huge_pages  # noqa: E402
from edge_spec.runtime.model.decoder import Decoder  # noqa: E402


def target_with(library: Path, bundle: Path, manifest: dict, threads: int) -> Decoder:
    """The bundle's target with ``library`` as its native ops."""
    with native_library(library):
        return Decoder(
            bundle / manifest["target"]["onnx"],
            threads=threads,
            capacity=manifest["context_length"],
            takes_turns=True,
        )


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
            if len(paths) != 2:
                raise SystemExit("--libraries takes two paths, comma separated")
            # labelled by file name, or by the whole path where the two names are the same
            libraries = {(str(p) if paths[0].name == paths[1].name else p.name): p for p in paths}
        manifest = read_manifest(args.bundle)
        decoders = {name: target_with(lib, args.bundle, manifest, args.threads) for name, lib in libraries.items()}
        huge_pages.wait_all()  # each timed on the pages it keeps
        width = max(22, *(len(name) + 1 for name in libraries))
        rng = np.random.default_rng(0)
        print(f"{args.bundle.name}, {args.threads} threads, medians of {args.repeats} passes, ms")
        for context in (int(c) for c in args.context.split(",")):
            print(
                f"\n{f'after {context} tokens':{width}s}"
                + "".join(f"{n:>4} rows" for n in rows)
                + "   each row past the first"
            )
            medians = interleaved_passes(decoders, random_ids(rng, context), rows, args.repeats, rng)
            for name, seconds in medians.items():
                med = {n: s * 1e3 for n, s in seconds.items()}
                extra = " ".join(f"{(med[n] - med[rows[0]]) / (n - rows[0]):.1f}" for n in rows[1:])
                print(f"{name:{width}s}" + "".join(f"{med[n]:9.1f}" for n in rows) + f"   {extra}")
        if args.prefill:
            print(f"\nreading a {args.prefill}-token prompt in passes of 512, fastest of 3")
            for name, seconds in fastest_prefill(decoders, args.prefill, 3, rng).items():
                print(f"{name:{width}s} {seconds:6.2f} s  ({args.prefill / seconds:.0f} tokens/s)")


if __name__ == "__main__":
    main()
