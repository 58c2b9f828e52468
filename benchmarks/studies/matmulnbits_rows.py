"""How a MatMulNBits (int4 weights) node's latency grows with the number of rows, i.e. verify positions.

Speculative decoding pays when a target pass over γ + 1 positions costs about what a one-position step
costs (memory-bound).  This times one isolated node of the target's shapes for M = 1..8 rows, per
accuracy level and block size, and a small node whose weights stay in cache: if the in-cache node grows
linearly with M too, the kernel is compute-bound for M >= 2, and no schedule can make long drafts pay.

    python benchmarks/studies/matmulnbits_rows.py --threads 2
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper


def matmul_session(k: int, n: int, block_size: int, accuracy_level: int, threads: int) -> ort.InferenceSession:
    """One MatMulNBits node with random 4-bit weights (values do not change its speed)."""
    rng = np.random.default_rng(0)
    weights = rng.integers(0, 255, (n, k // block_size, block_size // 2), dtype=np.uint8)
    scales = (rng.random(n * k // block_size) * 0.01).astype(np.float32)
    node = helper.make_node(
        "MatMulNBits",
        ["A", "B", "scales"],
        ["Y"],
        domain="com.microsoft",
        K=k,
        N=n,
        bits=4,
        block_size=block_size,
        accuracy_level=accuracy_level,
    )
    graph = helper.make_graph(
        [node],
        "matmul",
        [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["M", k])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["M", n])],
        [numpy_helper.from_array(weights, "B"), numpy_helper.from_array(scales, "scales")],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    )
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def median_microseconds(session: ort.InferenceSession, rows: int, k: int, repeats: int) -> float:
    a = np.random.default_rng(1).random((rows, k), dtype=np.float32)
    for _ in range(repeats // 5):
        session.run(None, {"A": a})
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        session.run(None, {"A": a})
        times.append(time.perf_counter() - started)
    return float(np.median(times)) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,2,3,4,8")
    ap.add_argument("--repeats", type=int, default=100)
    args = ap.parse_args()
    rows = [int(m) for m in args.rows.split(",")]
    cases = [  # (K, N, block size, accuracy level, what)
        (1536, 8960, 32, 4, "target MLP up, int8 activations (the bundle's setting)"),
        (1536, 8960, 32, 0, "target MLP up, fp32 activations"),
        (1536, 8960, 128, 4, "target MLP up, block 128"),
        (1536, 1536, 32, 4, "1.2 MB of weights: stays in cache"),
    ]
    print(f"µs per call, {args.threads} threads, rows {rows}")
    for k, n, block, level, what in cases:
        session = matmul_session(k, n, block, level, args.threads)
        times = [median_microseconds(session, m, k, args.repeats) for m in rows]
        per_row = " ".join(f"{t / times[0]:.2f}" for t in times)
        print(
            f"K={k} N={n} block {block} level {level} ({what}): "
            + " ".join(f"{t:.0f}" for t in times)
            + f"   (x M=1: {per_row})"
        )


if __name__ == "__main__":
    main()
