"""GGUF quantized blocks carried into ``MatMulNBits`` unchanged, so a GGUF weight is rounded once (by
llama.cpp), not twice (dequantized, then re-quantized to our int4 blocks).

Each carried format is rewritten, not approximated, into a ``MatMulNBits`` layout where ONNX Runtime
computes ``w = scale * (code - zero_point)`` per block along K with an integer zero point:

==========  =========================================  ===========================================
GGUF type   GGUF formula (per block)                   MatMulNBits bits / block / zero point
==========  =========================================  ===========================================
Q4_0        d * (q - 8),  q in 0..15, blocks of 32      4 / 32 / none (the default 8)
Q4_1        d * q + m                                   4 / 32 / round(-m/d), + correction
Q4_K        d*sc * q - dmin*m, sub-blocks of 32         4 / 32 / round(dmin*m / (d*sc)), + correction
Q8_0        d * q,  q in -128..127, blocks of 32        8 / 32 / none (code q + 128)
Q5_0        d * (q - 16), q in 0..31, blocks of 32      8 / 32 / 16
Q5_1        d * q + m                                   8 / 32 / round(-m/d), + correction
Q5_K        d*sc * q - dmin*m, sub-blocks of 32         8 / 32 / round(dmin*m / (d*sc)), + correction
Q6_K        d*sc * (q - 32), sub-blocks of 16           8 / 16 / 32
==========  =========================================  ===========================================

The affine formats' zero point is fractional.  ONNX Runtime accepts a float zero point for 4-bit
weights (not for 8-bit ones), but its CPU kernel then dequantizes the whole matrix on every call (about a hundred times
slower than the integer path), so the fraction is moved out instead: ``w = scale * (q - z) - c`` with
``z`` the rounded zero point and ``c = scale * (exact - z)`` one float per block, and ``x @ w.T`` is
``MatMulNBits`` minus the block sums of ``x`` times ``c``.  Other types (Q2_K, Q3_K, the IQ family) are
not carried: the exporter re-quantizes them and says so.

What ONNX Runtime runs fast is not quite that layout, so by default (``BuildOptions.carry_exact`` False)
the graph gets it in two forms that round a second time, each far below GGUF's own step
(:func:`fast_layout`; the export's weights are checked against transformers in the exact form first):

* **blocks of 16 become blocks of 32** (Q6_K): ORT's 8-bit kernel over blocks of 16 runs about 1.5x
  slower than over blocks of 32.  Two sub-blocks share the larger one's scale / 4, so its codes
  (``4 * (q - 32)``) stay exact and the other's are rounded to a quarter of that step;
* **4-bit zero points move into the correction** (:func:`zero_points_into_correction`): ``s * (q - z) - c``
  is ``s * (q - 8) - (c + s * (z - 8))``, and ORT's kernel runs a 4-bit matrix without zero points about
  10% faster.  The weights are the same; only the correction grows (to a few steps where it was at most
  half of one), and it is rounded next:
* **the correction rides in the main matmul**: the block sums of ``x`` are appended to ``x`` (once per
  digit) and ``-c`` to each row as blocks of its own, in :data:`CORRECTION_DIGITS` digits at the weight's
  bits (:func:`fold_correction`: error at most 1/196 of the largest ``|c|`` among 32 blocks at 4 bits with
  two digits).  A separate fp32 MatMul plus a Sub per projection cost about a third of the int4 matmul
  they corrected.

The ``small`` layout (``BuildOptions.carry_narrow``) goes one step further: the 8-bit blocks (Q6_K, Q5_*,
Q8_0) are rounded to 4-bit blocks of 32 (:func:`narrow_to_4bit`), a second rounding at a 4-bit step, so
that every matrix reads half a byte a weight; the 4-bit formats stay as in the fast layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from edge_spec.export.gguf.interleaved import ROWS as RECORD_ROWS
from edge_spec.export.gguf.interleaved import SHORT_TAIL, interleave, record_width, short_tail, shorten_tail
from edge_spec.export.gguf.interleaved import TYPE_NUMBER as NATIVE_TYPE_NUMBERS
from edge_spec.export.gguf.q4_k import quantize_q4_k
from edge_spec.export.graph import parallel
from edge_spec.export.graph.quantize import pack_codes, unpack_codes
from edge_spec.export.graph.weights import DeferredMatrix, read_band

MS_DOMAIN = "com.microsoft"
NATIVE_DOMAIN = "ai.edge_spec"  # edge_spec/native: the ops the runtime registers from its own library
ACCURACY_LEVEL_KEY = "edge_spec.accuracy_level"  # a native graph's metadata: MatMulNBits' level where its op cannot run
QK_K = 256
CARRIED_TYPES = ("Q4_0", "Q4_1", "Q4_K", "Q8_0", "Q5_0", "Q5_1", "Q5_K", "Q6_K")


@dataclass(frozen=True)
class CarriedBlocks:
    """A weight ``[n, k]`` in ``MatMulNBits`` layout, taken over from GGUF blocks without rounding:
    ``w = scales * (codes - zero_points) - correction`` per block."""

    packed: np.ndarray  # uint8 [n, k_blocks, block_size * bits // 8]
    scales: np.ndarray  # float32 [n, k_blocks]
    zero_points: np.ndarray | None  # uint8 [n, k_blocks], one code each; None: 2**(bits-1)
    bits: int
    block_size: int
    source_type: str  # the GGUF type it came from ("Q4_K", ...; "mixed" after a concatenation)
    correction: np.ndarray | None = None  # float32 [n, k_blocks] subtracted per block (affine formats)
    raw: np.ndarray | None = None  # uint8 [n, row bytes]: GGUF's own blocks (the native layout reads them)

    @property
    def n(self) -> int:
        return self.packed.shape[0]

    @property
    def k(self) -> int:
        return self.packed.shape[1] * self.block_size

    def zero_points_or_default(self) -> np.ndarray:
        if self.zero_points is not None:
            return self.zero_points
        return np.full(self.scales.shape, 1 << (self.bits - 1), np.uint8)

    def correction_or_zero(self) -> np.ndarray:
        return self.correction if self.correction is not None else np.zeros(self.scales.shape, np.float32)

    def dequantize(self) -> np.ndarray:
        """Float32 ``[n, k]``: what the graph multiplies by (tests, and the check against transformers)."""
        codes = unpack_codes(self.packed, self.bits).astype(np.float32)
        zero = self.zero_points_or_default().astype(np.float32)
        w = (codes - zero[..., None]) * self.scales[..., None] - self.correction_or_zero()[..., None]
        return w.reshape(self.n, -1)

    def rows(self, index: np.ndarray) -> "CarriedBlocks":
        """The output rows ``index`` (a row permutation, a split, or VocabTrim's kept rows)."""

        def pick(a):
            return None if a is None else a[index]

        return CarriedBlocks(
            self.packed[index],
            self.scales[index],
            pick(self.zero_points),
            self.bits,
            self.block_size,
            self.source_type,
            pick(self.correction),
            pick(self.raw),
        )


def concat_blocks(parts: list[CarriedBlocks]) -> CarriedBlocks:
    """Stack carried weights of one bits/block layout along N (a fused Q/K/V or gate/up projection)."""
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    zero = None
    if any(p.zero_points is not None for p in parts):
        zero = np.concatenate([p.zero_points_or_default() for p in parts])
    correction = None
    if any(p.correction is not None for p in parts):
        correction = np.concatenate([p.correction_or_zero() for p in parts])
    kinds = {p.source_type for p in parts}
    same_rows = len(kinds) == 1 and len({p.raw.shape[1] if p.raw is not None else -1 for p in parts}) == 1
    raw = np.concatenate([p.raw for p in parts]) if same_rows and first.raw is not None else None
    return CarriedBlocks(
        np.concatenate([p.packed for p in parts]),
        np.concatenate([p.scales for p in parts]),
        zero,
        first.bits,
        first.block_size,
        kinds.pop() if len(kinds) == 1 else "mixed",
        correction,
        raw,
    )


def _zero_point_bytes(w: CarriedBlocks) -> np.ndarray:
    """MatMulNBits' uint8 zero points: one per byte at 8 bits, two per byte (low nibble first) at 4."""
    zero = w.zero_points
    if w.bits == 8:
        return zero.reshape(-1)
    if zero.shape[1] % 2:
        zero = np.pad(zero, ((0, 0), (0, 1)))
    return (zero[:, 0::2] | (zero[:, 1::2] << 4)).astype(np.uint8).reshape(-1)


def add_carried_linear(g, x: str, w: CarriedBlocks, name: str, opt, bias: np.ndarray | None = None) -> str:
    """``y = x @ w.T + bias`` as one ``MatMulNBits`` over the carried blocks (``g``: the builder's Graph),
    less the per-block correction (see the module docstring) where the format has one: folded into the
    matmul (default), or as a separate fp32 MatMul when ``opt.carry_exact``.  With ``opt.carry_native``
    a Q4_K or Q6_K weight is GGUF's own bytes under edge-spec's native ``MatMulGGUF`` instead."""
    if getattr(opt, "carry_native", False) and native_takes(w):
        return _add_native_linear(g, x, w, name, bias)
    if not opt.carry_exact:
        w = _unfolded_fast_layout(w)
        x = _with_block_sums(g, x, w, name)
        w = fold_correction(w)
    inputs = [x, g.const(name + ".qweight", w.packed), g.const(name + ".scales", w.scales.reshape(-1))]
    if w.zero_points is not None:
        inputs.append(g.const(name + ".zero_points", _zero_point_bytes(w)))
    if bias is not None:
        inputs += [""] * (5 - len(inputs)) + [g.const(name + ".bias", bias.astype(np.float32))]
    out = name + "/out"
    main = out if w.correction is None else name + "/main"
    g.node(
        "MatMulNBits",
        inputs,
        [main],
        domain=MS_DOMAIN,
        K=w.k,
        N=w.n,
        bits=w.bits,
        block_size=w.block_size,
        accuracy_level=opt.accuracy_level,
    )
    if w.correction is not None:
        fix = g.node(
            "MatMul",
            [_block_sums(g, x, w, name), g.const(name + ".correction", np.ascontiguousarray(w.correction.T))],
            [name + "/correction"],
        )[0]
        g.node("Sub", [main, fix], [out])
    return out


def native_takes(w: CarriedBlocks) -> bool:
    """Whether the native op multiplies by ``w``'s GGUF bytes: Q4_K or Q6_K rows of whole super-blocks."""
    return w.raw is not None and w.source_type in NATIVE_TYPE_NUMBERS and w.k % QK_K == 0


def _add_native_linear(g, x: str, w: CarriedBlocks, name: str, bias: np.ndarray | None) -> str:
    out = name + "/out"
    product = out if bias is None else name + "/main"
    _native_node(g, x, w, name, product)
    if bias is not None:
        g.node("Add", [product, g.const(name + ".bias", bias.astype(np.float32))], [out])
    return out


def native_swiglu_takes(w: CarriedBlocks) -> bool:
    """Whether the native op computes silu(x @ gateᵀ) * (x @ upᵀ) over ``w``, the gate rows then the up
    rows: both halves whole records of 16 rows."""
    return native_takes(w) and w.n % (2 * RECORD_ROWS) == 0


def add_native_swiglu(g, x: str, w: CarriedBlocks, name: str, out: str) -> str:
    """``out = silu(x @ gateᵀ) * (x @ upᵀ)`` as one ``MatMulGGUF`` with ``glu=1`` over ``w`` (the gate rows,
    then as many up rows): no [rows, 2 × intermediate] product is written, split and read twice more, as the
    Split, activation and Mul nodes after a plain product would (a fifteenth of a long prompt's reading)."""
    if not native_swiglu_takes(w):
        raise ValueError(f"{name}: the native op takes no SwiGLU over these blocks")
    return _native_node(g, x, w, name, out, glu=1)


def _native_node(g, x: str, w: CarriedBlocks, name: str, out: str, **attributes) -> str:
    return _records_node(g, x, w.raw, NATIVE_TYPE_NUMBERS[w.source_type], w.n, w.k, name, out, **attributes)


def _records_node(g, x: str, raw: np.ndarray, kind: int, n: int, k: int, name: str, out: str, **attributes) -> str:
    """One ``MatMulGGUF`` over the GGUF bytes ``raw`` of a weight ``[n, k]`` whose rows may be zero-padded to whole
    super-blocks (the op's ``K`` is ``k``, the input's width); where they end at most 128 columns into the last,
    its records keep the sub-blocks that hold weights (``tail`` 4)."""
    records = interleave(raw, kind, n, record_width(k))
    if short_tail(kind, k):
        records = shorten_tail(records)
        attributes = {**attributes, "tail": SHORT_TAIL}
    g.node(
        "MatMulGGUF",
        [x, g.const(name + ".gguf_records", records)],
        [out],
        domain=NATIVE_DOMAIN,
        K=k,
        N=n,
        type=kind,
        **attributes,
    )
    return out


ROUNDED_PADDING = 0.15  # the most of a rounded row that may be zeros: 896 padded to 1024 is 1/7


def rounding_pads_little(width: int) -> bool:
    """Whether rows of ``width`` rounded to Q4_K read few padded columns (at most :data:`ROUNDED_PADDING`):
    a narrow matrix padded to a super-block would read several times its weights."""
    return record_width(width) - width <= ROUNDED_PADDING * record_width(width)


def rounded_native_takes(weight: np.ndarray, glu: bool = False) -> bool:
    """Whether :func:`add_rounded_native` takes a float ``weight`` [n, k]: rows padded little, and with ``glu``
    (gate rows then as many up rows) each half whole records of 16 rows."""
    return (
        weight.ndim == 2
        and rounding_pads_little(weight.shape[1])
        and (not glu or weight.shape[0] % (2 * RECORD_ROWS) == 0)
    )


def add_rounded_native(
    g, x: str, weight: np.ndarray, name: str, bias: np.ndarray | None = None, glu: bool = False, out: str | None = None
) -> str:
    """``x @ weightᵀ (+ bias)`` with a float ``weight`` [n, k] rounded to Q4_K (:func:`quantize_q4_k`) under the
    native ``MatMulGGUF`` op; ``glu``: ``out = silu(x @ gateᵀ) * (x @ upᵀ)`` over the gate rows then the up rows.

    Why: for a re-quantized model (the drafter, whose rounding moves only acceptance) the native op streams a
    one-row step's weights at the pace the target's run at, where ``MatMulNBits`` reads them slower on Intel's
    cores (it asks for no record ahead of the hardware prefetcher), and multiplies a prompt's rows several times
    faster (AMX's tiles, or 16 outputs a vector lane).  Rows of a width short of whole super-blocks (a hidden
    size of 896) are rounded with zeros after them, which decode to exact zeros; the op reads the input at its
    own width."""
    if isinstance(weight, DeferredMatrix) and not weight.reads_rows:
        weight = np.asarray(weight)  # read once, not once a band
    n, k = weight.shape
    pad = record_width(k) - k

    def read_rows(start: int, stop: int) -> np.ndarray:  # a band at a time: a deferred weight is never read whole
        band = read_band(weight, start, stop)
        return np.pad(band, ((0, 0), (0, pad))) if pad else band

    raw = quantize_q4_k(read_rows=read_rows, shape=(n, k + pad))
    if glu:
        return _records_node(g, x, raw, NATIVE_TYPE_NUMBERS["Q4_K"], n, k, name, out or name + "/glu", glu=1)
    result = name + "/out"
    product = result if bias is None else name + "/main"
    _records_node(g, x, raw, NATIVE_TYPE_NUMBERS["Q4_K"], n, k, name, product)
    if bias is not None:
        g.node("Add", [product, g.const(name + ".bias", bias.astype(np.float32))], [result])
    return result


def _block_sums(g, x: str, w: CarriedBlocks, name: str) -> str:
    """``x``'s sums over each of ``w``'s K blocks: ``[1, n, k / block_size]``."""
    shape = g.const(name + ".blocks", np.array([0, 0, w.k // w.block_size, w.block_size], np.int64))
    blocks = g.node("Reshape", [x, shape], [name + "/x_blocks"])[0]
    return g.node(
        "ReduceSum", [blocks, g.const(name + ".sum_axis", np.array([-1], np.int64))], [name + "/block_sums"], keepdims=0
    )[0]


def _with_block_sums(g, x: str, w: CarriedBlocks, name: str) -> str:
    """``x`` itself, or ``[x, sums, 0, sums, 0]`` with ``x``'s block sums padded to whole blocks: the input
    of :func:`fold_correction`'s two digits."""
    if w.correction is None:
        return x
    sums = _block_sums(g, x, w, name)
    pad = _sums_width(w) - w.k // w.block_size
    if pad:
        sums = g.node(
            "Pad",
            [sums, g.const(name + ".sums_pad", np.array([0, 0, 0, 0, 0, pad], np.int64))],
            [name + "/block_sums_padded"],
        )[0]
    return g.node("Concat", [x] + [sums] * CORRECTION_DIGITS, [name + "/x_and_sums"], axis=-1)[0]


NARROW_SCALES = (15.0, 14.5, 14.0, 13.5, 13.0)  # a block's range over these many steps: candidate scales
NARROW_BAND_BYTES = 1 << 20  # float32 rows rounded at a time, all workers together: several times this in temporaries


def narrow_to_4bit(w: CarriedBlocks, rows_per_chunk: int | None = None) -> CarriedBlocks:
    """An 8-bit carried weight (Q6_K, Q5_*, Q8_0) rounded once more, to 4-bit blocks of 32 with an integer
    zero point, so every matrix of a Q4_K_M model reads half a byte a weight: decoding is bound by the
    bytes the weights take, and on a Q4_K_M model those 8-bit rows (the LM head, half the down and V
    projections) are a large share of what a step reads.  Per block the scale is the one, among the
    block's range split into :data:`NARROW_SCALES` steps (a slightly finer step clips the extremes), with
    the least squared error, after a least-squares refit to the codes it chose; a 4-bit weight is
    returned unchanged.  Each weight moves by about half a 4-bit step of its block (more where a clipped
    extreme lowers the block's error): the ``small`` layout (``--gguf-layout small``) trades that
    fidelity for speed."""
    if w.bits != 8:
        return w
    n, width = w.n, 32
    if rows_per_chunk is None:  # the workers' float32 chunks together one quantize band (several temporaries each)
        rows_per_chunk = max(64, NARROW_BAND_BYTES // (4 * w.k) // parallel.WORKERS)
    starts = list(range(0, n, rows_per_chunk))
    packed, scales, zeros = [None] * len(starts), [None] * len(starts), [None] * len(starts)

    def narrow_chunk(index: int) -> None:  # chunks are independent: the same bytes on any number of cores
        start = starts[index]
        part = w.rows(np.arange(start, min(start + rows_per_chunk, n)))
        values = part.dequantize().reshape(part.n, -1, width).astype(np.float32)
        # an integer zero point puts 0 on the code grid: the range must reach it
        low, high = np.minimum(values.min(axis=-1), 0), np.maximum(values.max(axis=-1), 0)
        span = np.maximum(high - low, np.finfo(np.float32).tiny)
        codes, zero, scale, error = _fit_block_scale(values, low, span / NARROW_SCALES[0])
        for steps in NARROW_SCALES[1:]:  # per block, the candidate with the least error (the first on a tie)
            other_codes, other_zero, other_scale, other_error = _fit_block_scale(values, low, span / steps)
            better = other_error < error
            codes = np.where(better[..., None], other_codes, codes)
            zero, scale, error = (
                np.where(better, new, old)
                for new, old in ((other_zero, zero), (other_scale, scale), (other_error, error))
            )
        packed[index] = pack_codes(codes.astype(np.uint8), 4)
        scales[index] = scale.astype(np.float32)
        zeros[index] = zero.astype(np.uint8)

    parallel.each(narrow_chunk, range(len(starts)))
    return CarriedBlocks(np.concatenate(packed), np.concatenate(scales), np.concatenate(zeros), 4, width, w.source_type)


def round_q6k_to_q4k(w: CarriedBlocks) -> CarriedBlocks:
    """A carried Q6_K weight rounded once more, to GGUF's Q4_K blocks (:func:`quantize_q4_k`, llama.cpp's
    rounding of the Q6_K values), for the native op; any other weight unchanged.  A Q4_K_M model's Q6_K rows
    (the value projections and half the down projections) are 49 MiB of the 897 a native step of the default
    target reads: rounded, a one-row step is 1.05-1.08x faster, at top-1 agreement 0.962 against 0.987 with
    transformers' forward of the GGUF (the ``compact`` layout: docs/methods/gguf.md)."""
    if w.source_type != "Q6_K" or w.raw is None or w.k % QK_K:
        return w
    rounded = carry_gguf(quantize_q4_k(w.dequantize()), "Q4_K", w.n, w.k)
    return w if rounded is None else rounded


def coarse_head(w: CarriedBlocks, native: bool) -> CarriedBlocks:
    """An 8-bit LM head at 4 bits, for the pass that ranks its rows before the best ones are scored again
    from 8-bit rows (``DecoderGraphBuilder.rescored_logits``).  For the native op it is rounded to GGUF's Q4_K
    blocks (4.5 bits a weight): ``MatMulGGUF`` streams them faster than ``MatMulNBits`` streams
    :func:`narrow_to_4bit`'s blocks of 32 (5.1 bits with their float32 scales and zero points) and multiplies
    a verify pass's rows for little more than one row's price; elsewhere it is :func:`narrow_to_4bit`'s."""
    if not native or w.bits != 8 or w.k % QK_K:
        return narrow_to_4bit(w)
    raw = quantize_q4_k(read_rows=lambda start, stop: w.rows(np.arange(start, stop)).dequantize(), shape=(w.n, w.k))
    return carry_gguf(raw, "Q4_K", w.n, w.k)


def _fit_block_scale(values: np.ndarray, low: np.ndarray, scale: np.ndarray):
    """Codes, zero points, scales and squared errors of blocks ``values`` starting from ``scale``,
    refitted by least squares to the codes it chose (zero point held)."""
    codes, zero = _codes_for(values, low, scale)
    centred = codes - zero[..., None]
    norm = (centred * centred).sum(axis=-1)
    fitted = np.where(norm > 0, (values * centred).sum(axis=-1) / np.maximum(norm, 1e-30), scale)
    scale = np.where(fitted > 0, fitted, scale)
    codes, zero = _codes_for(values, low, scale)
    error = (((codes - zero[..., None]) * scale[..., None] - values) ** 2).sum(axis=-1)
    return codes, zero, scale, error


def _codes_for(values: np.ndarray, low: np.ndarray, scale: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """4-bit codes and the integer zero point of blocks ``values`` at ``scale`` (lowest value at code 0
    or the zero point rounded)."""
    safe = np.where(scale > 0, scale, 1.0).astype(np.float32)
    zero = np.clip(np.rint(-low / safe), 0, 15).astype(np.float32)
    codes = np.clip(np.rint(values / safe[..., None]) + zero[..., None], 0, 15)
    return codes, zero


def fast_layout(w: CarriedBlocks) -> CarriedBlocks:
    """``w`` in the layout ORT's CPU kernels run fastest (see the module docstring): 8-bit blocks of 16
    merged into blocks of 32, 4-bit zero points moved into the correction, then the correction folded
    into extra K blocks."""
    return fold_correction(_unfolded_fast_layout(w))


def _unfolded_fast_layout(w: CarriedBlocks) -> CarriedBlocks:
    return zero_points_into_correction(merge_half_blocks(w))


def zero_points_into_correction(w: CarriedBlocks) -> CarriedBlocks:
    """4-bit blocks ``s * (q - z) - c`` as ``s * (q - 8) - (c + s * (z - 8))``: the same weights with
    ORT's default zero point.  ORT's int8-activation kernel runs a matrix without zero points faster (one
    decode step of the lean Q4_K_M target: 84.0 against 93.8 ms on a 2-core AVX2 CPU), and the correction
    rides in the matmul anyway (:func:`fold_correction`).  Blocks without a correction (``narrow_to_4bit``'s)
    keep their zero points: folding one in would read as many bytes as the zero points cost."""
    if w.bits != 4 or w.zero_points is None or w.correction is None:
        return w
    shift = w.scales * (w.zero_points.astype(np.float32) - 8)
    return CarriedBlocks(w.packed, w.scales, None, 4, w.block_size, w.source_type, w.correction + shift)


def merge_half_blocks(w: CarriedBlocks) -> CarriedBlocks:
    """8-bit blocks of 16 whose codes lie within 32 of their zero point (Q6_K) as symmetric blocks of 32:
    each pair takes the signed scale of its larger-magnitude half divided by 4, so that half's codes are
    ``4 * (q - zero)`` exactly and the other half's are rounded to the nearest quarter step of the larger.
    Any other layout is returned unchanged."""
    if w.bits != 8 or w.block_size != 16 or w.k % 32 or w.correction is not None:
        return w
    zero = w.zero_points_or_default()
    step = max(1, BAND_ROWS // parallel.WORKERS)  # the workers share one band's memory
    bands = [(start, min(start + step, w.n)) for start in range(0, w.n, step)]
    widest = np.zeros(len(bands), np.int64)

    def measure(band: int) -> None:  # a band at a time: int32 copies of an embedding-sized head are gigabytes
        start, stop = bands[band]
        widest[band] = np.abs(_centred(w.packed[start:stop], zero[start:stop])).max(initial=0)

    parallel.each(measure, range(len(bands)))
    if widest.max(initial=0) > 32:
        return w
    n, blocks = w.scales.shape
    codes = np.empty((n, blocks // 2, 32), np.uint8)
    scale = np.empty((n, blocks // 2), np.float32)

    def merge(band: tuple[int, int]) -> None:  # each worker writes its own rows
        start, stop = band
        codes[start:stop], scale[start:stop] = _merged_rows(
            _centred(w.packed[start:stop], zero[start:stop]), w.scales[start:stop]
        )

    parallel.each(merge, bands)
    return CarriedBlocks(codes, scale, None, 8, 32, w.source_type)


BAND_ROWS = 4096  # rows of a carried weight rewritten at a time (each row on its own: the same result)


def _centred(packed: np.ndarray, zero: np.ndarray) -> np.ndarray:
    return unpack_codes(packed, 8).astype(np.int32) - zero[..., None].astype(np.int32)


def _merged_rows(centred: np.ndarray, scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """:func:`merge_half_blocks` of some rows: (codes [n, blocks / 2, 32], scales [n, blocks / 2])."""
    n, blocks = scales.shape
    values = (centred * scales[..., None]).reshape(n, blocks // 2, 32)  # float64, exact: what each weight is
    pair = scales.reshape(n, blocks // 2, 2)
    larger = np.take_along_axis(pair, np.abs(pair).argmax(axis=-1)[..., None], axis=-1)[..., 0]
    scale = (larger / 4).astype(np.float32)
    safe = np.where(scale == 0, 1, scale)
    values /= safe[..., None]  # in place, as the rounding below: one float64 temporary a band
    np.rint(values, out=values)
    np.clip(values, -128, 127, out=values)
    values += 128
    return values.astype(np.uint8), scale


CORRECTION_DIGITS = 2


def fold_correction(w: CarriedBlocks) -> CarriedBlocks:
    """``w`` with its correction ``c`` (one float per block) turned into weights that multiply ``x``'s
    block sums appended to ``x`` once per digit, each copy zero-padded to whole blocks: ``-c`` quantized
    symmetrically at ``w``'s bits in groups of one block, then what that left over quantized the same way,
    :data:`CORRECTION_DIGITS` times.  Two digits: at most 1/196 of a group's largest ``|c|`` at 4 bits,
    where one digit's 1/14, multiplied by block sums that outlier channels make large in every row, moved
    logits visibly.  The result has no correction; its K is ``w.k`` plus :func:`folded_width`."""
    if w.correction is None:
        return w
    n, sums = w.correction.shape
    pad = _sums_width(w) - sums
    half = 1 << (w.bits - 1)
    remainder = np.pad(-w.correction.astype(np.float64), ((0, 0), (0, pad))).reshape(n, -1, w.block_size)
    packed, scales = [w.packed], [w.scales]
    for _ in range(CORRECTION_DIGITS):
        scale = (np.abs(remainder).max(axis=-1) / (half - 1)).astype(np.float32)  # +-absmax both representable
        steps = np.rint(remainder / np.where(scale == 0, 1, scale)[..., None])
        remainder = remainder - steps * scale[..., None]
        packed.append(pack_codes((steps + half).astype(np.uint8), w.bits))
        scales.append(scale)
    zero = None
    if w.zero_points is not None:
        extra = np.full((n, sum(s.shape[1] for s in scales[1:])), half, np.uint8)
        zero = np.concatenate([w.zero_points, extra], axis=1)
    return CarriedBlocks(
        np.concatenate(packed, axis=1), np.concatenate(scales, axis=1), zero, w.bits, w.block_size, w.source_type
    )


def folded_width(w: CarriedBlocks) -> int:
    """How much wider than ``w.k`` the input of a folded correction is: one copy of the block sums per
    digit, each padded to whole blocks (0 without a correction)."""
    return 0 if w.correction is None else CORRECTION_DIGITS * _sums_width(w)


def _sums_width(w: CarriedBlocks) -> int:
    """One copy of ``x``'s block sums (one per K block of ``w``) padded to whole blocks."""
    sums = w.k // w.block_size
    return sums + -sums % w.block_size


# -- GGUF block layouts (ggml-common.h) -> codes, scales, zero points --------------------------------------


def _f16(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)[..., 0]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """GGUF's 4-bit layout: element j in the low nibble of byte j, element j + 16 in its high nibble."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _q4_0(b):
    return _nibbles(b[:, 2:]), _f16(b[:, :2]), None, None


def _q8_0(b):
    return (b[:, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8), _f16(b[:, :2]), None, None


def _q5_0(b):
    qh = np.unpackbits(np.ascontiguousarray(b[:, 2:6]), axis=-1, bitorder="little")
    codes = _nibbles(b[:, 6:]) | (qh << 4)
    return codes, _f16(b[:, :2]), np.full(len(b), 16, np.uint8), None


def _affine(codes: np.ndarray, d: np.ndarray, m: np.ndarray, top: int = 15):
    """Blocks of ``d * q - m`` as ``d * (q - z) - (m - d * z)``, z = m / d rounded into the code range
    ``0..top`` (see the module docstring); a block with d = 0 is the constant -m, all correction."""
    with np.errstate(divide="ignore", invalid="ignore"):
        exact = np.where(d == 0, 0.0, m / np.where(d == 0, 1.0, d))
    zero = np.clip(np.rint(exact), 0, top).astype(np.uint8)
    correction = (m - d * zero.astype(np.float32)).astype(np.float32)
    return codes, d.astype(np.float32), zero, correction


def _q4_1(b):
    return _affine(_nibbles(b[:, 4:]), _f16(b[:, :2]), -_f16(b[:, 2:4]))


def _q5_1(b):
    qh = np.unpackbits(np.ascontiguousarray(b[:, 4:8]), axis=-1, bitorder="little")
    return _affine(_nibbles(b[:, 8:]) | (qh << 4), _f16(b[:, :2]), -_f16(b[:, 2:4]), 255)


def _k_scales(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K super-block header: per sub-block scale d*sc and minimum dmin*m (6-bit sc, m packed in 12 bytes)."""
    n = len(b)
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    s = b[:, 4:16].reshape(n, 3, 4)
    sc = np.concatenate([s[:, 0] & 0x3F, (s[:, 2] & 0x0F) | ((s[:, 0] >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([s[:, 1] & 0x3F, (s[:, 2] >> 4) | ((s[:, 1] >> 2) & 0x30)], axis=-1)
    return (d[:, None] * sc.astype(np.float32)).reshape(-1), (dmin[:, None] * mn.astype(np.float32)).reshape(-1)


def _k_nibbles(qs: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K codes: four chunks of 32 bytes, low nibbles one sub-block of 32, high nibbles the next."""
    chunks = qs.reshape(len(qs), 4, 32)
    return np.stack([chunks & 0x0F, chunks >> 4], axis=2).reshape(len(qs), 8, 32)


def _q4_k(b):
    scale, minimum = _k_scales(b)
    return _affine(_k_nibbles(b[:, 16:]).reshape(-1, 32), scale, minimum)


def _q5_k(b):
    scale, minimum = _k_scales(b)
    high = (b[:, 16:48][:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1  # sub-block s: bit s
    return _affine((_k_nibbles(b[:, 48:]) | (high << 4)).reshape(-1, 32), scale, minimum, 255)


def _q6_k(b):
    n = len(b)
    ql, qh = b[:, :128].reshape(n, 2, 64), b[:, 128:192].reshape(n, 2, 32)
    sc = b[:, 192:208].view(np.int8).astype(np.float32)
    d = _f16(b[:, 208:210])
    low = np.stack([ql[..., :32] & 0x0F, ql[..., 32:] & 0x0F, ql[..., :32] >> 4, ql[..., 32:] >> 4], axis=2)
    high = np.stack([(qh >> shift) & 0x03 for shift in (0, 2, 4, 6)], axis=2)
    codes = (low | (high << 4)).reshape(n * 16, 16)
    scale = (d[:, None] * sc).reshape(-1).astype(np.float32)
    return codes, scale, np.full(n * 16, 32, np.uint8), None


#: GGUF type -> (bytes per GGUF block, elements per GGUF block, MatMulNBits bits, block size, decoder)
_LAYOUTS = {
    "Q4_0": (18, 32, 4, 32, _q4_0),
    "Q4_1": (20, 32, 4, 32, _q4_1),
    "Q4_K": (144, QK_K, 4, 32, _q4_k),
    "Q8_0": (34, 32, 8, 32, _q8_0),
    "Q5_0": (22, 32, 8, 32, _q5_0),
    "Q5_1": (24, 32, 8, 32, _q5_1),
    "Q5_K": (176, QK_K, 8, 32, _q5_k),
    "Q6_K": (210, QK_K, 8, 16, _q6_k),
}


def carry_gguf(raw: np.ndarray, gguf_type: str, n: int, k: int) -> CarriedBlocks | None:
    """The GGUF tensor bytes ``raw`` of a weight ``[n, k]`` (rows of K) as :class:`CarriedBlocks`, or None
    for a type that has no exact MatMulNBits layout."""
    if gguf_type not in _LAYOUTS:
        return None
    type_size, per_block, bits, block_size, decode = _LAYOUTS[gguf_type]
    if k % per_block:
        return None
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1, type_size)
    if len(blocks) != n * k // per_block:
        raise ValueError(f"{gguf_type} tensor of {len(blocks)} blocks cannot hold a [{n}, {k}] weight")
    k_blocks = k // block_size
    row_blocks = k // per_block  # GGUF blocks in a row: none spans two rows
    out: list[np.ndarray | None] = []
    for start in range(0, n, BAND_ROWS):  # a band of rows at a time: the decoders' temporaries stay small
        stop = min(start + BAND_ROWS, n)
        codes, scales, zero, correction = decode(blocks[start * row_blocks : stop * row_blocks])
        band = [pack_codes(codes.reshape(stop - start, k_blocks, block_size), bits), scales, zero, correction]
        if not out:
            out = [None if a is None else np.empty((n,) + a.reshape(stop - start, -1).shape[1:], a.dtype) for a in band]
        for whole, part in zip(out, band):
            if whole is not None:
                whole[start:stop] = part.reshape(whole[start:stop].shape)
    packed, scales, zero, correction = out
    raw_rows = blocks.reshape(n, -1) if gguf_type in NATIVE_TYPE_NUMBERS else None
    return CarriedBlocks(
        packed.reshape(n, k_blocks, -1), scales, zero, bits, block_size, gguf_type, correction, raw_rows
    )
