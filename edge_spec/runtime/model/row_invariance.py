"""Whether a target's one-token passes give bit for bit the logits its multi-row passes give, here.

Why measured and not assumed: which kernel ONNX Runtime runs for a one-row matmul depends on the CPU
(on AVX-512 VNNI machines ``MatMulNBits`` is row-invariant, on AVX2 ones it has a one-row path that
rounds differently) and on the execution provider.  Greedy speculative decoding promises the answer
of target-only decoding bit for bit, so the runtime pads one-token passes (``Decoder.min_rows``)
unless this check, run through the decoder exactly as the loop runs it, finds one-row passes equal to
multi-row ones.  It only runs where attention has no one-query path (``Decoder.one_row_attention_exact``:
a graph that pads its own attention, or one whose attention runs on the native op): ORT's one-query path
differs on every CPU measured.

The probes write past what the decoder's cache holds and leave it, and the decoder's pass statistics, as
they were: the engine runs them after an answer (a chat's next turn reuses that cache), and their passes
are no live ones for the cost model.
"""

from __future__ import annotations

import numpy as np

from edge_spec.runtime.model.decoder import Decoder, DecoderStats
from edge_spec.runtime.model.kv_cache import HostKV

PROBE_LENGTHS = (40, 300)  # cache lengths the probe decodes at (short and past a prefill's worth of keys)
PROBE_TOKENS = 6  # tokens decoded one at a time, then again in one pass
COMPUTED = 40  # most probe-cache positions the model computes; a longer probe cache repeats them


def one_row_passes_match(
    decoder: Decoder, lengths: tuple[int, ...] = PROBE_LENGTHS, tokens: int = PROBE_TOKENS
) -> bool:
    """Decode ``tokens`` seeded tokens after a cache of each length in ``lengths``: one per pass, in
    passes of two and three rows (kernels may have a path per row count), and all in one pass; True
    when every row's logits are equal bit for bit.  The decoder's cache and ``min_rows`` are left as
    they were."""
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
    row the same logits bit for bit.  The probe goes past what the cache holds (from its start where
    there is no room for it), with ``spare`` slots free past the tokens; the cache's own positions,
    the decoder's ``min_rows`` and its statistics are left as they were."""
    saved_rows, saved_stats, kept = decoder.min_rows, decoder.stats, decoder.length
    rng = np.random.default_rng(seed)
    vocab = max(min(decoder.vocab_size, 32000), 2)
    tokens = sum(cuts[0])
    if kept + min(lengths) + tokens + spare > decoder.capacity:
        kept = 0  # no room past the cache's content: the probe overwrites it
    ids = [int(t) for t in rng.integers(0, vocab, max(lengths) + tokens)]  # each probe cache a prefix of one
    try:
        decoder.min_rows = rows
        decoder.stats = DecoderStats()  # a check's passes are no live passes
        for length in lengths:
            length = max(min(length, decoder.capacity - kept - tokens - spare), 1)
            _seed_cache(decoder, kept, ids[:length])
            start = decoder.length
            probe = ids[length : length + tokens]
            reference = logits_by_passes(decoder, probe, cuts[0])
            for sizes in cuts[1:]:
                decoder.rewind(start)
                if not np.array_equal(logits_by_passes(decoder, probe, sizes), reference):
                    return False
        return True
    finally:
        decoder.rewind(min(kept, decoder.length))
        decoder.min_rows = saved_rows
        decoder.stats = saved_stats


def _seed_cache(decoder: Decoder, start: int, ids: list[int]) -> None:
    """Fill the cache from position ``start`` with ``len(ids)`` positions.  Where the cache is in host
    memory, the model computes at most :data:`COMPUTED` of them and the rest are copies of their keys and
    values (their tokens repeated): a probe needs a long cache to attend over, not a meaningful one, and a
    prefill of hundreds of tokens takes seconds on a laptop CPU (the 1.5B target's 300-token prefill was
    more than half of its one-row check on a 2-core VM).  The probe's own passes run through the model
    either way; a cache on a device, where slots only move down, is prefilled.  Positions the cache
    already holds (a shorter probe's) are kept."""
    computed = len(ids) if not isinstance(decoder.kv, HostKV) else min(len(ids), COMPUTED)
    held = decoder.tokens[start : start + computed]
    common = next((i for i, (a, b) in enumerate(zip(held, ids)) if a != b), len(held))
    decoder.rewind(start + common)
    if common < computed:
        decoder.forward(ids[common:computed])
    copies = range(len(ids) - computed)
    if copies:
        decoder.kv.move_slots([start + computed + i for i in copies], [start + i % computed for i in copies])
        decoder.tokens.extend(ids[i % computed] for i in copies)


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
