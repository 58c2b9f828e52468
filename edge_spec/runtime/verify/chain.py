"""Verification of drafted tokens against one target forward pass.

Why it is exact: for every position the emitted token is distributed exactly
as the target model would have sampled it alone (Leviathan et al. 2023, Chen
et al. 2023).  Greedy mode reproduces target-only greedy decoding token for
token.  That guarantee only holds if

* ``target_probs`` and ``draft_probs`` were produced by the same
  :func:`~edge_spec.runtime.verify.sampling.logits_to_probs` settings, and
* ``draft_probs[i]`` is the distribution draft ``i`` was *actually* sampled
  from (full vocabulary; zero outside a reduced drafter head, see
  :func:`~edge_spec.runtime.verify.sampling.scatter_probs`), or None for a
  point mass on draft ``i`` (a draft that is a function of the prefix:
  lookup, the suffix cache, forced tokens), which is never written out as a
  150k-entry row.

:func:`verify_chain` turns the target's logits into probabilities one row at a
time and stops at the first rejection: the rows after it are never needed, and
(γ + 1) x V float64 matrices of 40 MB at γ = 32 would cost more than the
arithmetic (fresh pages on every round).

Row convention: ``target_*[i]`` is the target's prediction for the token
after the prefix plus the first ``i`` drafts, so there are ``γ + 1`` rows for
``γ`` drafts; the last one provides the bonus token when every draft passes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from edge_spec.runtime.verify.coupled import verify_coupled
from edge_spec.runtime.verify.sampling import SamplingParams, row_peaks, row_probs, sample

# Below this residual mass, max(0, p - q) is rounding noise rather than a
# distribution (float64 sums over ~150k entries carry ~1e-11 error).  A
# rejection then happens with probability <= this mass, and falling back to
# p changes the output distribution by at most this much in total variation.
RESIDUAL_MIN_MASS = 1e-9


@dataclass
class VerifyResult:
    """Outcome of verifying one block of drafts."""

    accepted: int  # number of draft tokens accepted
    tokens: list[int]  # accepted drafts + the one correction/bonus token


def verify_greedy(draft_tokens: Sequence[int], target_logits: np.ndarray) -> VerifyResult:
    """Accept drafts while each equals the target's argmax; add one more token.

    The extra token is the target argmax of the first mismatching row (a
    correction) or of row γ (a bonus).  ``np.argmax`` picks the first
    maximum, the same rule target-only greedy decoding uses, so ties can
    never make the two disagree.  Works on logits or probabilities.
    """
    drafts = _token_list(draft_tokens)
    rows = np.asarray(target_logits)
    _check_rows("target_logits", rows, len(drafts) + 1)
    _check_token_range(drafts, rows.shape[-1])
    best = np.argmax(rows, axis=-1)
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == int(best[accepted]):
        accepted += 1
    return VerifyResult(accepted, drafts[:accepted] + [int(best[accepted])])


def verify_speculative(
    draft_tokens: Sequence[int],
    draft_probs: np.ndarray | Sequence[np.ndarray | None],
    target_probs: np.ndarray,
    rng: np.random.Generator,
) -> VerifyResult:
    """Speculative rejection sampling over one block of γ drafts.

    Draft ``x_i`` is accepted with probability ``min(1, p_i(x_i) / q_i(x_i))``.
    At the first rejection a replacement is drawn from
    ``norm(max(0, p_i - q_i))`` and the block ends; if all pass, a bonus
    token is drawn from ``p_γ``.

    Randomness is consumed in a fixed order, independent of the outcome, so
    a seeded run is reproducible and the generator's position after a call
    depends only on γ:

    1. ``rng.random(γ)`` -- one uniform per draft, drawn up front
       (draft ``i`` is accepted iff ``u_i * q_i(x_i) < p_i(x_i)``);
    2. ``rng.random()`` -- exactly one uniform inside :func:`sample` for the
       correction or bonus token.

    That is always ``γ + 1`` uniforms per call.

    Raises ``ValueError`` if a draft has ``q_i(x_i) == 0``: it cannot have
    been sampled from ``q_i``, so the caller passed the wrong distribution
    and the output would no longer follow the target.
    """
    drafts = _token_list(draft_tokens)
    p = np.asarray(target_probs)
    _check_rows("target_probs", p, len(drafts) + 1)
    return _rejection(drafts, _q_rows(draft_probs, len(drafts), p.shape[-1]), p.__getitem__, p.shape[-1], rng)


def _q_rows(draft_probs, gamma: int, vocab: int) -> list[np.ndarray | None]:
    if isinstance(draft_probs, np.ndarray):
        _check_rows("draft_probs", draft_probs, gamma)
    rows = list(draft_probs)
    if len(rows) != gamma:
        raise ValueError(f"draft_probs must have {gamma} rows, got {len(rows)}")
    for row in rows:
        if row is not None and np.shape(row)[-1] != vocab:
            raise ValueError(f"draft_probs vocab {np.shape(row)[-1]} != target_probs vocab {vocab}")
    return rows


def _rejection(
    drafts: list[int],
    q_rows: list[np.ndarray | None],
    target_row: Callable[[int], np.ndarray],
    vocab: int,
    rng: np.random.Generator,
) -> VerifyResult:
    """:func:`verify_speculative` on rows asked for one at a time (``target_row(i)``: p_i), in order,
    none past the first rejection."""
    _check_token_range(drafts, vocab)
    uniforms = rng.random(len(drafts)).tolist()
    for i, token in enumerate(drafts):
        q_row = q_rows[i]
        q_x = 1.0 if q_row is None else float(q_row[token])
        if q_x <= 0.0:
            raise ValueError(
                f"draft {i} (token {token}) has zero drafter probability; "
                "draft_probs must be the distribution it was sampled from"
            )
        p_row = target_row(i)
        if not _accept(uniforms[i], float(p_row[token]), q_x):
            correction = sample(residual_distribution(p_row, q_row, token), rng)
            return VerifyResult(i, drafts[:i] + [correction])
    return VerifyResult(len(drafts), drafts + [sample(target_row(len(drafts)), rng)])


def _accept(u: float, p_x: float, q_x: float) -> bool:
    """u < p/q without dividing: P(accept) = min(1, p/q) for u ~ U[0, 1)."""
    return u * q_x < p_x


def residual_distribution(p: np.ndarray, q: np.ndarray | None, token: int | None = None) -> np.ndarray:
    """``norm(max(0, p - q))``: what to sample after a rejection (``q`` None: a point mass on
    ``token``, whose residual is ``p`` without ``token``: the same array, entry for entry).

    It puts mass exactly where the target wants more than the drafter
    offered, which is what makes the overall output follow ``p``.  A
    rejection implies ``p != q``, hence positive residual mass; if the mass
    is only rounding noise (<= RESIDUAL_MIN_MASS) the residual is
    meaningless, so ``p`` itself is returned (see the constant for why that
    is safe).
    """
    p64 = np.asarray(p, dtype=np.float64)
    if q is None:
        residual = p64.copy()
        residual[token] = 0.0  # p(token) - 1 <= 0: a rejected point mass had p(token) < 1
    else:
        residual = p64 - np.asarray(q, dtype=np.float64)
    np.maximum(residual, 0.0, out=residual)
    mass = float(residual.sum())
    if not mass > RESIDUAL_MIN_MASS:
        return p64 / p64.sum()
    residual /= mass
    return residual


def _token_list(draft_tokens: Sequence[int]) -> list[int]:
    return [int(t) for t in draft_tokens]


def _check_rows(name: str, rows: np.ndarray, expected: int) -> None:
    if rows.ndim != 2 or rows.shape[0] != expected or rows.shape[1] == 0:
        raise ValueError(f"{name} must have shape ({expected}, V), got {rows.shape}")


def _check_token_range(tokens: list[int], vocab_size: int) -> None:
    for token in tokens:
        if not 0 <= token < vocab_size:
            raise ValueError(f"draft token {token} outside vocabulary [0, {vocab_size})")


def verify_chain(
    drafts: list[int],
    q_rows: list[np.ndarray | None],
    rows: np.ndarray,
    params: SamplingParams,
    rng: np.random.Generator,
    position: int,
) -> VerifyResult:
    """Verify one chain of drafts against the target's rows for it (γ + 1 of them, the first predicting
    the token at sequence index ``position``): greedy match, coupled match (``verify.coupled``), or
    rejection sampling against the q rows the drafts were drawn from."""
    if params.greedy:
        return verify_greedy(drafts, rows)
    if params.coupled:
        return VerifyResult(*verify_coupled(drafts, rows, params, position))
    drafts = _token_list(drafts)
    _check_rows("target_logits", rows, len(drafts) + 1)
    peaks = row_peaks(rows)  # every row checked, as a whole-matrix conversion would, before any is used
    q = _q_rows(q_rows, len(drafts), rows.shape[-1])
    return _rejection(drafts, q, lambda i: row_probs(rows[i], peaks[i], params), rows.shape[-1], rng)
