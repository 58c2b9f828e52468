"""Whether a target's one-token passes give bit for bit the logits its multi-row passes give, here.

Why measured and not assumed: which kernel ONNX Runtime runs for a one-row matmul depends on the CPU
(on AVX-512 VNNI machines ``MatMulNBits`` is row-invariant, on AVX2 ones it has a one-row path that
rounds differently) and on the execution provider.  Greedy speculative decoding promises the answer
of target-only decoding bit for bit, so the runtime pads one-token passes (``Decoder.min_rows``)
unless this check, run through the decoder exactly as the loop runs it, finds one-row passes equal to
multi-row ones.  It only runs for a graph that pads its own attention (``Decoder.pads_attention``):
without that, attention's one-query path differs on every CPU measured.
"""

from __future__ import annotations

import numpy as np

from edge_spec.runtime.model.decoder import Decoder

PROBE_LENGTHS = (40, 300)  # cache lengths the probe decodes at (short and past a prefill's worth of keys)
PROBE_TOKENS = 6  # tokens decoded one at a time, then again in one pass


def one_row_passes_match(
    decoder: Decoder, lengths: tuple[int, ...] = PROBE_LENGTHS, tokens: int = PROBE_TOKENS
) -> bool:
    """Decode ``tokens`` seeded tokens after a cache of each length in ``lengths``: one per pass, in
    passes of two and three rows (kernels may have a path per row count), and all in one pass; True
    when every row's logits are equal bit for bit.  The decoder's cache is reset and its
    ``min_rows`` restored afterwards."""
    return _cuts_agree(decoder, 1, lengths, [[tokens], [1] * tokens, _small_passes(tokens)], seed=0, spare=1)


VERIFY_PASSES = (2, 3, 5, 9, 4, 7)  # verify passes of rounds of 1..8 drafts, each starting where the last ended


def padded_passes_match(
    decoder: Decoder, rows: int, lengths: tuple[int, ...] = PROBE_LENGTHS[:1], sizes: tuple[int, ...] = VERIFY_PASSES
) -> bool:
    """Decode ``sum(sizes)`` seeded tokens after a cache of each length, one per pass and then in passes of
    ``sizes`` (unaligned: each starts where the last ended), every pass padded to ``rows``; True when every
    row's logits are equal bit for bit, the premise of exact greedy speculative decoding.

    Why checked and not assumed: on WebGPU over a real GPU (an H200, real-sized layers), a row's logits
    were found to depend on the pass that carried it whatever the pad, so speculative greedy output
    drifted from ``ar --exact``; the CPU EP and WebGPU over a software driver passed."""
    tokens = sum(sizes)
    return _cuts_agree(decoder, rows, lengths, [[1] * tokens, list(sizes)], seed=1, spare=rows + 1)


def _cuts_agree(
    decoder: Decoder, rows: int, lengths: tuple[int, ...], cuts: list[list[int]], seed: int, spare: int
) -> bool:
    """After a seeded cache of each length, the same seeded tokens decoded cut into passes each way in
    ``cuts`` (the first is the reference), every pass padded to ``rows``: True when every cut gives every
    row the same logits bit for bit.  ``spare`` slots stay free past the tokens; the decoder's cache is
    reset and its ``min_rows`` restored afterwards."""
    saved = decoder.min_rows
    rng = np.random.default_rng(seed)
    vocab = max(min(decoder.vocab_size, 32000), 2)
    tokens = sum(cuts[0])
    try:
        decoder.min_rows = rows
        for length in lengths:
            length = max(min(length, decoder.capacity - tokens - spare), 1)
            ids = [int(t) for t in rng.integers(0, vocab, length + tokens)]
            decoder.reset()
            decoder.forward(ids[:length])
            reference = logits_by_passes(decoder, ids[length:], cuts[0])
            for sizes in cuts[1:]:
                decoder.rewind(length)
                if not np.array_equal(logits_by_passes(decoder, ids[length:], sizes), reference):
                    return False
        return True
    finally:
        decoder.reset()
        decoder.min_rows = saved


def _small_passes(tokens: int) -> list[int]:
    """Pass sizes of two and three rows covering ``tokens`` (a one-row pass for an odd remainder)."""
    sizes, left = [], tokens
    while left > 1:
        sizes.append(3 if left >= 5 or left == 3 else 2)
        left -= sizes[-1]
    return sizes + [1] * left


def logits_by_passes(decoder: Decoder, ids: list[int], sizes: list[int]) -> np.ndarray:
    """``ids`` appended to the cache in passes of ``sizes`` tokens, every row's logits in order."""
    rows, start = [], 0
    for size in sizes:
        rows.append(decoder.forward(ids[start : start + size], size)["logits"])
        start += size
    return np.concatenate(rows)
