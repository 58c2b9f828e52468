"""Weight-only block quantization in numpy, in the byte layouts ONNX Runtime reads.

Why numpy and not ORT's ``MatMulNBitsQuantizer``: we build the graph ourselves
(see ``builder``), so we quantize each weight once, straight from the
state dict, and reuse the same packed bytes for ``MatMulNBits`` (linear layers)
and ``GatherBlockQuantized`` (embedding table).

Layout (both ops): a weight ``W`` of shape ``[N, K]`` (out features, in
features) is cut into blocks of ``block_size`` along ``K``.  Each block gets
one float scale; values are stored unsigned with an implicit zero point of
``2**(bits-1)`` (8 for int4, 128 for int8), so ``w = scale * (q - zp)``.
int4 packs two values per byte, element ``2j`` in the low nibble.

Scale choice is symmetric "signed absmax" (as llama.cpp's Q4_0 and MLAS do):
``scale = m / -zp`` where ``m`` is the block value of largest magnitude, so
``m`` maps exactly onto the most negative code and the full code range is used.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class BlockQuantized:
    """Packed block-quantized weight of logical shape ``[n, k]``."""

    packed: np.ndarray  # uint8 [n, k_blocks, block_size * bits // 8]
    scales: np.ndarray  # float32 [n, k_blocks]
    bits: int
    block_size: int
    n: int
    k: int

    def dequantize(self) -> np.ndarray:
        """Float32 ``[n, k]`` reconstruction (for tests and reference models)."""
        codes = unpack_codes(self.packed, self.bits).astype(np.float32)
        zero = float(1 << (self.bits - 1))
        w = (codes - zero) * self.scales[:, :, None]
        return w.reshape(self.n, -1)[:, : self.k]


def quantize_blockwise(weight, bits: int = 4, block_size: int = 32) -> BlockQuantized:
    """Quantize ``weight [N, K]`` row-wise in blocks along K.

    K is zero-padded up to a multiple of ``block_size`` (MatMulNBits expects
    whole blocks); padding contributes nothing to the dot products.  Rows are
    read and quantized a band at a time (``weights.band_ranges``), the bands
    on every core (``parallel.each``); each row is rounded on its own, so the
    result is the same bytes: the float temporaries of an embedding-sized
    table are a few bands', and a deferred weight is read a band at a time.
    """
    from edge_spec.export.graph import parallel
    from edge_spec.export.graph.weights import DeferredMatrix, band_ranges, read_band

    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    if isinstance(weight, DeferredMatrix) and not weight.reads_rows:
        weight = np.asarray(weight)  # read once, not once a band
    n, k = weight.shape
    k_blocks = -(-k // block_size)
    packed = np.empty((n, k_blocks, block_size * bits // 8), np.uint8)
    scales = np.empty((n, k_blocks), np.float32)
    # the workers share QUANTIZE_BAND_BYTES (the bands in memory at once are one thread's band, cut up), and
    # a matrix of a few MB is still cut into a band or two per worker
    band_bytes = max(MIN_BAND_BYTES, min(QUANTIZE_BAND_BYTES, 4 * n * k // 2) // parallel.WORKERS)

    def quantize_band(rows: tuple[int, int]) -> None:
        start, stop = rows
        packed[start:stop], scales[start:stop] = _quantize_rows(read_band(weight, start, stop), bits, block_size)

    parallel.each(quantize_band, band_ranges((n, k), band_bytes))
    return BlockQuantized(packed, scales, bits, block_size, n, k)


QUANTIZE_BAND_BYTES = 8 << 20  # float32 rows quantized at a time, all workers together: a few times this in temporaries
MIN_BAND_BYTES = 1 << 20  # below this a band's numpy calls cost more than the work they do


def _quantize_rows(w: np.ndarray, bits: int, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(packed codes, scales) of float32 rows ``w``: :func:`quantize_blockwise`'s arithmetic."""
    n, k = w.shape
    k_blocks = -(-k // block_size)
    if k_blocks * block_size != k:
        w = np.pad(w, ((0, 0), (0, k_blocks * block_size - k)))
    blocks = w.reshape(n, k_blocks, block_size)
    zero = 1 << (bits - 1)
    # signed value of largest magnitude in each block
    idx = np.abs(blocks).argmax(axis=2)[..., None]
    extreme = np.take_along_axis(blocks, idx, axis=2)[..., 0]
    scales = (extreme / -zero).astype(np.float32)
    safe = np.where(scales == 0, 1.0, scales).astype(np.float32)
    codes = np.rint(blocks / safe[..., None]) + zero
    codes = np.clip(codes, 0, (1 << bits) - 1).astype(np.uint8)
    return pack_codes(codes, bits), scales


def pack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """Pack unsigned codes along the last axis (two per byte for int4)."""
    if bits == 8:
        return codes
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)


def unpack_codes(packed: np.ndarray, bits: int) -> np.ndarray:
    """Inverse of :func:`pack_codes`."""
    if bits == 8:
        return packed
    out = np.empty(packed.shape[:-1] + (packed.shape[-1] * 2,), dtype=np.uint8)
    out[..., 0::2] = packed & 0x0F
    out[..., 1::2] = packed >> 4
    return out
