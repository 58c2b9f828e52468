"""Float weights rounded to GGUF's Q4_K blocks (``edge_spec.export.gguf.q4_k``), read back by the gguf
package's own Q4_K dequantizer."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as T  # noqa: E402
from gguf import quants  # noqa: E402

from edge_spec.export.gguf.q4_k import QK_K, quantize_q4_k  # noqa: E402


def _weights(seed: int, n: int = 48, k: int = 768) -> np.ndarray:
    """Rows of different magnitudes, as an LM head's are."""
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((n, k)) * rng.uniform(0.005, 0.3, (n, 1))).astype(np.float32)


def _back(raw: np.ndarray, shape) -> np.ndarray:
    return quants.dequantize(raw, T.Q4_K).reshape(shape)


def _relative_error(approx: np.ndarray, exact: np.ndarray) -> float:
    return float(np.sqrt(((approx - exact) ** 2).mean() / (exact**2).mean()))


def _min_max_rounding(w: np.ndarray) -> np.ndarray:
    """Sub-blocks of 32 rounded over their own range at 15 steps, no fitting and no 6-bit scales: the plain
    rounding the fitted one must beat."""
    sub = w.reshape(-1, 32)
    low, high = np.minimum(sub.min(-1, keepdims=True), 0), sub.max(-1, keepdims=True)
    step = np.where(high > low, (high - low) / 15, 1)
    return (np.clip(np.rint((sub - low) / step), 0, 15) * step + low).reshape(w.shape)


def test_the_bytes_are_q4_k_blocks_within_a_4_bit_step():
    w = _weights(0)
    raw = quantize_q4_k(w)
    assert raw.shape == (48, 768 // QK_K * 144) and raw.dtype == np.uint8
    fitted = _relative_error(_back(raw, w.shape), w)
    assert fitted < 0.08  # a 4-bit step over a Gaussian sub-block's range is about a quarter of its spread
    # the weighted fit and the 6-bit scales beat rounding each sub-block over its own range
    assert fitted < _relative_error(_min_max_rounding(w), w)


def test_flat_and_one_signed_sub_blocks_come_back():
    w = _weights(1, n=4)
    w[0, :QK_K] = 0
    w[1, :QK_K] = 0.5
    w[2, :QK_K] = -0.25
    w[3] = np.abs(w[3])
    back = _back(quantize_q4_k(w), w.shape)
    assert np.array_equal(back[0, :QK_K], np.zeros(QK_K, np.float32))
    assert not np.signbit(back[0, :QK_K]).any()  # no negative zeros from a zero minimum
    np.testing.assert_allclose(back[1, :QK_K], 0.5, rtol=2e-3)
    np.testing.assert_allclose(back[2, :QK_K], -0.25, rtol=2e-3)
    assert _relative_error(back[3], w[3]) < 0.08


def test_the_bytes_do_not_depend_on_the_bands():
    w = _weights(2, n=70)
    whole = quantize_q4_k(w)
    np.testing.assert_array_equal(quantize_q4_k(w, rows_per_band=16), whole)
    read = quantize_q4_k(read_rows=lambda start, stop: w[start:stop], shape=w.shape, rows_per_band=32)
    np.testing.assert_array_equal(read, whole)


def test_a_k_that_is_not_whole_super_blocks_is_refused():
    with pytest.raises(ValueError, match="multiple of 256"):
        quantize_q4_k(np.zeros((2, 300), np.float32))
