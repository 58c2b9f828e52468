"""Whether the size of a prompt's passes (``Decoder.prefill_chunk``) changes how fast a long prompt is read.

One target, one process: the same random prompt read from an empty cache in passes of each ``--sizes`` rows,
the sizes in turns (the order reversed every other round, so that a machine speeding up or slowing down falls
on all), the fastest of ``--rounds`` kept.  Passes of two or more rows give the same logits however a prompt
is cut, so only the time and attention's scratch (which grows with a pass's rows) can tell the sizes apart.

    python benchmarks/studies/prefill_chunk.py --bundle BUNDLE --tokens 2048 --sizes 128 256 512 1024 2048
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from edge_spec.bench.interleaved import random_ids
from edge_spec.manifest import read_manifest
from edge_spec.runtime.loaded import set_bundle_kernels  # the prefetch choices a load of the bundle sets
from edge_spec.runtime.model import huge_pages
from edge_spec.runtime.model.decoder import Decoder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundle", type=Path, required=True)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=2048, help="prompt tokens")
    parser.add_argument("--sizes", type=int, nargs="+", default=[128, 256, 512, 1024, 2048], help="rows a pass")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    manifest = read_manifest(args.bundle)
    set_bundle_kernels(manifest)
    if args.tokens + 1 > manifest["context_length"] or min(args.sizes) < 2:
        raise SystemExit(f"--tokens must fit the context of {manifest['context_length']}, --sizes be 2 or more")
    target = Decoder(
        args.bundle / manifest["target"]["onnx"], threads=args.threads, capacity=manifest["context_length"]
    )
    prompt = random_ids(np.random.default_rng(0), args.tokens)
    huge_pages.wait_all()
    target.prefill(prompt[:64])  # warm-up
    seconds: dict[int, list[float]] = {size: [] for size in args.sizes}
    for round_ in range(args.rounds):
        for size in args.sizes if round_ % 2 == 0 else args.sizes[::-1]:
            target.reset()
            target.prefill_chunk = size
            started = time.perf_counter()
            target.prefill(prompt)
            seconds[size].append(time.perf_counter() - started)
    for size in args.sizes:
        runs = " / ".join(f"{s:.2f}" for s in seconds[size])
        print(f"passes of {size:5d} rows: fastest {min(seconds[size]):6.2f} s ({runs})")


if __name__ == "__main__":
    main()
