"""What one sampled verification of γ copied drafts costs, as the chain loop runs it against the same
arithmetic on whole matrices.

Why: a draft copied from text (prompt lookup, the suffix cache, forced tokens) has a point mass for its
q.  Written out, that is a 151,936-entry float64 row per draft, and the target's γ + 1 rows turned into
probabilities at once are another (γ + 1) x V float64 matrix: 40 MB a round at γ = 32, fresh pages
each time (past glibc's 32 MB mmap threshold).  The loop instead keeps point masses as None and
converts target rows one at a time, none after the first rejection; this times both on synthetic
peaked logits (every draft the row's favourite, so most pass, as copies do) and checks that they give
the same tokens.

    python benchmarks/studies/verify_cost.py --gammas 4,16,32 --runs 30
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from edge_spec.runtime.verify.chain import verify_chain, verify_speculative
from edge_spec.runtime.verify.sampling import SamplingParams, logits_to_probs

VOCAB = 151_936  # Qwen2.5's


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gammas", default="4,16,32", help="drafts per round (comma list)")
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--temperature", type=float, default=0.7)
    args = parser.parse_args()
    params = SamplingParams(temperature=args.temperature)
    data = np.random.default_rng(0)
    for gamma in (int(g) for g in args.gammas.split(",")):
        logits = (data.normal(size=(gamma + 1, VOCAB)) * 2).astype(np.float32)
        logits[np.arange(gamma + 1), data.integers(VOCAB, size=gamma + 1)] += 40
        drafts = [int(t) for t in np.argmax(logits[:gamma], axis=1)]

        def whole() -> object:  # a one-hot row per draft, stacked, and every target row converted
            rows = []
            for token in drafts:
                row = np.zeros(VOCAB)
                row[token] = 1.0
                rows.append(row)
            return verify_speculative(drafts, np.array(rows), logits_to_probs(logits, params), np.random.default_rng(1))

        def by_row() -> object:
            return verify_chain(drafts, [None] * gamma, logits, params, np.random.default_rng(1), 0)

        if whole() != by_row():
            raise SystemExit(f"γ {gamma}: the two verifications disagree")
        for name, fn in (("whole matrices", whole), ("row by row", by_row)):
            times = []
            for _ in range(args.runs):
                started = time.perf_counter()
                fn()
                times.append(time.perf_counter() - started)
            print(f"γ {gamma:2d}  {name:14s}  median {np.median(times) * 1e3:6.2f} ms  min {min(times) * 1e3:6.2f} ms")


if __name__ == "__main__":
    main()
