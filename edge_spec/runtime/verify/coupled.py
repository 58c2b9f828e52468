"""Coupled sampling: the token at each position is fixed by the seed, whatever drafted it.

The exponential race (the Gumbel-max trick in another form): with ``E_i`` independent Exp(1) draws,
``argmax_i p_i / E_i`` is distributed exactly as ``p``.  Fix the noise of position ``t`` by the
request's seed and ``t`` alone, and the token there is a function of ``p_t`` and the seed; ``p_t``
depends on the tokens before it, which depend only on the noise of earlier positions, so each token
still follows the target's distribution given the prefix -- the whole answer is distributed as the
target samples it, and is *the same answer* target-only decoding gives with that seed.

A drafter draws its token at ``t`` with the same noise (``argmax_i q_i / E_i``), and the verifier
accepts a draft iff it equals the target's choice: verification by matching, as in greedy decoding,
with no q rows and no residual distributions.  The answer no longer depends on γ, the schedule,
lookups or guesses, so two schedules can be compared on the same text.  The price: the two argmaxes
agree less often than rejection sampling accepts, by at most ``(1 - TV) / (1 + TV)`` against
``1 - TV`` (Daliri, Musco and Suresh 2024, "Coupling without communication and drafter-invariant
speculative decoding").
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import numpy as np

from edge_spec.runtime.verify.sampling import SamplingParams, logits_to_probs, sample

# A round reads the noise of the positions it drafts, and its verify pass the same positions again.
_NOISE_CACHE = 24


@lru_cache(maxsize=_NOISE_CACHE)
def position_noise(seed: int, position: int, vocab_size: int) -> np.ndarray:
    """Exp(1) noise for every token id at one sequence position (read-only).

    float64, not float32: numpy's float32 exponentials are exactly 0 about once in 2^24 draws, which
    over a 150k vocabulary is one position in a hundred, and there the token with that zero wins the
    race however unlikely it is.  In float64 that happens once in 2^53 draws."""
    noise = np.random.default_rng([seed, position]).standard_exponential(vocab_size)
    noise.setflags(write=False)
    return noise


def coupled_index(probs: np.ndarray, seed: int, position: int, vocab_size: int, ids: np.ndarray | None = None) -> int:
    """The row the race picks: ``argmax probs / E`` over the rows of ``probs``, whose target ids are
    ``ids`` (None: the full vocabulary in order).  Rows with no mass can never win."""
    noise = position_noise(seed, position, vocab_size)
    return int(np.argmax(probs / (noise if ids is None else noise[ids])))


def draw_sampled(
    probs: np.ndarray,
    params: SamplingParams,
    rng: np.random.Generator | None,
    position: int,
    vocab_size: int,
    ids: np.ndarray | None = None,
) -> int:
    """The row a sampled token takes at sequence index ``position``: the coupled race, or a draw from
    ``probs`` with ``rng`` (rejection sampling, the only case that needs it).  One rule for the target's
    tokens and the drafter's drafts, which must race alike."""
    if params.coupled:
        return coupled_index(probs, params.seed, position, vocab_size, ids)
    return sample(probs, rng)


def verify_coupled(
    draft_tokens: Sequence[int], target_logits: np.ndarray, params: SamplingParams, position: int
) -> tuple[int, list[int]]:
    """Accept drafts while each equals the target's coupled choice at its position; add that choice
    at the first mismatch (or after the last draft).  Row ``i`` of ``target_logits`` predicts the
    token at ``position + i``.  Returns (accepted, tokens); rows past the first mismatch are never
    turned into probabilities."""
    drafts = [int(t) for t in draft_tokens]
    rows = np.asarray(target_logits)
    if rows.ndim != 2 or rows.shape[0] != len(drafts) + 1:
        raise ValueError(f"target_logits must have shape ({len(drafts) + 1}, V), got {rows.shape}")
    vocab = rows.shape[-1]
    for i, row in enumerate(rows):
        choice = coupled_index(logits_to_probs(row, params), params.seed, position + i, vocab)
        if i == len(drafts) or drafts[i] != choice:
            return i, drafts[:i] + [choice]
    raise AssertionError("unreachable: the last row always ends the block")
