"""What the target graph's attention pad costs a pass, by rows, after a long prompt.

The exported target gives its attention a throw-away query row so that one-row passes can be exact
(``edge_spec.export.graph.attention_pad``).  On ONNX Runtime's attention op, where the device check finds they
are not exact anyway, the pad still costs a row of attention in every pass; the runtime keeps it there because
without it one-row logits part further from multi-row ones.  On edge-spec's native op (no one-query path) the
runtime drops it; this prices what that saves.  This times the same target with the pad and without it (stripped in memory:
``edge_spec.runtime.model.attention_unpad``), in one process, the passes interleaved so that drift hits
both alike: medians in ms.

    python benchmarks/studies/attention_pad_cost.py --bundle BUNDLE --threads 2 --context 2000
"""

from __future__ import annotations

import numpy as np

from edge_spec.bench.interleaved import interleaved_passes, pass_study_parser, random_ids, study_target
from edge_spec.runtime.model import huge_pages
from edge_spec.runtime.model.decoder import Decoder


def main() -> None:
    args = pass_study_parser(__doc__.splitlines()[0], context=2000, rows=[1, 2, 11], repeats=8).parse_args()
    graph, capacity = study_target(args)
    decoders = {
        # takes_turns: each session's threads stop spinning after its pass, so the idle one leaves the cores
        name: Decoder(graph, threads=args.threads, capacity=capacity, attention_pad=pad, takes_turns=True)
        for name, pad in (("padded", True), ("unpadded", False))
    }
    huge_pages.wait_all()  # both timed on the pages they keep
    if not decoders["padded"].pads_attention:
        raise SystemExit("this bundle's target does not pad its attention: nothing to compare")
    rng = np.random.default_rng(0)
    medians = interleaved_passes(decoders, random_ids(rng, args.context), args.rows, args.repeats, rng)
    print(f"{args.context}-token prompt, {args.threads} threads, medians of {args.repeats} passes, ms")
    for rows in args.rows:
        padded, unpadded = (medians[name][rows] * 1e3 for name in ("padded", "unpadded"))
        print(f"{rows:3d} rows: padded {padded:7.1f}, without the pad {unpadded:7.1f}  ({padded / unpadded:.3f}x)")


if __name__ == "__main__":
    main()
