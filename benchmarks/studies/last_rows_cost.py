"""What running the last layer's tail on the asked rows alone saves a prompt pass (``runtime.model.last_rows``).

The same target loaded twice in one process, with the cut moved up (the runtime's default where the native
``MatMulGGUF`` runs) and as exported; each reads the same context, then both time passes of ``--rows`` new
tokens asking for one row of logits (a prompt read's passes), in turns, the order alternating.  Each
session's threads stop spinning after its pass.  Medians in seconds.

    python benchmarks/studies/last_rows_cost.py --bundle BUNDLE --threads 2 --context 1024 --rows 512
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from edge_spec.bench.interleaved import interleaved_passes, random_ids
from edge_spec.manifest import read_manifest
from edge_spec.runtime.loaded import set_bundle_kernels  # the prefetch choices a load of the bundle sets
from edge_spec.runtime.model import decoder as decoder_module
from edge_spec.runtime.model import huge_pages
from edge_spec.runtime.model.decoder import Decoder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundle", type=Path, required=True)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--context", type=int, default=1024, help="tokens in the cache before each timed pass")
    parser.add_argument("--rows", type=int, default=512, help="tokens a timed pass reads")
    parser.add_argument("--repeats", type=int, default=16)
    args = parser.parse_args()
    manifest = read_manifest(args.bundle)
    set_bundle_kernels(manifest)
    graph = args.bundle / manifest["target"]["onnx"]
    capacity = manifest["context_length"]
    if args.context + args.rows > capacity:
        raise SystemExit(f"--context plus --rows must fit the bundle's context of {capacity} tokens")
    cut = Decoder(graph, threads=args.threads, capacity=capacity, takes_turns=True)
    moving = decoder_module.cut_rows_early
    decoder_module.cut_rows_early = lambda model: 0  # the graph's cut where the exporter put it
    try:
        whole = Decoder(graph, threads=args.threads, capacity=capacity, takes_turns=True)
    finally:
        decoder_module.cut_rows_early = moving
    huge_pages.wait_all()  # both timed on the pages they keep
    rng = np.random.default_rng(0)
    medians = interleaved_passes(
        {"cut": cut, "whole": whole}, random_ids(rng, args.context), [args.rows], args.repeats, rng, logit_rows=1
    )
    cut_s, whole_s = (medians[name][args.rows] for name in ("cut", "whole"))
    print(f"{args.rows}-token passes after {args.context} tokens, {args.threads} threads, medians of {args.repeats}, s")
    print(f"  the last layer on every row {whole_s:.3f}, on the asked row alone {cut_s:.3f}  ({whole_s / cut_s:.3f}x)")


if __name__ == "__main__":
    main()
