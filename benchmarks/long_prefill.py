"""Reading a long prompt in one pass vs in passes of ``--chunk`` tokens: time, peak memory, same logits.

Each setting runs in its own process (peak RSS is per process) on the bundle's target:

    python benchmarks/long_prefill.py [BUNDLE] --tokens 4000 --chunk 512 --threads 2
"""

from __future__ import annotations

import argparse
import hashlib
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from edge_spec.paths import DEFAULT_BUNDLE


def measure(bundle: Path, tokens: int, chunk: int, threads: int) -> dict:
    """One prefill of ``tokens`` random ids in passes of ``chunk`` tokens (this process only)."""
    from edge_spec.manifest import read_manifest
    from edge_spec.runtime.loaded import set_bundle_kernels
    from edge_spec.runtime.model.decoder import Decoder

    manifest = read_manifest(bundle)
    set_bundle_kernels(manifest)  # the prefetch choices a load of the bundle sets
    target = Decoder(bundle / manifest["target"]["onnx"], threads=threads, capacity=manifest["context_length"])
    target.prefill_chunk = chunk
    ids = [int(t) for t in np.random.default_rng(0).integers(100, 20000, tokens)]
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.perf_counter()
    logits = target.prefill(ids)["logits"][-1]
    return {
        "chunk": chunk,
        "seconds": time.perf_counter() - started,
        "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "loaded_mib": before / 1024,
        "logits_sha": hashlib.sha256(logits.tobytes()).hexdigest()[:16],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle", type=Path, nargs="?", default=DEFAULT_BUNDLE)
    ap.add_argument("--tokens", type=int, default=4000)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)  # internal: measure this chunk size and print JSON
    args = ap.parse_args()
    if args.one is not None:
        print(json.dumps(measure(args.bundle, args.tokens, args.one, args.threads)))
        return
    results = []
    for chunk in (args.tokens, args.chunk):  # one pass, then chunks
        run = subprocess.run(
            [
                sys.executable,
                __file__,
                str(args.bundle),
                "--tokens",
                str(args.tokens),
                "--threads",
                str(args.threads),
                "--one",
                str(chunk),
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        results.append(json.loads(run.stdout.strip().splitlines()[-1]))
        r = results[-1]
        print(
            f"passes of {r['chunk']:5d}: {r['seconds']:6.1f} s, peak RSS {r['peak_mib']:.0f} MiB "
            f"(after load {r['loaded_mib']:.0f}), last logits sha256 {r['logits_sha']}"
        )
    one, chunked = results
    print(
        f"chunked / one pass: time {chunked['seconds'] / one['seconds']:.2f}, peak memory "
        f"{chunked['peak_mib'] - one['peak_mib']:+.0f} MiB, logits identical: {one['logits_sha'] == chunked['logits_sha']}"
    )


if __name__ == "__main__":
    main()
