"""Two builds of ``MatMulGGUF`` streaming one matrix larger than the CPU's caches, in one process, runs alternated.

A decode step reads each weight once from memory, so how a kernel asks for its records (software prefetches,
their distance, the order of its loads) decides its rate more than its arithmetic.  The whole-target A/B
(``benchmarks/native_ab.py``) shows what a change does to a pass; this one isolates one format and one row
count: a seeded Q4_K or Q6_K matrix of ``--n`` rows of ``--k`` (42 MB in Q4_K at the defaults, past a 32 MB
L3), both builds' sessions on it, each timed ``--rounds`` times in turn with ten calls a time, the fastest
kept.  Reported: GB/s of records read per row count, and whether both builds gave the same bits.  Sessions
do not spin between runs, so the idle one leaves the cores to the other.

    python benchmarks/studies/kernels/gguf_stream_ab.py --before REV [--type Q4_K] [--rows 1,2,4,8]
    python benchmarks/studies/kernels/gguf_stream_ab.py --libraries A.so,B.so --type Q6_K

``EDGE_SPEC_NATIVE_AVX512=0`` in the environment times both builds' AVX2 kernels.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import onnxruntime as ort  # noqa: E402
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from edge_spec.bench.native_builds import build_revision  # noqa: E402
from edge_spec.export.gguf.interleaved import TYPE_NUMBER, interleave  # noqa: E402
from edge_spec.native import build  # noqa: E402
from tests.tiny_models import random_k_quant_blocks  # noqa: E402


def matmul_model(raw: np.ndarray, kind: str, k: int) -> bytes:
    type_number = TYPE_NUMBER[kind]
    n = raw.shape[0]
    node = helper.make_node("MatMulGGUF", ["x", "w"], ["y"], domain="ai.edge_spec", K=k, N=n, type=type_number)
    graph = helper.make_graph(
        [node],
        "gguf_stream",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, n])],
        [numpy_helper.from_array(interleave(raw, type_number, n, k), "w")],
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("ai.edge_spec", 1)]
    return helper.make_model(graph, opset_imports=opsets).SerializeToString()


def session(library: Path, model: bytes, threads: int) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.log_severity_level = 3
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.register_custom_ops_library(str(library))
    return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--before", help="a git revision whose native sources are the other side")
    which.add_argument("--libraries", help="two built libraries, comma separated")
    parser.add_argument("--type", choices=sorted(TYPE_NUMBER), default="Q4_K")
    parser.add_argument("--k", type=int, default=1536)
    parser.add_argument("--n", type=int, default=49152)
    parser.add_argument("--rows", default="1,2,4,8")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    if args.k % 256 or args.n % 16:
        parser.error("--k must be a multiple of 256 and --n of 16")
    with tempfile.TemporaryDirectory(prefix="edge-spec-stream-ab-") as scratch:
        if args.before:
            current = build.required_library_path()
            if current is None:
                sys.exit("the native ops cannot be built here")
            libraries = [build_revision(args.before, Path(scratch)), current]
            labels = [f"{args.before} (before)", "working tree"]
        else:
            libraries = [Path(p) for p in args.libraries.split(",")]
            if len(libraries) != 2:
                parser.error("--libraries takes two paths")
            labels = [p.name for p in libraries]
        raw = random_k_quant_blocks(np.random.default_rng(0), args.type, args.n, args.k)
        model = matmul_model(raw, args.type, args.k)
        sessions = [session(library, model, args.threads) for library in libraries]
        mb = raw.nbytes / 1e6
        rng = np.random.default_rng(1)
        print(f"{args.type} {args.n} x {args.k} ({mb:.1f} MB), {args.threads} threads, fastest of {args.rounds} rounds")
        print(f"{'rows':>4}  " + "  ".join(f"{label:>22}" for label in labels) + "  same bits")
        for rows in (int(r) for r in args.rows.split(",")):
            x = rng.standard_normal((rows, args.k)).astype(np.float32)
            outputs = [s.run(None, {"x": x})[0] for s in sessions]
            best = [float("inf")] * len(sessions)
            for _ in range(args.rounds):
                for i, s in enumerate(sessions):
                    start = time.perf_counter()
                    for _ in range(10):
                        s.run(None, {"x": x})
                    best[i] = min(best[i], (time.perf_counter() - start) / 10)
            rates = "  ".join(f"{mb / b / 1e3:11.1f} GB/s {b * 1e3:5.2f} ms" for b in best)
            print(f"{rows:4d}  {rates}  {np.array_equal(outputs[0], outputs[1])}")


if __name__ == "__main__":
    main()
