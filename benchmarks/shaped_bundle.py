"""A bundle with a real bundle's shapes and seeded random weights, for timing a machine whose weights cannot
travel to it (a lent GPU machine with no network and a 64 MiB upload, say).

A pass's cost depends on the shapes (layers, widths, heads, vocabulary, quantization), not on the values, so
the row-cost curve and the drafter step measured on this bundle are the ones the real pair would see there;
replaying the real pair's recorded answers at those prices (``studies/round_signals.py --analyze ... --machine``)
then says what the schedule makes of that machine.  What it does not give: acceptance (the weights are
random) and the real target's carried-GGUF graph (this one is plain symmetric int4, as a Hugging Face
source exports).

    python benchmarks/shaped_bundle.py --like models/bundles/qwen2.5-coder-1.5b-instruct-int4 --save-shapes shapes/
    python benchmarks/shaped_bundle.py --shapes shapes/ --out /tmp/shaped    # needs no transformers
    edge-spec info /tmp/shaped --costs --provider webgpu --gamma 16

``--save-shapes`` writes the two configs and the tokenizer (xz-compressed, about 1.4 MB), all the second
command needs; ``--layers N`` keeps only N layers of each model (a quick check of the path, not a cost).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from edge_spec.bench.shaped import UnsupportedShapes, build, save_shapes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--like", type=Path, help="a real bundle whose shapes to save (with --save-shapes)")
    parser.add_argument("--save-shapes", type=Path)
    parser.add_argument("--shapes", type=Path, help="a folder --save-shapes wrote")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--context-length", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--accuracy-level", type=int, default=4, help="MatMulNBits accuracy level (as export's)")
    args = parser.parse_args()
    if args.save_shapes:
        save_shapes(args.like, args.save_shapes)
    if args.out:
        started = time.perf_counter()
        try:
            build(
                args.shapes or args.save_shapes,
                args.out,
                args.layers,
                args.context_length,
                args.seed,
                args.accuracy_level,
            )
        except UnsupportedShapes as error:
            raise SystemExit(str(error)) from None
        print(f"bundle {args.out} in {time.perf_counter() - started:.0f} s", flush=True)


if __name__ == "__main__":
    main()
