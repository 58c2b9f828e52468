"""A batch-invariant int4 matmul kernel against ONNX Runtime's ``MatMulNBits``, by rows: a study.

Why: on a CPU the verify pass's price per extra row decides how long drafts may be, and MLAS's int8-
activation ``MatMulNBits`` kernel is compute-bound from two rows on (each extra row costs most of what
the first did; measured figures in the README), where OpenVINO's CPU plugin verifies 17 rows for a small
multiple of one.  ``int4_rows.c`` computes the same thing (symmetric int4 weights in blocks
of 32, activations quantized to int8 per row and block) with each output element's instructions fixed
whatever the number of rows or threads: weights repacked so that one VNNI instruction multiplies 16
columns by 4 inputs (on AVX2, eight ``vpmaddubsw`` summed in 16 bits and one ``vpmaddwd`` take 8 columns
by a block's 32 inputs), unpacked once per block and reused for every row.  This script builds it
(gcc, ``-march=native``: AVX-512 VNNI where the CPU has it, else AVX2), checks it against MLAS (same
quantization: results within float rounding) and against itself (bit-identical rows for every row count
and thread count), and times both for 1..17 rows.

Not wired into the runtime: that needs an ONNX Runtime custom-op library, built against ORT's C API
headers, which no local package ships.

    python benchmarks/studies/kernels/int4_rows.py [--k 1536 --n 8960] [--threads 2]
"""

from __future__ import annotations

import argparse
import ctypes
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

SOURCE = Path(__file__).with_name("int4_rows.c")
ROWS = (1, 2, 3, 4, 5, 8, 9, 12, 16, 17)
P = ctypes.c_void_p


def build(out_dir: Path) -> ctypes.CDLL:
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    if shutil.which("gcc") is None or not {"avx512_vnni", "avx2"} & set(flags.split()):
        sys.exit("needs gcc and a CPU with AVX2 or AVX-512 VNNI")
    library = out_dir / "libint4_rows.so"
    subprocess.run(
        ["gcc", "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", str(SOURCE), "-o", str(library)], check=True
    )
    return ctypes.CDLL(str(library))


def mlas_session(packed: np.ndarray, scales: np.ndarray, k: int, n: int, threads: int) -> ort.InferenceSession:
    node = helper.make_node(
        "MatMulNBits",
        ["A", "B", "scales"],
        ["Y"],
        domain="com.microsoft",
        K=k,
        N=n,
        bits=4,
        block_size=32,
        accuracy_level=4,
    )
    graph = helper.make_graph(
        [node],
        "m",
        [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["M", k])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["M", n])],
        [numpy_helper.from_array(packed, "B"), numpy_helper.from_array(scales.reshape(-1), "scales")],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    )
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def median_us(fn, repeats: int = 40) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return float(np.median(times)) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--k", type=int, default=1536)
    ap.add_argument("--n", type=int, default=8960, help="a multiple of 16")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    k, n, most = args.k, args.n, max(ROWS)
    rng = np.random.default_rng(0)
    packed = rng.integers(0, 256, (n, k // 32, 16), dtype=np.uint8)
    scales = (rng.random((n, k // 32)) * 0.01 + 0.001).astype(np.float32)
    with tempfile.TemporaryDirectory() as tmp:
        lib = build(Path(tmp))
        weights, block_scales = np.empty(n * k // 2, np.uint8), np.empty(n * k // 32, np.float32)
        lib.q4_repack(
            packed.ctypes.data_as(P),
            scales.ctypes.data_as(P),
            n,
            k,
            weights.ctypes.data_as(P),
            block_scales.ctypes.data_as(P),
        )
        scratch = (
            np.empty(most * k, np.int8),
            np.empty(most * k // 32, np.int32),
            np.empty(most * k // 32, np.float32),
        )

        def ours(a: np.ndarray, threads: int = args.threads) -> np.ndarray:
            a = np.ascontiguousarray(a, np.float32)
            y = np.empty((a.shape[0], n), np.float32)
            lib.q4_matmul(
                a.ctypes.data_as(P),
                a.shape[0],
                k,
                n,
                weights.ctypes.data_as(P),
                block_scales.ctypes.data_as(P),
                y.ctypes.data_as(P),
                threads,
                *(s.ctypes.data_as(P) for s in scratch),
            )
            return y

        mlas = mlas_session(packed, scales, k, n, args.threads)
        a = rng.standard_normal((most, k)).astype(np.float32)
        reference, mine = mlas.run(None, {"A": a})[0], ours(a)
        print(f"max |ours - MLAS| {np.abs(reference - mine).max():.2e} (outputs up to {np.abs(reference).max():.1f})")
        rows_ok = all(np.array_equal(ours(a[:m])[i], mine[i]) for m in range(1, most + 1) for i in range(m))
        threads_ok = all(np.array_equal(ours(a[i : i + 1], threads=1)[0], mine[i]) for i in range(most))
        print(f"each row bit-identical whatever the rows: {rows_ok}; whatever the threads: {threads_ok}")
        theirs = [median_us(lambda: mlas.run(None, {"A": a[:m]})) for m in ROWS]
        ours_us = [median_us(lambda: ours(a[:m])) for m in ROWS]
        print("rows     " + " ".join(f"{m:6d}" for m in ROWS))
        print("MLAS µs  " + " ".join(f"{t:6.0f}" for t in theirs))
        print("ours µs  " + " ".join(f"{t:6.0f}" for t in ours_us))


if __name__ == "__main__":
    main()
