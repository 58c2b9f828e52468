"""Float weights rounded to GGUF's Q4_K blocks, as llama.cpp's ``quantize_row_q4_K_ref`` rounds them.

Why: the native ``MatMulGGUF`` op streams Q4_K at 4.5 bits a weight and multiplies several rows for little
more than the price of one, where ``MatMulNBits`` reads 4-bit blocks of 32 with a float32 scale and a zero
point (5.1 bits) and pays for each row again.  An LM head carried at 8 bits (Q6_K in a Q4_K_M file) and
read at 4 bits for its ranking (its best rows scored again from 8-bit rows) is rounded here, once, so that
the ranking pass runs under the native op.

The rounding is llama.cpp's: per sub-block of 32 a scale and a minimum fitted by weighted least squares
over 21 candidate steps (weights ``sqrt(mean x²) + |x|`` within the sub-block, larger weights counting
more), then the eight scales and eight minimums of a super-block of 256 rounded to 6 bits against two
float16 steps, and the codes rounded again against those rounded values.  All of it is numpy over bands of
rows, the bands on the export's worker threads.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from edge_spec.export.graph import parallel

QK_K = 256
SUB = 32  # weights per sub-block
BLOCK_BYTES = 144  # d, dmin (float16), 12 bytes of 6-bit scales and minimums, 128 bytes of codes
BAND_BYTES = 4 << 20  # float32 weights rounded at a time, all workers together; temporaries are several times this
STEPS = 20  # candidate steps beyond the first, as llama.cpp's make_qkx2_quants(..., -1, 0.1, 20, false)
FIRST_STEP, STEP_WIDTH = -1.0, 0.1


def quantize_q4_k(
    weights: np.ndarray | None = None,
    rows_per_band: int | None = None,
    *,
    read_rows: Callable[[int, int], np.ndarray] | None = None,
    shape: tuple[int, int] | None = None,
) -> np.ndarray:
    """``weights`` ``[n, k]`` (k a multiple of 256) as GGUF Q4_K bytes, ``uint8 [n, k / 256 * 144]``; or the
    matrix of ``shape`` whose rows ``read_rows(start, stop)`` gives a band at a time, so that a carried
    matrix is never held whole in float32 (an LM head's would be most of a gigabyte)."""
    if read_rows is None:
        weights = np.asarray(weights)
        shape = weights.shape

        def read_rows(start: int, stop: int) -> np.ndarray:
            return weights[start:stop]

    n, k = shape
    if k % QK_K:
        raise ValueError(f"Q4_K needs K a multiple of {QK_K}, not {k}")
    out = np.empty((n, k // QK_K * BLOCK_BYTES), np.uint8)
    if rows_per_band is None:
        rows_per_band = max(16, BAND_BYTES // (4 * k) // parallel.WORKERS)
    starts = range(0, n, rows_per_band)

    def band(start: int) -> None:  # bands are independent: the same bytes on any number of workers
        stop = min(start + rows_per_band, n)
        blocks = np.asarray(read_rows(start, stop), np.float32).reshape(-1, QK_K)
        out[start:stop] = _quantize_blocks(blocks).reshape(stop - start, -1)

    parallel.each(band, starts)
    return out


def _quantize_blocks(x: np.ndarray) -> np.ndarray:
    """Super-blocks ``x`` ``[b, 256]`` -> their Q4_K bytes ``[b, 144]``."""
    b = x.shape[0]
    sub = x.reshape(b, QK_K // SUB, SUB)
    column = np.ascontiguousarray(sub.reshape(-1, SUB).T)  # [32, sub-blocks]: a weight's place, then its sub-block
    average = np.sqrt(_ordered_sum(column * column) / np.float32(SUB))
    scale, minimum = _fit_sub_blocks(column, average + np.abs(column))
    scale, minimum = scale.reshape(b, -1), minimum.reshape(b, -1)  # [b, 8]; minimum is the value subtracted (>= 0)

    max_scale, max_min = scale.max(axis=1), minimum.max(axis=1)
    inverse_scale = np.where(max_scale > 0, 63 / np.where(max_scale > 0, max_scale, 1), 0).astype(np.float32)
    inverse_min = np.where(max_min > 0, 63 / np.where(max_min > 0, max_min, 1), 0).astype(np.float32)
    scale_codes = np.minimum(np.rint(inverse_scale[:, None] * scale), 63).astype(np.uint8)
    min_codes = np.minimum(np.rint(inverse_min[:, None] * minimum), 63).astype(np.uint8)
    d = (max_scale / np.float32(63)).astype(np.float16)
    dmin = (max_min / np.float32(63)).astype(np.float16)

    step = d.astype(np.float32)[:, None] * scale_codes
    offset = dmin.astype(np.float32)[:, None] * min_codes
    safe = np.where(step > 0, step, 1)
    codes = np.clip(np.rint((sub + offset[..., None]) / safe[..., None]), 0, 15)
    codes = np.where(step[..., None] > 0, codes, 0).astype(np.uint8).reshape(b, QK_K)

    out = np.empty((b, BLOCK_BYTES), np.uint8)
    out[:, 0:2] = d.reshape(b, 1).view(np.uint8)
    out[:, 2:4] = dmin.reshape(b, 1).view(np.uint8)
    out[:, 4:16] = _pack_scales(scale_codes, min_codes)
    lines = codes.reshape(b, 4, 2, SUB)  # each 64 weights: the first 32 in low nibbles, the next 32 in high
    out[:, 16:] = (lines[:, :, 0] | (lines[:, :, 1] << 4)).reshape(b, 128)
    return out


def _ordered_sum(a: np.ndarray) -> np.ndarray:
    """Sums over the first axis, added in order as llama.cpp's loops add them: numpy's pairwise sums differ in
    the last bits, and that flips near-ties between candidate steps."""
    total = a[0].copy()
    for row in a[1:]:
        total += row
    return total


def _fit_sub_blocks(x: np.ndarray, weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per sub-block (a column of ``x``, ``[32, sub-blocks]``) the scale and minimum of llama.cpp's
    ``make_qkx2_quants`` (15 levels): ``x ≈ scale·q − minimum`` with the weighted squared error least among
    the candidate steps and their least-squares refits.  As there, each candidate's codes count from the best
    minimum found so far, over the range above it."""
    high = x.max(axis=0)
    minimum = np.minimum(x.min(axis=0), 0)
    flat = high <= minimum
    sum_w = _ordered_sum(weight)
    sum_x = _ordered_sum(weight * x)

    def codes_at(levels: np.float32, minimum: np.ndarray) -> np.ndarray:
        span = np.where(flat, 1, high - minimum)
        return np.clip(np.rint((levels / span) * (x - minimum)), 0, 15)

    def error(scale: np.ndarray, minimum: np.ndarray, codes: np.ndarray) -> np.ndarray:
        diff = scale * codes + minimum - x
        return _ordered_sum(weight * diff * diff)

    scale = 1 / (np.float32(15) / np.where(flat, 1, high - minimum))
    best = error(scale, minimum, codes_at(np.float32(15), minimum))
    for step in range(STEPS + 1):
        codes = codes_at(np.float32(FIRST_STEP) + np.float32(STEP_WIDTH) * np.float32(step) + np.float32(15), minimum)
        weighted = weight * codes
        sum_l, sum_l2, sum_xl = _ordered_sum(weighted), _ordered_sum(weighted * codes), _ordered_sum(weighted * x)
        det = sum_w * sum_l2 - sum_l * sum_l
        safe_det = np.where(det > 0, det, 1)
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / safe_det
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / safe_det
        positive = this_min > 0  # the minimum may not rise above zero: refit the scale alone
        this_scale = np.where(positive, sum_xl / np.where(sum_l2 > 0, sum_l2, 1), this_scale)
        this_min = np.where(positive, 0, this_min)
        this_error = error(this_scale, this_min, codes)
        better = (det > 0) & (this_error < best) & ~flat
        best = np.where(better, this_error, best)
        scale = np.where(better, this_scale, scale)
        minimum = np.where(better, this_min, minimum)
    scale = np.where(flat, 0, scale)
    return scale.astype(np.float32), (0 - minimum).astype(np.float32)  # no -0.0: its float16 has the sign bit


def _pack_scales(scales: np.ndarray, mins: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and eight 6-bit minimums per super-block into GGUF's 12 bytes (``get_scale_min_k4``
    reads them back): sub-blocks 0-3 whole in bytes 0-3 and 4-7, sub-blocks 4-7 as low nibbles in bytes 8-11
    with their top two bits in the top bits of bytes 0-7."""
    packed = np.zeros((scales.shape[0], 12), np.uint8)
    packed[:, 0:4] = scales[:, 0:4] | ((scales[:, 4:8] >> 4) << 6)
    packed[:, 4:8] = mins[:, 0:4] | ((mins[:, 4:8] >> 4) << 6)
    packed[:, 8:12] = (scales[:, 4:8] & 0xF) | ((mins[:, 4:8] & 0xF) << 4)
    return packed
