"""Which target pass sizes give each row the same logits bit for bit on an execution provider.

Exact greedy speculative decoding pads every target pass to ``providers.exact_min_rows`` rows and
assumes that every pass of at least that many rows computes each row the same way; a provider whose
kernels switch paths at some row count (tiles of 8 or 16 rows, say) breaks that for drafts that reach
it.  ``benchmarks/ep_exactness.py`` groups pass sizes into classes with these functions on the
provider at hand; grouping is kept apart from decoding so that it is tested on the CPU EP.
"""

from __future__ import annotations

import numpy as np

from edge_spec.runtime.model.decoder import Decoder
from edge_spec.runtime.model.row_invariance import logits_by_passes


def logits_by_pass_size(
    decoder: Decoder, sizes: tuple[int, ...], tokens: int, context: int = 40, pad_to: int = 1
) -> dict[int, np.ndarray]:
    """Each row's logits when ``tokens`` seeded tokens after a ``context``-token prefill are decoded in
    passes of each size, padded to ``pad_to`` rows as exact passes are (the rows a size cannot cover
    whole are left out)."""
    rng = np.random.default_rng(0)
    vocab = min(decoder.vocab_size, 32000)
    ids = [int(t) for t in rng.integers(0, vocab, context + tokens)]
    decoder.min_rows = pad_to
    out = {}
    for size in sizes:
        decoder.reset()
        decoder.forward(ids[:context], 1)
        out[size] = logits_by_passes(decoder, ids[context:], [size] * (tokens // size))
    return out


def row_classes(results: dict[int, np.ndarray]) -> list[list[int]]:
    """Pass sizes grouped so that sizes in one group give every row they share the same logits bit for bit."""
    classes: list[list[int]] = []
    for size, rows in results.items():
        for group in classes:
            first = results[group[0]]
            n = min(len(rows), len(first))
            if np.array_equal(rows[:n], first[:n]):
                group.append(size)
                break
        else:
            classes.append([size])
    return classes
