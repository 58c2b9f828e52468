"""GGUF's Q4_K and Q6_K blocks rearranged for the native ``MatMulGGUF`` op, 16 output rows side by side.

A one-row matmul is one dot product per output row; computed row by row, each super-block's scales are
decoded for one row and every activation byte is loaded again for the next.  Here 16 rows share each
record: four consecutive codes of each of the 16 rows fill one 64-byte line, so a single ``vpdpbusd``
(or ``maddubs`` + ``madd`` without VNNI) adds four products for each of the 16 outputs against one
broadcast group of four activation codes, and a vector lane is an output from the first block to the
last, with no horizontal sums.  The codes, scales and minimums are GGUF's, unchanged: the same weights,
rounded once by llama.cpp.

Records, per group of 16 rows (N is padded with zero rows to a multiple of 16) and per super-block of 256:

* Q4_K, 2368 bytes (148 a row, GGUF's 144 plus the 6-bit scales and minimums unpacked to bytes):
  ``d[16]``, ``dmin[16]`` (float16), ``scales[8][16]``, ``mins[8][16]`` (uint8, per sub-block of 32), then
  32 lines of 64 bytes: line p holds weights 8p..8p+7, byte ``4·row + t`` the code of weight 8p+t in
  its low nibble and of weight 8p+4+t in its high nibble.
* Q6_K, 3360 bytes (210 a row, as GGUF's): ``d[16]`` (float16), ``scales[16][16]`` (int8, per sub-block
  of 16), the low four bits of the codes in 32 lines as above, then 16 lines of 64 bytes of their high
  two bits: line s (weights 16s..16s+15), byte ``4·row + t`` bits 2j..2j+1 for weight 16s + 4j + t.

Rows of a width short of whole super-blocks are padded with zeros.  Where the last super-block holds at most
128 of a row's weights (a hidden size of 896), its Q4_K records keep the first four sub-blocks' 16 lines alone,
1344 bytes (the op's ``tail`` of 4): the zeros after the row are not read again and again.  A tile is then its
records one after another, ``[tiles, tile bytes]``.
"""

from __future__ import annotations

import numpy as np

Q4_K, Q6_K = 12, 14  # ggml's type numbers: the op's ``type`` attribute
GGUF_BYTES = {Q4_K: 144, Q6_K: 210}
RECORD_BYTES = {Q4_K: 2368, Q6_K: 3360}
Q4_K_HEADER = 320  # a Q4_K record's d, dmin, scales and minimums; 32 lines of codes follow, 4 a sub-block
SHORT_TAIL = 4  # the sub-blocks a short last block's Q4_K records keep
SHORT_RECORD_BYTES = Q4_K_HEADER + SHORT_TAIL * 4 * 64  # 1344: the header, then 4 lines of 64 bytes a sub-block
ROWS = 16
TYPE_NUMBER = {"Q4_K": Q4_K, "Q6_K": Q6_K}


def _f16_bytes(values: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(values).view(np.uint8)


def _padded(raw: np.ndarray, n: int, k: int, kind: int) -> np.ndarray:
    """``[n_padded, k / 256, bytes]`` with zero rows added up to a multiple of 16 (all-zero blocks: weight 0)."""
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, k // 256, GGUF_BYTES[kind])
    pad = -n % ROWS
    return np.concatenate([blocks, np.zeros((pad, *blocks.shape[1:]), np.uint8)]) if pad else blocks


def _lines(codes: np.ndarray) -> np.ndarray:
    """Codes ``[tiles, 16, blocks, 256]`` (values < 16) -> ``[tiles, blocks, 32, 64]`` nibble lines."""
    tiles, rows, blocks, _ = codes.shape
    c = codes.reshape(tiles, rows, blocks, 32, 2, 4)  # weight 8p + 4h + t
    low, high = c[:, :, :, :, 0, :], c[:, :, :, :, 1, :]
    packed = (low | (high << 4)).astype(np.uint8)  # [tiles, rows, blocks, 32, 4]
    return packed.transpose(0, 2, 3, 1, 4).reshape(tiles, blocks, 32, rows * 4)


def record_width(k: int) -> int:
    """The width the records of a weight read by inputs of width ``k`` cover: whole super-blocks of 256, the
    rows of a narrower input padded with zeros (``blocks.add_rounded_native``; the op's ``K`` stays ``k``)."""
    return -(-k // 256) * 256


BAND_TILES = 64  # tiles of 16 rows rearranged at a time: the temporaries (a byte a weight) stay a few MB


def short_tail(kind: int, width: int) -> bool:
    """Whether a weight read by inputs of ``width`` may keep its last block's Q4_K records short: the rows end at
    most 128 columns into their last super-block (the rest padding)."""
    return kind == Q4_K and 0 < width % 256 <= 128


def shorten_tail(records: np.ndarray) -> np.ndarray:
    """Q4_K records ``[tiles, blocks, 2368]`` whose last block's sub-blocks 4-7 are padding (zero codes, scales
    and minimums) -> ``[tiles, tile bytes]`` with those sub-blocks' lines left out (the op's ``tail`` of 4)."""
    last = records[:, -1]
    scales, minimums = last[:, 64 + 16 * SHORT_TAIL : 192], last[:, 192 + 16 * SHORT_TAIL : Q4_K_HEADER]  # [8][16]
    dropped = np.concatenate([scales, minimums, last[:, SHORT_RECORD_BYTES:]], axis=1)
    if dropped.any():
        raise ValueError("the last block's sub-blocks 4-7 hold weights: its records cannot be short")
    tiles = records.shape[0]
    return np.concatenate([records[:, :-1].reshape(tiles, -1), last[:, :SHORT_RECORD_BYTES]], axis=1)


def whole_tail(records: np.ndarray, kind: int, n: int, k: int, tail: int) -> np.ndarray:
    """The op's records as ``[tiles, blocks, record bytes]``: a short tail (``tail`` 4) padded back with zeros."""
    tiles, nb = -(-n // ROWS), k // 256
    flat = np.ascontiguousarray(records, dtype=np.uint8).reshape(tiles, -1)
    if tail == 8:
        return flat.reshape(tiles, nb, RECORD_BYTES[kind])
    if tail != SHORT_TAIL or kind != Q4_K:
        raise ValueError(f"a tail of {tail} sub-blocks is not a record layout of ggml type {kind}")
    whole = np.zeros((tiles, nb, RECORD_BYTES[kind]), np.uint8)
    whole[:, :-1] = flat[:, : (nb - 1) * RECORD_BYTES[kind]].reshape(tiles, nb - 1, RECORD_BYTES[kind])
    whole[:, -1, :SHORT_RECORD_BYTES] = flat[:, (nb - 1) * RECORD_BYTES[kind] :]
    return whole


def interleave(raw: np.ndarray, kind: int, n: int, k: int) -> np.ndarray:
    """GGUF tensor bytes of a weight ``[n, k]`` (rows of K) -> the op's records, ``uint8 [n_padded / 16,
    k / 256, record bytes]``."""
    if k % 256:
        raise ValueError(f"K = {k} is not a multiple of 256")
    if kind not in RECORD_BYTES:
        raise ValueError(f"no interleaved layout for ggml type {kind}")
    blocks = _padded(raw, n, k, kind)
    tiles = blocks.shape[0] // ROWS
    nb = k // 256
    b = blocks.reshape(tiles, ROWS, nb, GGUF_BYTES[kind])
    records = np.empty((tiles, nb, RECORD_BYTES[kind]), np.uint8)
    for start in range(0, tiles, BAND_TILES):
        records[start : start + BAND_TILES] = _records(b[start : start + BAND_TILES], kind)
    return records


def _records(b: np.ndarray, kind: int) -> np.ndarray:
    """GGUF blocks ``[tiles, 16, blocks, bytes]`` -> records ``[tiles, blocks, record bytes]``."""
    tiles, _, nb, _ = b.shape
    if kind == Q4_K:
        d, dmin = b[..., 0:2], b[..., 2:4]
        s = b[..., 4:16].reshape(tiles, ROWS, nb, 3, 4)
        sc = np.concatenate([s[..., 0, :] & 0x3F, (s[..., 2, :] & 0x0F) | ((s[..., 0, :] >> 2) & 0x30)], axis=-1)
        mn = np.concatenate([s[..., 1, :] & 0x3F, (s[..., 2, :] >> 4) | ((s[..., 1, :] >> 2) & 0x30)], axis=-1)
        chunks = b[..., 16:].reshape(tiles, ROWS, nb, 4, 32)
        codes = np.stack([chunks & 0x0F, chunks >> 4], axis=-2).reshape(tiles, ROWS, nb, 256)
        parts = [
            d.transpose(0, 2, 1, 3).reshape(tiles, nb, 32),
            dmin.transpose(0, 2, 1, 3).reshape(tiles, nb, 32),
            sc.transpose(0, 2, 3, 1).reshape(tiles, nb, 128),
            mn.transpose(0, 2, 3, 1).reshape(tiles, nb, 128),
            _lines(codes).reshape(tiles, nb, 2048),
        ]
    else:  # Q6_K (interleave checked the type)
        ql = b[..., :128].reshape(tiles, ROWS, nb, 2, 64)
        qh = b[..., 128:192].reshape(tiles, ROWS, nb, 2, 32)
        sc = b[..., 192:208]
        d = b[..., 208:210]
        # GGUF's order within each half of 128: l in 0..31 -> weights l, l+32, l+64, l+96
        q = np.empty((tiles, ROWS, nb, 2, 4, 32), np.uint8)
        q[..., 0, :] = (ql[..., :32] & 0xF) | ((qh & 3) << 4)
        q[..., 1, :] = (ql[..., 32:] & 0xF) | (((qh >> 2) & 3) << 4)
        q[..., 2, :] = (ql[..., :32] >> 4) | (((qh >> 4) & 3) << 4)
        q[..., 3, :] = (ql[..., 32:] >> 4) | (((qh >> 6) & 3) << 4)
        codes = q.reshape(tiles, ROWS, nb, 256)
        high = (codes >> 4).reshape(tiles, ROWS, nb, 16, 4, 4)  # weight 16s + 4j + t
        high_bytes = high[..., 0, :] | (high[..., 1, :] << 2) | (high[..., 2, :] << 4) | (high[..., 3, :] << 6)
        parts = [
            d.transpose(0, 2, 1, 3).reshape(tiles, nb, 32),
            sc.transpose(0, 2, 3, 1).reshape(tiles, nb, 256),
            _lines(codes & 0x0F).reshape(tiles, nb, 2048),
            high_bytes.astype(np.uint8).transpose(0, 2, 3, 1, 4).reshape(tiles, nb, 1024),
        ]
    return np.concatenate(parts, axis=-1)


def _unlines(lines: np.ndarray, tiles: int, blocks: int) -> np.ndarray:
    """:func:`_lines` undone: ``[tiles, blocks, 2048]`` nibble lines -> codes ``[tiles, 16, blocks, 256]``."""
    packed = lines.reshape(tiles, blocks, 32, ROWS, 4).transpose(0, 3, 1, 2, 4)  # [tiles, rows, blocks, 32, 4]
    return np.stack([packed & 0x0F, packed >> 4], axis=-2).reshape(tiles, ROWS, blocks, 256)


def deinterleave(records: np.ndarray, kind: int, n: int, k: int, tail: int = 8) -> np.ndarray:
    """:func:`interleave` undone (and a short tail, ``tail`` 4, padded back): the op's records of a weight
    ``[n, k]`` -> GGUF's own tensor bytes, ``uint8 [n, k / 256 * block bytes]`` (the padding rows dropped).  A
    bundle whose op cannot run here is loaded through these bytes in the ``lean`` layout's form."""
    if k % 256:
        raise ValueError(f"K = {k} is not a multiple of 256")
    if kind not in RECORD_BYTES:
        raise ValueError(f"no interleaved layout for ggml type {kind}")
    nb = k // 256
    tiles = -(-n // ROWS)
    r = whole_tail(records, kind, n, k, tail)

    def per_row(part: np.ndarray, width: int) -> np.ndarray:
        """``[tiles, blocks, width * 16]`` laid out as ``[width][16]`` -> ``[tiles, 16, blocks, width]``."""
        return part.reshape(tiles, nb, width, ROWS).transpose(0, 3, 1, 2)

    def per_row_bytes(part: np.ndarray, width: int) -> np.ndarray:
        """``[tiles, blocks, 16 * width]`` laid out as ``[16][width]`` -> ``[tiles, 16, blocks, width]``."""
        return part.reshape(tiles, nb, ROWS, width).transpose(0, 2, 1, 3)

    if kind == Q4_K:
        d, dmin = per_row_bytes(r[..., 0:32], 2), per_row_bytes(r[..., 32:64], 2)
        sc, mn = per_row(r[..., 64:192], 8), per_row(r[..., 192:320], 8)
        s0 = sc[..., :4] | ((sc[..., 4:] & 0x30) << 2)
        s1 = mn[..., :4] | ((mn[..., 4:] & 0x30) << 2)
        s2 = (sc[..., 4:] & 0x0F) | ((mn[..., 4:] & 0x0F) << 4)
        codes = _unlines(r[..., 320:], tiles, nb).reshape(tiles, ROWS, nb, 4, 2, 32)
        qs = (codes[..., 0, :] | (codes[..., 1, :] << 4)).reshape(tiles, ROWS, nb, 128)
        blocks = np.concatenate([d, dmin, s0, s1, s2, qs], axis=-1)
    else:  # Q6_K
        d = per_row_bytes(r[..., 0:32], 2)
        sc = per_row(r[..., 32:288], 16)
        low = _unlines(r[..., 288:2336], tiles, nb)
        high_bytes = r[..., 2336:].reshape(tiles, nb, 16, ROWS, 4).transpose(0, 3, 1, 2, 4)  # [.., 16 s, 4 t]
        high = np.stack([(high_bytes >> shift) & 3 for shift in (0, 2, 4, 6)], axis=-2)  # [.., s, j, t]
        q = (low | (high.reshape(tiles, ROWS, nb, 256) << 4)).reshape(tiles, ROWS, nb, 2, 4, 32)
        low4 = q & 0x0F
        ql = np.concatenate([low4[..., 0, :] | (low4[..., 2, :] << 4), low4[..., 1, :] | (low4[..., 3, :] << 4)], -1)
        qh = q[..., 0, :] >> 4 | ((q[..., 1, :] >> 4) << 2) | ((q[..., 2, :] >> 4) << 4) | ((q[..., 3, :] >> 4) << 6)
        blocks = np.concatenate([ql.reshape(tiles, ROWS, nb, 128), qh.reshape(tiles, ROWS, nb, 64), sc, d], axis=-1)
    rows = blocks.astype(np.uint8).reshape(tiles * ROWS, nb * GGUF_BYTES[kind])
    return np.ascontiguousarray(rows[:n])
