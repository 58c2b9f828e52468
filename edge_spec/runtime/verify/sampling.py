"""Pure-numpy sampling math shared by the drafter and the verifier.

Why this is its own model-free module: lossless speculative sampling only
works if the target distribution ``p`` and the drafter distribution ``q`` are
produced by *exactly* the same transformation (temperature, then top-k, then
top-p) and if ``q`` is the distribution the draft token was really drawn from.
Keeping that transformation in one small place means both sides call the same
code and the math can be tested without any model or ONNX Runtime session.

Conventions:

* logits arrive as float32 rows of length ``V`` (1-D = one position, 2-D =
  one row per position); probabilities leave as float64, because the
  acceptance test divides small probabilities and the residual ``max(0, p-q)``
  subtracts nearly equal ones.
* ties are resolved towards the lowest token id (``np.argmax``) and, in top-k
  and top-p, every token tied with the cut-off value is kept.  Both rules are
  deterministic, so the same logits always give the same distribution.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass

import numpy as np

from edge_spec.errors import EdgeSpecError

SAMPLERS = ("rejection", "coupled")

# Top-p first looks at this many of the largest probabilities and widens the
# window only when their mass is below top_p.  Real LLM distributions put the
# nucleus in a few dozen tokens, so a full 151936-element sort is rare.
_TOP_P_FIRST_WINDOW = 64
_TOP_P_GROWTH = 8

# sample() finds the block first, then the token inside it, for rows longer
# than 4 blocks: np.cumsum over 150k float64 entries costs ~0.7 ms.
_SAMPLE_BLOCK = 1024
_BELOW_ONE = float(np.nextafter(1.0, 0.0))


class NonFiniteLogits(ValueError):
    """Logits (or probabilities) with NaN/inf: a model computed garbage (damaged weights)."""


@dataclass(frozen=True)
class SamplingParams:
    """How to turn logits into the distribution a token is drawn from.

    ``temperature <= 0`` means greedy decoding; ``top_k = 0`` and
    ``top_p = 1`` disable those filters.  ``seed`` makes a run reproducible.  Invalid values raise :class:`EdgeSpecError`
    because they come straight from the user (CLI flags, config files).

    ``sampler`` says how a sampled token is drawn.  ``"rejection"`` (the default): each draw takes the
    next uniforms of the request's stream, and drafts pass by rejection sampling, so the answer depends
    on how the rounds fell.  ``"coupled"`` (``verify.coupled``): the token at each position is the
    argmax of ``p / E`` for exponential noise ``E`` fixed by (seed, position), so the answer is a
    function of the seed alone -- the same whatever drafted it, and equal to target-only decoding with
    that seed -- at some cost in acceptance.  Without a seed, a coupled request draws one.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    end_ids: frozenset[int] = frozenset()  # tokens that end the answer: no draft after one can be emitted
    sampler: str = "rejection"

    def __post_init__(self) -> None:
        _check_temperature(self.temperature)
        _check_top_k(self.top_k)
        _check_top_p(self.top_p)
        _check_seed(self.seed)
        if self.sampler not in SAMPLERS:
            raise EdgeSpecError(f"sampler must be one of {', '.join(SAMPLERS)}, not {self.sampler!r}")
        if self.coupled and self.seed is None:  # the noise needs a seed; frozen, hence object.__setattr__
            object.__setattr__(self, "seed", secrets.randbits(63))

    @property
    def greedy(self) -> bool:
        """True when decoding is deterministic argmax (temperature <= 0)."""
        return self.temperature <= 0.0

    @property
    def coupled(self) -> bool:
        """Sampling whose token at each position is fixed by (seed, position) (see the class docstring)."""
        return self.sampler == "coupled" and not self.greedy

    @property
    def deterministic(self) -> bool:
        """Each token is a function of its distribution (and the seed and position): greedy or coupled.
        Drafts then pass when they equal it, and need no q rows."""
        return self.greedy or self.coupled

    @property
    def regime(self) -> str:
        """How drafts are verified, which sets how often they pass: "greedy", "coupled" or "sampled"."""
        return "greedy" if self.greedy else "coupled" if self.coupled else "sampled"


def _is_real(value: object) -> bool:
    # bool is an int subclass, but "temperature=True" is a mistake, not 1.0.
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)


def _is_int(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _check_temperature(temperature: object) -> None:
    if not _is_real(temperature) or not math.isfinite(temperature) or temperature < 0:
        raise EdgeSpecError(f"temperature must be a finite number >= 0 (0 means greedy), got {temperature!r}")


def _check_top_k(top_k: object) -> None:
    if not _is_int(top_k) or top_k < 0:
        raise EdgeSpecError(f"top_k must be an integer >= 0 (0 disables it), got {top_k!r}")


def _check_top_p(top_p: object) -> None:
    if not _is_real(top_p) or not (0.0 < top_p <= 1.0):
        raise EdgeSpecError(f"top_p must be in (0, 1] (1 disables it), got {top_p!r}")


def _check_seed(seed: object) -> None:
    if seed is not None and (not _is_int(seed) or seed < 0):
        raise EdgeSpecError(f"seed must be a non-negative integer or unset, got {seed!r}")


# ---------------------------------------------------------------------------
# logits -> probabilities
# ---------------------------------------------------------------------------


def mask_logits(logits: np.ndarray, allowed: np.ndarray | None) -> np.ndarray:
    """``logits`` with every entry where ``allowed`` is False set to -inf (a new array; ``allowed`` None:
    the logits themselves).  A constraint's mask goes in *before* :func:`logits_to_probs`, so temperature,
    top-k and top-p act on the allowed tokens alone, for the target's rows and the drafter's alike."""
    if allowed is None:
        return logits
    x = np.asarray(logits)
    return np.where(allowed, x, x.dtype.type(-np.inf))


def logits_to_probs(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Apply temperature, top-k, top-p and softmax; return float64 probabilities.

    Accepts one row ``(V,)`` or several ``(rows, V)`` and returns the same
    shape, each row summing to 1.  Greedy params give a one-hot row at the
    first maximum: that is the distribution greedy decoding samples from, so
    the speculative verifier stays exact in that mode too.

    Raises ``ValueError`` if a row has NaN/+inf or is entirely -inf, because
    no distribution can be built from it and silently returning NaNs would
    corrupt every later acceptance test.
    """
    x = np.asarray(logits)
    if x.ndim not in (1, 2) or x.shape[-1] == 0:
        raise ValueError(f"logits must be 1-D or 2-D with a non-empty last axis, got shape {x.shape}")
    rows = x.reshape(-1, x.shape[-1])
    row_max = row_peaks(rows)

    out = np.zeros(rows.shape, dtype=np.float64)
    if params.greedy:
        out[np.arange(rows.shape[0]), np.argmax(rows, axis=-1)] = 1.0
    else:
        for row, peak, dest in zip(rows, row_max, out):
            _row_probs(row, float(peak), params, dest)
    return out.reshape(x.shape)


def row_peaks(rows: np.ndarray) -> np.ndarray:
    """Each row's maximum logit; raises :class:`NonFiniteLogits` where one is NaN, +inf or -inf (a row
    no distribution can be built from: damaged weights), before any of them is used."""
    row_max = rows.max(axis=-1)
    if not np.all(np.isfinite(row_max)):
        raise NonFiniteLogits("every logits row needs a finite maximum (no NaN or +inf, not all -inf)")
    return row_max


def row_probs(row: np.ndarray, peak: float, params: SamplingParams) -> np.ndarray:
    """One sampled row's distribution (float64), given its :func:`row_peaks` value: the row
    :func:`logits_to_probs` gives, bit for bit, for a verifier that needs rows one at a time."""
    dest = np.zeros(row.shape[-1], dtype=np.float64)
    _row_probs(row, float(peak), params, dest)
    return dest


def _row_probs(row: np.ndarray, peak: float, params: SamplingParams, dest: np.ndarray) -> None:
    """Fill ``dest`` (zeros, float64) with one row's filtered distribution.

    With top-k only the k survivors are exponentiated and nucleus-filtered;
    the rest of the 150k-entry row is never touched again.  Top-k is picked
    on the raw logits: dividing by a positive temperature keeps the order.
    """
    vocab = row.size
    if 0 < params.top_k < vocab:
        kept = _top_k_ids(row, params.top_k)
        probs = _softmax(row[kept], peak, params.temperature)
        if params.top_p < 1.0:
            _apply_top_p(probs, params.top_p)
        dest[kept] = probs
    else:
        dest[:] = _softmax(row, peak, params.temperature)
        if params.top_p < 1.0:
            _apply_top_p(dest, params.top_p)


def _top_k_ids(row: np.ndarray, k: int) -> np.ndarray:
    """Ascending ids of the k largest logits, plus any tied with the k-th.

    np.partition is O(V) (no full sort).  Keeping every tie makes the kept
    set a pure function of the values, independent of partition internals.
    """
    vocab = row.size
    kth = np.partition(row, vocab - k)[vocab - k]
    return np.flatnonzero(row >= kth)


def _softmax(values: np.ndarray, peak: float, temperature: float) -> np.ndarray:
    """softmax(values / T) as float64, given ``peak = max(values)``.

    Subtracting the max *before* dividing keeps every exponent <= 0, so
    neither a tiny temperature nor a huge logit can overflow, and softmax
    is shift-invariant so the result is unchanged.  float32 input is
    exponentiated in float32: 4x faster than float64 over 150k entries, with
    relative error about |z| * 1e-7 (below 1e-5 for every token more likely
    than 1e-40), far below model noise.  It changes nothing about
    losslessness, which only needs p and q to be the distributions actually
    used.  Normalisation and output are float64 because verification
    subtracts and divides probabilities.
    """
    work = np.float32 if values.dtype.itemsize <= 4 else np.float64
    z = values.astype(work)  # always a fresh array; safe to work in place
    z -= work(peak)
    z /= work(temperature)
    np.exp(z, out=z)
    probs = z.astype(np.float64)
    probs /= probs.sum()
    return probs


def _apply_top_p(probs: np.ndarray, top_p: float) -> None:
    """Keep the smallest set of most-likely tokens with mass >= top_p, in place.

    Always keeps at least the most likely token.  Tokens tied with the
    smallest kept probability are kept too (deterministic, see module doc).
    The row is renormalised afterwards.
    """
    threshold = _top_p_threshold(probs, top_p)
    np.multiply(probs, probs >= threshold, out=probs)
    probs /= probs.sum()


def _top_p_threshold(probs: np.ndarray, top_p: float) -> float:
    """Smallest probability inside the nucleus.

    Sorts only a window of the largest probabilities and widens it until it
    holds top_p of the mass, instead of sorting all V entries every step.
    Each widening is at least x8 and at least the number of tokens that
    could possibly close the gap (every token outside the window is no
    larger than the window's smallest), so flat rows converge in few steps.
    """
    size = probs.size
    window = min(size, _TOP_P_FIRST_WINDOW)
    while True:
        top = probs if window >= size else np.partition(probs, size - window)[size - window :]
        top = np.sort(top)[::-1]
        cumulative = np.cumsum(top)
        n = int(np.searchsorted(cumulative, top_p, side="left"))
        if n < window:
            return float(top[n])
        smallest = float(top[-1])
        if window >= size or smallest <= 0.0:
            # The whole mass is in view and, by rounding, a hair under top_p.
            return smallest
        needed = math.ceil((top_p - float(cumulative[-1])) / smallest)
        window = min(size, max(window * _TOP_P_GROWTH, window + needed))


# ---------------------------------------------------------------------------
# drawing tokens
# ---------------------------------------------------------------------------


def sample(probs: np.ndarray, rng: np.random.Generator) -> int:
    """Draw one token id from a 1-D distribution with exactly one uniform.

    Inverse CDF on ``u * total`` (the actual total, so a row summing to
    1 +- rounding is handled).  A token with zero probability can never be
    returned: its CDF step is empty.  Consuming exactly one ``rng.random()``
    keeps seeded runs reproducible (see verification).  Large rows use a
    two-level CDF (block sums, then one block), which is the same inverse
    CDF but avoids a slow 150k-entry cumulative sum.
    """
    p = np.asarray(probs)
    if p.ndim != 1 or p.size == 0:
        raise ValueError(f"probs must be a non-empty 1-D array, got shape {p.shape}")
    u = rng.random()
    if p.size <= 4 * _SAMPLE_BLOCK:
        return _inverse_cdf(p, u)
    starts = np.arange(0, p.size, _SAMPLE_BLOCK)
    block_mass = np.add.reduceat(p, starts, dtype=np.float64)
    block_cdf = np.cumsum(block_mass)
    block = _inverse_cdf(block_mass, u, block_cdf)
    # Where u * total fell inside the chosen block, rescaled to [0, 1).
    before = float(block_cdf[block - 1]) if block else 0.0
    inner = (u * float(block_cdf[-1]) - before) / float(block_mass[block])
    inner = min(max(inner, 0.0), _BELOW_ONE)
    begin = int(starts[block])
    return begin + _inverse_cdf(p[begin : begin + _SAMPLE_BLOCK], inner)


def _inverse_cdf(p: np.ndarray, u: float, cdf: np.ndarray | None = None) -> int:
    """First index whose CDF exceeds ``u * total``; never a zero-mass index."""
    if cdf is None:
        cdf = p.cumsum(dtype=np.float64)
    total = float(cdf[-1])
    if not (total > 0.0 and math.isfinite(total)):
        raise NonFiniteLogits(f"probs must have finite positive mass, got total {total!r}")
    index = int(cdf.searchsorted(u * total, side="right"))
    if index >= p.size:
        # u * total rounded up to total: take the last token that has mass.
        index = int(np.flatnonzero(p)[-1])
    return index


# ---------------------------------------------------------------------------
# reduced-vocabulary drafters
# ---------------------------------------------------------------------------


def check_vocab_ids(ids: np.ndarray, vocab_size: int) -> np.ndarray:
    """Validate a reduced-vocabulary map (drafter row j -> target id ids[j]).

    Meant to be called once when a VocabTrim / SpecVocab drafter is loaded;
    a bad map means a wrong or corrupt model file, hence EdgeSpecError.
    Duplicate ids would silently drop probability mass, out-of-range ids
    would crash mid-generation.  Returns the ids as an int64 array.
    """
    arr = np.asarray(ids)
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
        raise EdgeSpecError(f"drafter vocabulary map must be a 1-D integer array, got {arr.dtype} {arr.shape}")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= vocab_size):
        raise EdgeSpecError(f"drafter vocabulary map has ids outside the target vocabulary [0, {vocab_size})")
    if np.unique(arr).size != arr.size:
        raise EdgeSpecError("drafter vocabulary map contains duplicate target ids")
    return arr.astype(np.int64, copy=False)


def scatter_probs(
    sub_probs: np.ndarray,
    ids: np.ndarray,
    vocab_size: int,
    *,
    validate: bool = True,
) -> np.ndarray:
    """Place reduced-vocabulary probabilities into the full target vocabulary.

    A drafter with a trimmed head only ever samples ids in ``ids``, so its
    true distribution over the full vocabulary is ``sub_probs`` at ``ids``
    and exactly 0 elsewhere; the verifier needs that full-size ``q``.
    Works on ``(n,)`` or ``(rows, n)``.  ``validate=False`` skips the
    O(n log n) map check for hot loops whose map was checked at load time.
    """
    sub = np.asarray(sub_probs, dtype=np.float64)
    idx = check_vocab_ids(ids, vocab_size) if validate else np.asarray(ids)
    if sub.ndim not in (1, 2) or sub.shape[-1] != idx.size:
        raise ValueError(f"sub_probs shape {sub.shape} does not match {idx.size} vocabulary ids")
    out = np.zeros(sub.shape[:-1] + (vocab_size,), dtype=np.float64)
    out[..., idx] = sub
    return out
