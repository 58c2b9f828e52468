"""What one MLP-shaped matmul of the target (K = 1536, N = 8960) costs over M prompt rows in each of ONNX
Runtime's CPU kernels that could carry it: ``MatMulNBits`` (4-bit blocks of 32, as the exported target runs
it, at accuracy level 4 and at the fp32 levels), ``DynamicQuantizeMatMul`` (int8 weights per column, MLAS's
QGEMM, which has an AMX kernel) and a float32 ``MatMul``.

Why: reading a long prompt is compute-bound, and on a CPU with AMX another runtime reads the same prompt
several times faster (docs/measurements.md).  This says how much of that a kernel ONNX Runtime already has
could win, before anything is built on it.  The int8 weights are another rounding of the model, so the number
is an upper bound for a prompt-reading path, not a verify path (a verify pass must compute what a one-row
pass computes).

    python benchmarks/studies/prefill_kernels.py --threads 2 [--rows 1,16,512] [--runs 7]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

K, N, BLOCK = 1536, 8960, 32


def one_node_session(node: helper.NodeProto, weights: dict[str, np.ndarray], threads: int) -> ort.InferenceSession:
    graph = helper.make_graph(
        [node],
        "matmul",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "M", K])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(value, name) for name, value in weights.items()],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    )
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def sessions(threads: int) -> dict[str, ort.InferenceSession]:
    """The candidate kernels over the same random weights (values do not change their speed)."""
    w = np.random.default_rng(0).standard_normal((N, K)).astype(np.float32) * 0.02
    blocks = w.reshape(N, K // BLOCK, BLOCK)
    scale = np.abs(blocks).max(-1) / 7 + 1e-12
    codes = (np.clip(np.round(blocks / scale[..., None]), -8, 7) + 8).astype(np.uint8)
    nibbles = {"qw": codes[..., 0::2] | (codes[..., 1::2] << 4), "s": scale.astype(np.float32).reshape(-1)}
    out = {}
    for level in (4, 0):
        node = helper.make_node(
            "MatMulNBits",
            ["x", "qw", "s"],
            ["y"],
            domain="com.microsoft",
            K=K,
            N=N,
            bits=4,
            block_size=BLOCK,
            accuracy_level=level,
        )
        out[f"MatMulNBits int4, accuracy level {level}"] = one_node_session(node, nibbles, threads)
    column_scale = np.abs(w).max(1) / 127
    int8 = {"w8": np.round(w / column_scale[:, None]).astype(np.int8).T.copy(), "ws": column_scale.astype(np.float32)}
    node = helper.make_node("DynamicQuantizeMatMul", ["x", "w8", "ws"], ["y"], domain="com.microsoft")
    out["DynamicQuantizeMatMul int8"] = one_node_session(node, int8, threads)
    out["MatMul fp32"] = one_node_session(helper.make_node("MatMul", ["x", "wt"], ["y"]), {"wt": w.T.copy()}, threads)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", default="1,16,512", help="comma list of row counts M")
    parser.add_argument("--runs", type=int, default=7, help="timed calls per kernel and M (the median is kept)")
    args = parser.parse_args()
    kernels = sessions(args.threads)
    rng = np.random.default_rng(1)
    print(f"K={K} N={N}, {args.threads} threads, ORT {ort.__version__}; median ms of {args.runs} calls")
    for m in (int(r) for r in args.rows.split(",")):
        x = rng.standard_normal((1, m, K)).astype(np.float32)
        times = {}
        for name, session in kernels.items():
            session.run(None, {"x": x})
            runs = []
            for _ in range(args.runs):
                start = time.perf_counter()
                session.run(None, {"x": x})
                runs.append(time.perf_counter() - start)
            times[name] = float(np.median(runs)) * 1e3
        base = times["MatMulNBits int4, accuracy level 4"]
        print(f"M={m}: " + ", ".join(f"{name} {ms:.2f} ms ({base / ms:.2f}x)" for name, ms in times.items()))


if __name__ == "__main__":
    main()
