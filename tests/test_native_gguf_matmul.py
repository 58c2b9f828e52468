"""The native MatMulGGUF op (``edge_spec/native/gguf_matmul.cc``): GGUF's Q4_K and Q6_K blocks times float rows.

The weights go in as ``edge_spec/export/gguf/interleaved.py`` rearranges GGUF's bytes.  The reference rounds
each row as the op does (int8 blocks of 256, one scale each), dequantizes GGUF's own bytes with the ``gguf``
package and multiplies in float64: the op's integer sums are exact, so only its float32 accumulation differs.
Every kernel the CPU has (AVX-512 with VNNI, AVX2 with or without AVX-VNNI, scalar; AMX's tiles for passes of many
rows) runs, each in a process of its own since a process picks its kernels once, and all give the same bits.
"""

from __future__ import annotations

import itertools
import os
import platform
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from onnx import TensorProto, helper, numpy_helper

from edge_spec.export.gguf.interleaved import deinterleave, interleave, record_width, shorten_tail
from edge_spec.export.gguf.q4_k import quantize_q4_k
from tests import tiny_models
from tests.helpers import native_first_output, native_kernels

Q4_K, Q6_K = 12, 14  # ggml's type numbers, the op's ``type`` attribute
GGML_TYPE = {Q4_K: GGMLQuantizationType.Q4_K, Q6_K: GGMLQuantizationType.Q6_K}
PATHS = {
    "avx512": {},
    "avxvnni": {"EDGE_SPEC_NATIVE_AVX512": "0"},
    "avx2": {"EDGE_SPEC_NATIVE_AVX512": "0", "EDGE_SPEC_NATIVE_AVX_VNNI": "0"},
    "scalar": {"EDGE_SPEC_NATIVE_SCALAR": "1"},
}
NO_AMX = {"EDGE_SPEC_NATIVE_AMX": "0"}
AMX_ROWS = 128 + 16 + 5  # a prompt's pass on AMX: nine row tiles (four pairs and one alone), 5 rows left over


def random_blocks(rng: np.random.Generator, kind: int, n: int, k: int) -> np.ndarray:
    return tiny_models.random_k_quant_blocks(rng, {Q4_K: "Q4_K", Q6_K: "Q6_K"}[kind], n, k)


def rounded_rows(x: np.ndarray) -> np.ndarray:
    """``x`` as the op reads it: per block of 256, codes round(x * 127 / max|x|) times max|x| / 127."""
    blocks = x.reshape(x.shape[0], -1, 256).astype(np.float32)
    amax = np.abs(blocks).max(axis=-1, keepdims=True)
    inverse = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    codes = np.rint(blocks * inverse)
    scale = (amax / np.float32(127)).astype(np.float32)
    return (codes.astype(np.float64) * scale.astype(np.float64)).reshape(x.shape)


def reference(x: np.ndarray, raw: np.ndarray, kind: int, k: int) -> np.ndarray:
    weights = dequantize(raw, GGML_TYPE[kind]).reshape(raw.shape[0], k).astype(np.float64)
    return rounded_rows(x) @ weights.T


def swiglu(both: np.ndarray) -> np.ndarray:
    """silu(gate) * up in float64 of products whose first half are the gates and second half the ups."""
    gate, up = np.split(both.astype(np.float64), 2, axis=-1)
    with np.errstate(over="ignore"):  # exp(-gate) of a gate far below zero: inf, silu 0
        return gate / (1.0 + np.exp(-gate)) * up


def swiglu_reference(x: np.ndarray, raw: np.ndarray, kind: int, k: int) -> np.ndarray:
    return swiglu(reference(x, raw, kind, k))


def records_model(
    records: np.ndarray, kind: int, n: int, k: int, glu: int = 0, declared: int | None = -1, **attrs
) -> bytes:
    """The op over the records ``records`` (as ``interleave`` lays them out, or with a short tail: ``tail=4``)
    reading inputs of width ``k``; the graph declares the input ``declared`` wide (-1: ``k``; None: any width, so
    the op itself checks it)."""
    node = helper.make_node(
        "MatMulGGUF", ["x", "w"], ["y"], domain="ai.edge_spec", K=k, N=n, type=kind, glu=glu, **attrs
    )
    graph = helper.make_graph(
        [node],
        "gguf_matmul",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, k if declared == -1 else declared])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, n // 2 if glu else n])],
        [numpy_helper.from_array(np.ascontiguousarray(records), "w")],
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("ai.edge_spec", 1)]
    return helper.make_model(graph, opset_imports=opsets).SerializeToString()


def model(raw: np.ndarray, kind: int, k: int, glu: int = 0) -> bytes:
    return records_model(interleave(raw, kind, raw.shape[0], k), kind, raw.shape[0], k, glu)


def session(native_library: Path, model_bytes: bytes, threads: int = 2) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.register_custom_ops_library(str(native_library))
    return ort.InferenceSession(model_bytes, options, providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("rows", [5, 13])  # within one loop over rows; more rows than one loop takes
@pytest.mark.parametrize("n", [80, 37])  # whole records of 16 rows; a last record padded with zero rows
@pytest.mark.parametrize("kind", [Q4_K, Q6_K])
def test_each_kernel_computes_the_blocks_product_with_the_same_bits(native_library, tmp_path, kind, n, rows):
    rng = np.random.default_rng(kind + n)
    k = 768  # three blocks a row
    raw = random_blocks(rng, kind, n, k)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    x[1, :256] = 0.0  # a block of zeros: scale 0, no division by it
    want = reference(x, raw, kind, k)
    results = {}
    for path in PATHS:
        if native_kernels(native_library, "EdgeSpecGGUFMatMulPath", PATHS[path]) != path:
            continue  # this CPU has no such kernel
        results[path] = native_first_output(native_library, model(raw, kind, k), {"x": x}, PATHS[path], tmp_path)
        assert results[path].shape == (rows, n)
        np.testing.assert_allclose(results[path], want, rtol=2e-5, atol=2e-5 * np.abs(want).max())
    assert "scalar" in results
    for path, got in results.items():
        assert np.array_equal(got, results["scalar"]), path


@pytest.mark.parametrize("kind", [Q4_K, Q6_K])
def test_the_largest_sums_a_block_can_reach_keep_their_bits(native_library, tmp_path, kind):
    """Every code and scale at its largest against activations all at +-127: the partial sums the kernels keep
    in 16-bit halves reach their bounds (Q4_K: 16 products of 15 x 127 = 30480), and every path still gives the
    reference's value with the scalar path's bits."""
    rng = np.random.default_rng(kind)
    k, n = 512, 48
    raw = random_blocks(rng, kind, n, k).reshape(n, k // 256, -1)
    if kind == Q4_K:
        raw[..., 4:] = 0xFF  # 6-bit scales and minimums 63, every 4-bit code 15
    else:
        raw[..., :192] = 0xFF  # every 6-bit code 63
        raw[..., 192:208] = 0x7F  # every sub-block scale 127
    raw = raw.reshape(n, -1)
    x = np.ones((9, k), dtype=np.float32)  # more rows than one loop over decoded weights takes
    x[1::2] = -1.0
    x[4, 256:] = -3.0  # a row whose blocks differ in sign
    want = reference(x, raw, kind, k)
    results = {}
    for path in PATHS:
        if native_kernels(native_library, "EdgeSpecGGUFMatMulPath", PATHS[path]) != path:
            continue
        results[path] = native_first_output(native_library, model(raw, kind, k), {"x": x}, PATHS[path], tmp_path)
        np.testing.assert_allclose(results[path], want, rtol=2e-5, atol=2e-5 * np.abs(want).max())
    for path, got in results.items():
        assert np.array_equal(got, results["scalar"]), path


@pytest.mark.parametrize("n", [96, 1184])  # 3 records of gate rows and 3 of up rows; 37 and 37: work items of
# 16 gate records and then their up records, the last item part-filled
@pytest.mark.parametrize("rows", [1, 13])
@pytest.mark.parametrize("kind", [Q4_K, Q6_K])
def test_each_kernel_computes_swiglu_over_gate_and_up_rows_with_the_same_bits(native_library, tmp_path, kind, rows, n):
    """``glu=1``: silu(x · gateᵀ) * (x · upᵀ), the gate rows first, in one op; every path the same bits."""
    rng = np.random.default_rng(kind + rows + n)
    k = 512
    raw = random_blocks(rng, kind, n, k)
    x = rng.standard_normal((rows, k)).astype(np.float32) * 4  # gates far into both tails of the sigmoid
    want = swiglu_reference(x, raw, kind, k)
    plain = session(native_library, model(raw, kind, k)).run(None, {"x": x})[0]
    results = {}
    for path in PATHS:
        if native_kernels(native_library, "EdgeSpecGGUFMatMulPath", PATHS[path]) != path:
            continue
        results[path] = native_first_output(native_library, model(raw, kind, k, glu=1), {"x": x}, PATHS[path], tmp_path)
        assert results[path].shape == (rows, n // 2)
        np.testing.assert_allclose(results[path], want, rtol=1e-4, atol=1e-5 * np.abs(want).max())
        # the plain op's sums: the fused op differs from them by its epilogue's rounding alone
        np.testing.assert_allclose(results[path], swiglu(plain), rtol=1e-6, atol=1e-30)
    for path, got in results.items():
        assert np.array_equal(got, results["scalar"]), path


def test_swiglu_rows_have_the_same_bits_whatever_the_rows_in_their_pass(native_library):
    rng = np.random.default_rng(11)
    k, n = 256, 64
    sess = session(native_library, model(random_blocks(rng, Q4_K, n, k), Q4_K, k, glu=1))
    x = rng.standard_normal((21, k)).astype(np.float32)
    together = sess.run(None, {"x": x})[0]
    for start, stop in [(0, 1), (9, 10), (20, 21), (2, 19)]:
        assert np.array_equal(sess.run(None, {"x": x[start:stop]})[0], together[start:stop]), (start, stop)


@pytest.mark.parametrize("kind", [Q4_K, Q6_K])
def test_the_reference_check_can_fail(native_library, kind):
    """A weight row off by one block's codes is caught: the tolerance above is far below a block's weight."""
    rng = np.random.default_rng(7)
    k, n = 512, 8
    raw = random_blocks(rng, kind, n, k)
    x = rng.standard_normal((2, k)).astype(np.float32)
    got = session(native_library, model(raw, kind, k)).run(None, {"x": x})[0]
    wrong = raw.copy()
    wrong[3, 20:40] ^= 0x11  # codes of one block of row 3
    want_wrong = reference(x, wrong, kind, k)
    assert not np.allclose(got[:, 3], want_wrong[:, 3], rtol=2e-5, atol=2e-5 * np.abs(want_wrong).max())


def cpu_vendor() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("vendor_id"):
            return line.split(":", 1)[1].strip()
    return ""


@pytest.mark.parametrize(
    ("export", "switch", "on", "off", "elsewhere"),
    [
        # the next record: one-row passes on Intel's cores, left to the hardware prefetcher elsewhere
        ("EdgeSpecGGUFOneRowPrefetch", "EDGE_SPEC_NATIVE_ONE_ROW_PREFETCH", "ahead", "none", "none"),
        # the record eight on: every pass on Intel's cores, verify passes of four rows and more elsewhere
        ("EdgeSpecGGUFFarPrefetch", "EDGE_SPEC_NATIVE_FAR_PREFETCH", "far", "near", "far from 4 rows"),
    ],
)
def test_prefetches_follow_the_cores_vendor_unless_their_switch_says_otherwise(
    native_library, export, switch, on, off, elsewhere
):
    if platform.machine() not in ("x86_64", "AMD64") or not Path("/proc/cpuinfo").exists():
        pytest.skip("the vendor's default is an x86 choice")

    def prefetch(env: dict[str, str]) -> str:
        return native_kernels(native_library, export, env)

    assert prefetch({}) == (on if cpu_vendor() == "GenuineIntel" else elsewhere)
    assert prefetch({switch: "1"}) == on
    assert prefetch({switch: "0"}) == off


SET_AND_ASK = """
import ctypes, sys
library = ctypes.CDLL(sys.argv[1])
library.EdgeSpecGGUFOneRowPrefetch.restype = ctypes.c_char_p
answers = []
for choice in (1, 0, -1):
    library.EdgeSpecGGUFSetOneRowPrefetch(choice)
    answers.append(library.EdgeSpecGGUFOneRowPrefetch().decode())
print(" ".join(answers))
"""


@pytest.mark.parametrize("switch, want", [("", None), ("1", "ahead ahead ahead"), ("0", "none none none")])
def test_a_measured_one_row_choice_holds_until_forgotten_and_the_switch_decides_over_it(native_library, switch, want):
    env = {**os.environ, "EDGE_SPEC_NATIVE_ONE_ROW_PREFETCH": switch}
    done = subprocess.run(
        [sys.executable, "-c", SET_AND_ASK, str(native_library)], env=env, capture_output=True, text=True, check=True
    )
    vendor = native_kernels(native_library, "EdgeSpecGGUFOneRowPrefetch", {"EDGE_SPEC_NATIVE_ONE_ROW_PREFETCH": ""})
    assert done.stdout.split() == (want or f"ahead none {vendor}").split()


SET_FAR_AND_ASK = """
import ctypes, sys
library = ctypes.CDLL(sys.argv[1])
library.EdgeSpecGGUFFarPrefetch.restype = ctypes.c_char_p
answers = []
for rows in (2, 1, 0, 8, -1):
    library.EdgeSpecGGUFSetFarRows(rows)
    answers.append(library.EdgeSpecGGUFFarPrefetch().decode().replace(" ", "_"))
print(" ".join(answers))
"""


@pytest.mark.parametrize("switch, want", [("", None), ("1", "far " * 5), ("0", "near " * 5)])
def test_a_measured_far_choice_holds_until_forgotten_and_the_switch_decides_over_it(native_library, switch, want):
    env = {**os.environ, "EDGE_SPEC_NATIVE_FAR_PREFETCH": switch}
    done = subprocess.run(
        [sys.executable, "-c", SET_FAR_AND_ASK, str(native_library)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    vendor = native_kernels(native_library, "EdgeSpecGGUFFarPrefetch", {"EDGE_SPEC_NATIVE_FAR_PREFETCH": ""})
    measured = f"far_from_2_rows far near far_from_8_rows {vendor.replace(' ', '_')}"
    assert done.stdout.split() == (want or measured).split()


@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("n", [80, 37])  # more records than the far prefetch's distance; a padded last record
@pytest.mark.parametrize("kind", [Q4_K, Q6_K])
def test_passes_have_the_same_bits_whatever_they_ask_ahead(native_library, tmp_path, kind, n, rows):
    rng = np.random.default_rng(23 + kind + n + rows)
    k = 768
    raw = random_blocks(rng, kind, n, k)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    want = reference(x, raw, kind, k)
    results = {}
    for path in PATHS:
        if native_kernels(native_library, "EdgeSpecGGUFMatMulPath", PATHS[path]) != path:
            continue  # this CPU has no such kernel
        # the next record (one-row Q4_K passes); the eighth on: never, every pass, the vendor's rows ("")
        for ahead, far in itertools.product("01", ("0", "1", "")):
            env = {**PATHS[path], "EDGE_SPEC_NATIVE_ONE_ROW_PREFETCH": ahead, "EDGE_SPEC_NATIVE_FAR_PREFETCH": far}
            results[path, ahead, far] = native_first_output(
                native_library, model(raw, kind, k), {"x": x}, env, tmp_path
            )
    baseline = results["scalar", "0", "0"]
    np.testing.assert_allclose(baseline, want, rtol=2e-5, atol=2e-5 * np.abs(want).max())
    for key, got in results.items():
        assert np.array_equal(got, baseline), key


@pytest.mark.parametrize("kind", [Q4_K, Q6_K])
def test_each_row_has_the_same_bits_whatever_the_rows_in_its_pass(native_library, kind):
    rng = np.random.default_rng(3)
    k, n = 512, 130
    sess = session(native_library, model(random_blocks(rng, kind, n, k), kind, k))
    x = rng.standard_normal((37, k)).astype(np.float32)  # more rows than one loop over decoded weights takes
    together = sess.run(None, {"x": x})[0]
    for start, stop in [(0, 1), (5, 6), (16, 17), (36, 37), (3, 20)]:
        alone = sess.run(None, {"x": x[start:stop]})[0]
        assert np.array_equal(alone, together[start:stop]), (start, stop)


def test_batch_dimensions_pass_through(native_library):
    rng = np.random.default_rng(4)
    k, n = 256, 16
    raw = random_blocks(rng, Q4_K, n, k)
    x = rng.standard_normal((2, 3, k)).astype(np.float32)
    node = helper.make_node("MatMulGGUF", ["x", "w"], ["y"], domain="ai.edge_spec", K=k, N=n, type=Q4_K)
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3, n])],
        [numpy_helper.from_array(interleave(raw, Q4_K, n, k), "w")],
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("ai.edge_spec", 1)]
    sess = session(native_library, helper.make_model(graph, opset_imports=opsets).SerializeToString())
    got = sess.run(None, {"x": x})[0]
    np.testing.assert_allclose(got.reshape(6, n), reference(x.reshape(6, k), raw, Q4_K, k), rtol=2e-5, atol=1e-4)


@pytest.mark.parametrize(
    "attrs, error",
    [
        ({"K": 0, "N": 4, "type": Q4_K}, "K, N and type"),
        ({"K": 256, "N": 4, "type": 8}, "K, N and type"),
        ({"K": 256, "type": Q4_K}, "K, N and type"),
        ({"K": 256, "N": 48, "type": Q4_K, "glu": 1}, "glu is 0 or 1"),  # half a record of up rows
        ({"K": 256, "N": 64, "type": Q4_K, "glu": 2}, "glu is 0 or 1"),
        ({"K": 768, "N": 16, "type": Q4_K, "tail": 4}, "tail is 8, or 4 for Q4_K"),  # whole blocks
        ({"K": 641, "N": 16, "type": Q4_K, "tail": 4}, "tail is 8, or 4 for Q4_K"),  # 129 columns into the last
        ({"K": 640, "N": 16, "type": Q6_K, "tail": 4}, "tail is 8, or 4 for Q4_K"),
        ({"K": 640, "N": 16, "type": Q4_K, "tail": 3}, "tail is 8, or 4 for Q4_K"),  # no such record layout
    ],
)
def test_unusable_attributes_are_one_clear_error(native_library, attrs, error):
    node = helper.make_node("MatMulGGUF", ["x", "w"], ["y"], domain="ai.edge_spec", **attrs)
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, attrs["K"]])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(np.zeros((4, 144), np.uint8), "w")],
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("ai.edge_spec", 1)]
    with pytest.raises(Exception, match=error):
        session(native_library, helper.make_model(graph, opset_imports=opsets).SerializeToString()).run(
            None, {"x": np.zeros((1, attrs["K"]), np.float32)}
        )


def narrow_model(raw: np.ndarray, kind: int, k: int, glu: int = 0, declared: int | None = -1) -> bytes:
    """The op over records of whole super-blocks (``raw``'s width) reading inputs of width ``k`` (fewer)."""
    n, padded = raw.shape[0], raw.shape[1] // tiny_models.K_QUANT_BYTES[{Q4_K: "Q4_K", Q6_K: "Q6_K"}[kind]] * 256
    return records_model(interleave(raw, kind, n, padded), kind, n, k, glu, declared)


@pytest.mark.parametrize("rows", [1, 5, AMX_ROWS])  # a step, a verify pass, a prompt's pass (AMX where there is one)
@pytest.mark.parametrize("kind", [Q4_K, Q6_K])
def test_an_input_narrower_than_its_blocks_reads_as_if_zeros_followed_it(native_library, tmp_path, kind, rows):
    """A hidden size of 896 (3.5 super-blocks): rows of width K against records of ceil(K / 256) blocks give
    what the whole width gives with zeros after the row, on every kernel with the same bits (the records'
    last columns need not be zero: the zeros of the input are what make them add nothing)."""
    rng = np.random.default_rng(kind + rows)
    n, k, padded = 64, 640, 768
    raw = random_blocks(rng, kind, n, padded)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    whole = np.concatenate([x, np.zeros((rows, padded - k), np.float32)], axis=1)
    want = session(native_library, model(raw, kind, padded)).run(None, {"x": whole})[0]
    np.testing.assert_allclose(want, reference(whole, raw, kind, padded), rtol=2e-5, atol=2e-5 * np.abs(want).max())
    for path in PATHS:
        if native_kernels(native_library, "EdgeSpecGGUFMatMulPath", PATHS[path]) != path:
            continue
        got = native_first_output(native_library, narrow_model(raw, kind, k), {"x": x}, PATHS[path], tmp_path)
        assert np.array_equal(got, want), path  # every kernel gives the whole width's bits
    glu = native_first_output(native_library, narrow_model(raw, kind, k, glu=1), {"x": x}, {}, tmp_path)
    np.testing.assert_allclose(glu, swiglu(want), rtol=1e-6, atol=1e-30)


def rounded_padded(rng: np.random.Generator, n: int, k: int) -> np.ndarray:
    """Q4_K bytes of a random ``[n, k]`` weight padded with zeros to whole super-blocks, as the export rounds a
    drafter's 896-wide rows."""
    weight = rng.standard_normal((n, k)).astype(np.float32)
    pad = record_width(k) - k
    return quantize_q4_k(read_rows=lambda a, b: np.pad(weight[a:b], ((0, 0), (0, pad))), shape=(n, k + pad))


@pytest.mark.parametrize("rows", [1, 5, 13, AMX_ROWS])  # a step, a verify pass, two row loops, a prompt's pass
@pytest.mark.parametrize("k", [640, 896])  # rows ending 128 columns into their last super-block
def test_records_with_a_short_tail_give_the_whole_records_bits(native_library, tmp_path, k, rows):
    """A last super-block holding at most 128 of a row's weights keeps its first four sub-blocks' code lines alone
    (``tail`` 4): every kernel gives the whole records' bits, SwiGLU included, from fewer bytes, and the records
    turn back into the same GGUF bytes."""
    rng = np.random.default_rng(k + rows)
    n, padded = 64, record_width(k)
    raw = rounded_padded(rng, n, k)
    whole = interleave(raw, Q4_K, n, padded)
    short = shorten_tail(whole)
    assert short.nbytes == whole.nbytes - n // 16 * 1024  # 16 lines of 64 bytes fewer a tile
    np.testing.assert_array_equal(deinterleave(short, Q4_K, n, padded, tail=4), raw)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    for glu in (0, 1):
        want = native_first_output(native_library, records_model(whole, Q4_K, n, k, glu), {"x": x}, {}, tmp_path)
        for path in PATHS:
            if native_kernels(native_library, "EdgeSpecGGUFMatMulPath", PATHS[path]) != path:
                continue
            got = native_first_output(
                native_library, records_model(short, Q4_K, n, k, glu, tail=4), {"x": x}, PATHS[path], tmp_path
            )
            assert np.array_equal(got, want), (path, glu)


def test_a_tail_that_holds_weights_is_not_shortened(native_library):
    raw = random_blocks(np.random.default_rng(3), Q4_K, 16, 768)  # every sub-block holds weights
    with pytest.raises(ValueError, match="sub-blocks 4-7 hold weights"):
        shorten_tail(interleave(raw, Q4_K, 16, 768))


def test_an_input_wider_than_k_is_refused_even_where_the_blocks_would_hold_it(native_library):
    raw = random_blocks(np.random.default_rng(8), Q4_K, 16, 256)
    sess = session(native_library, narrow_model(raw, Q4_K, 200, declared=None))
    with pytest.raises(Exception, match="last dimension must be K"):
        sess.run(None, {"x": np.zeros((1, 256), np.float32)})


def test_weights_of_another_size_are_one_clear_error(native_library):
    """The op never reads past its weights: a tensor of the wrong size is refused before any product."""
    raw = random_blocks(np.random.default_rng(6), Q4_K, 4, 256)[:, :-1]
    node = helper.make_node("MatMulGGUF", ["x", "w"], ["y"], domain="ai.edge_spec", K=256, N=4, type=Q4_K)
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 256])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(np.ascontiguousarray(raw), "w")],
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("ai.edge_spec", 1)]
    sess = session(native_library, helper.make_model(graph, opset_imports=opsets).SerializeToString())
    with pytest.raises(Exception, match="weights must hold N rows"):
        sess.run(None, {"x": np.zeros((1, 256), np.float32)})


def test_an_input_of_another_width_is_one_clear_error(native_library):
    raw = random_blocks(np.random.default_rng(5), Q4_K, 4, 256)
    node = helper.make_node("MatMulGGUF", ["x", "w"], ["y"], domain="ai.edge_spec", K=256, N=4, type=Q4_K)
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, None])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(raw, "w")],
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("ai.edge_spec", 1)]
    sess = session(native_library, helper.make_model(graph, opset_imports=opsets).SerializeToString())
    with pytest.raises(Exception, match="last dimension must be K"):
        sess.run(None, {"x": np.zeros((1, 512), np.float32)})


def cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def test_the_avx2_kernels_take_avx_vnni_products_where_the_cpu_has_them_unless_switched_off(native_library):
    has = {"avx2", "avx_vnni"} <= cpu_flags()
    assert (native_kernels(native_library, "EdgeSpecGGUFMatMulPath", PATHS["avxvnni"]) == "avxvnni") is has
    assert native_kernels(native_library, "EdgeSpecGGUFMatMulPath", PATHS["avx2"]) in ("avx2", "scalar")


def amx_here(native_library) -> bool:
    return native_kernels(native_library, "EdgeSpecGGUFPromptPath", {}) == "amx"


def test_passes_of_many_rows_use_amx_where_the_cpu_has_its_int8_products_unless_switched_off(native_library):
    flags = cpu_flags()
    has = {"amx_tile", "amx_int8", "avx512_vnni"} <= flags
    assert (native_kernels(native_library, "EdgeSpecGGUFPromptPath", {}) == "amx") is has
    assert native_kernels(native_library, "EdgeSpecGGUFPromptPath", NO_AMX) == ""
    assert native_kernels(native_library, "EdgeSpecGGUFPromptPath", PATHS["avx2"]) == ""  # AMX's sums meet AVX-512's


@pytest.mark.parametrize("glu", [0, 1])
@pytest.mark.parametrize("kind", [Q4_K, Q6_K])
def test_passes_of_many_rows_on_amx_have_the_other_kernels_bits(native_library, tmp_path, kind, glu):
    """A prompt-sized pass on AMX's tiles: the products of the reference, and the bits of the AVX-512 and scalar
    kernels, over blocks in chunks (10 blocks: 4, 4, 2), work items of 8 weight tiles and a last one part-filled,
    and (without glu) a last tile of 5 outputs."""
    if not amx_here(native_library):
        pytest.skip("this CPU has no AMX int8 products")
    rng = np.random.default_rng(kind + glu)
    k = 2560
    n = 352 if glu else 16 * 13 + 5  # glu: 11 tiles of gate rows and 11 of up rows
    raw = random_blocks(rng, kind, n, k)
    x = rng.standard_normal((AMX_ROWS, k)).astype(np.float32) * (4 if glu else 1)
    x[1, :256] = 0.0  # a block of zeros: scale 0
    graph = model(raw, kind, k, glu=glu)
    amx = native_first_output(native_library, graph, {"x": x}, {}, tmp_path)
    want = swiglu_reference(x, raw, kind, k) if glu else reference(x, raw, kind, k)
    np.testing.assert_allclose(amx, want, rtol=1e-4 if glu else 2e-5, atol=2e-5 * np.abs(want).max())
    for env in (NO_AMX, PATHS["scalar"]):
        assert np.array_equal(amx, native_first_output(native_library, graph, {"x": x}, env, tmp_path)), env


@pytest.mark.parametrize("kind", [Q4_K, Q6_K])
def test_the_largest_weights_amx_unpacks_keep_their_bits(native_library, tmp_path, kind):
    """The weights at the ends of what AMX's unpacked bytes hold: Q4_K's scales 63 and codes 15 (high and low
    parts 105), Q6_K's scale -128 at code 0 (weight 4096, high part 64) and 127 at code 63, against activations
    at +-127."""
    if not amx_here(native_library):
        pytest.skip("this CPU has no AMX int8 products")
    rng = np.random.default_rng(kind)
    k, n = 512, 48
    raw = random_blocks(rng, kind, n, k).reshape(n, k // 256, -1)
    if kind == Q4_K:
        raw[..., 4:] = 0xFF
    else:
        raw[:24, :, :192] = 0x00  # codes 0: weight -128 x (0 - 32)
        raw[:24, :, 192:208] = 0x80
        raw[24:, :, :192] = 0xFF  # codes 63: weight 127 x 31
        raw[24:, :, 192:208] = 0x7F
    raw = raw.reshape(n, -1)
    x = np.ones((AMX_ROWS, k), dtype=np.float32)
    x[1::2] = -1.0
    x[4, 256:] = -3.0
    graph = model(raw, kind, k)
    amx = native_first_output(native_library, graph, {"x": x}, {}, tmp_path)
    want = reference(x, raw, kind, k)
    np.testing.assert_allclose(amx, want, rtol=2e-5, atol=2e-5 * np.abs(want).max())
    assert np.array_equal(amx, native_first_output(native_library, graph, {"x": x}, PATHS["scalar"], tmp_path))


@pytest.mark.parametrize("kind", [Q4_K, Q6_K])
def test_a_row_read_in_a_prompt_pass_has_the_bits_it_has_alone(native_library, kind):
    """Batch invariance across the kernels: a row in a pass of AMX's size and the same row in a pass of one (the
    AVX-512 or AVX2 kernel) or of eight give the same bits, so a prompt's keys and values are the ones its tokens
    decoded one by one would have."""
    rng = np.random.default_rng(5)
    k, n = 768, 96
    sess = session(native_library, model(random_blocks(rng, kind, n, k), kind, k))
    x = rng.standard_normal((AMX_ROWS, k)).astype(np.float32)
    together = sess.run(None, {"x": x})[0]
    for start, stop in [(0, 1), (17, 18), (AMX_ROWS - 1, AMX_ROWS), (40, 48)]:
        assert np.array_equal(sess.run(None, {"x": x[start:stop]})[0], together[start:stop]), (start, stop)
