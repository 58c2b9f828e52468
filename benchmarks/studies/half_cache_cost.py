"""What the native attention op's float16 key/value cache saves a pass, by rows, after a prompt of a given length.

The op rounds keys and values to float16 as it writes them and reads each tile back into float32 scratch
(``edge_spec.runtime.model.native_attention.use_half_cache``): a pass reads half the cache's bytes at the same
arithmetic.  This times the same target with a float32 cache and with a float16 one, in one process, the passes
interleaved so that drift hits both alike (medians in ms), and the reading of the prompt itself (the fastest of
``--prompt-repeats`` reads, in alternating order).

    python benchmarks/studies/half_cache_cost.py --bundle BUNDLE --threads 2 --context 2800
"""

from __future__ import annotations

import numpy as np

from edge_spec.bench.interleaved import (
    fastest_reads,
    interleaved_passes,
    pass_study_parser,
    random_ids,
    study_target,
)
from edge_spec.runtime.model import huge_pages
from edge_spec.runtime.model.decoder import Decoder


def main() -> None:
    parser = pass_study_parser(__doc__.splitlines()[0], context=2800, rows=[1, 2, 5, 9], repeats=20)
    parser.add_argument("--prompt-repeats", type=int, default=2, help="reads of the prompt itself by each")
    args = parser.parse_args()
    graph, capacity = study_target(args)
    decoders = {
        # takes_turns: each session's threads stop spinning after its pass, so the idle one leaves the cores
        name: Decoder(graph, threads=args.threads, capacity=capacity, half_cache=half, takes_turns=True)
        for name, half in (("float32", False), ("float16", True))
    }
    if not decoders["float16"].half_cache:
        raise SystemExit("the native attention op does not run this target's attention here: no float16 cache")
    huge_pages.wait_all()  # both timed on the pages they keep
    rng = np.random.default_rng(0)
    context = random_ids(rng, args.context)
    reads, _ = fastest_reads(decoders, context, args.prompt_repeats)
    medians = interleaved_passes(decoders, context, args.rows, args.repeats, rng)
    print(f"{args.context}-token prompt, {args.threads} threads, medians of {args.repeats} passes, ms")
    for rows in args.rows:
        wide, half = (medians[name][rows] * 1e3 for name in ("float32", "float16"))
        print(f"{rows:3d} rows: float32 cache {wide:7.1f}, float16 cache {half:7.1f}  ({wide / half:.3f}x)")
    wide, half = reads["float32"], reads["float16"]
    print(f"reading the prompt: float32 cache {wide:.2f} s, float16 cache {half:.2f} s  ({wide / half:.3f}x)")


if __name__ == "__main__":
    main()
