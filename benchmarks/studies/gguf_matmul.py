"""The native MatMulGGUF op against the lean layout's MatMulNBits, projection by projection, on the real target.

For every layer of the target, each projection twice: as the bundle's own ``MatMulNBits`` node (its packed
weights, scales and zero points, K widened by the folded correction's rows) and as ``MatMulGGUF`` over the
GGUF file's Q4_K / Q6_K bytes (``edge_spec/export/gguf/interleaved.py``; the fused gate and up projections
as one op over both tensors' rows, q, k and v as one where they share a type).  All 28 layers' copies of a
projection sit in one graph, so the weights stream from memory as in a decode step; the graphs take turns
over ``--repeats`` rounds (each run three times a turn, the first untimed: a virtual machine may page out
weights left idle while the others run) and each keeps its fastest.  Reported: milliseconds per layer, MB read per layer
and GB/s, at 1 row (a decode step) and at ``--rows`` (a verify pass).  The block sums the lean layout
appends to each input are left out of its time.

Usage::

    python benchmarks/studies/gguf_matmul.py [--bundle BUNDLE] [--gguf models/gguf/TARGET.gguf] [--rows 1,4]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import onnx  # noqa: E402
import onnxruntime as ort  # noqa: E402
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from edge_spec.export.gguf.interleaved import TYPE_NUMBER, interleave  # noqa: E402
from edge_spec.manifest import read_manifest  # noqa: E402
from edge_spec.native import build  # noqa: E402
from edge_spec.paths import DEFAULT_BUNDLE  # noqa: E402

DEFAULT_GGUF = ROOT / "models" / "gguf" / "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
#: our projection name -> the GGUF tensors whose rows it stacks
PARTS = {"gate_up": ("ffn_gate", "ffn_up"), "down": ("ffn_down",), "o": ("attn_output",),
         "qkv": ("attn_q", "attn_k", "attn_v")}  # fmt: skip


def session(nodes, initializers, k: int, library: Path | None) -> ort.InferenceSession:
    outputs = [helper.make_tensor_value_info(n.output[0], TensorProto.FLOAT, None) for n in nodes]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, k])], outputs, initializers
    )
    opsets = [
        helper.make_opsetid("", 17),
        helper.make_opsetid("com.microsoft", 1),
        helper.make_opsetid("ai.edge_spec", 1),
    ]
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    options.log_severity_level = 3
    if library is not None:
        options.register_custom_ops_library(str(library))
    model = helper.make_model(graph, opset_imports=opsets)
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def lean_graphs(onnx_path: Path) -> dict[str, tuple[ort.InferenceSession, int, int, int]]:
    """Per projection: (session of all layers' MatMulNBits nodes, K, layers, bytes)."""
    model = onnx.load(str(onnx_path))
    initializers = {t.name: t for t in model.graph.initializer}
    groups: dict[str, list] = defaultdict(list)
    for node in model.graph.node:
        if node.op_type != "MatMulNBits" or not node.name.startswith("layers."):
            continue
        role = node.name.split(".")[2].split("/")[0]
        groups["qkv" if role in ("qk", "v", "qkv") else role].append(node)
    out = {}
    for role, nodes in groups.items():
        by_k = defaultdict(list)
        for node in nodes:
            by_k[next(a.i for a in node.attribute if a.name == "K")].append(node)
        for k, same_k in by_k.items():  # the 8-bit and 4-bit downs differ in K: one graph each
            label = role if len(by_k) == 1 else f"{role} (K {k})"
            copies, inits, nbytes = [], [], 0
            for i, node in enumerate(same_k):
                inputs = ["x"]
                for name in node.input[1:]:
                    if name:
                        inits.append(initializers[name])
                        nbytes += numpy_helper.to_array(initializers[name]).nbytes
                    inputs.append(name)
                copies.append(helper.make_node(
                    "MatMulNBits", inputs, [f"y{i}"], domain="com.microsoft", **{a.name: helper.get_attribute_value(a) for a in node.attribute}
                ))  # fmt: skip
            layers = len({n.name.split(".")[1] for n in same_k})
            out[label] = (session(copies, inits, k, None), k, layers, nbytes)
    return out


def gguf_graphs(gguf: Path, library: Path) -> dict[str, tuple[ort.InferenceSession, int, int, int]]:
    from gguf import GGUFReader

    tensors = {t.name: t for t in GGUFReader(str(gguf)).tensors}
    layers = sum(1 for name in tensors if name.endswith(".ffn_down.weight"))
    out = {}
    for role, parts in PARTS.items():
        nodes_by_type: dict[str, list] = defaultdict(list)
        inits, nbytes, k = [], defaultdict(int), 0
        for layer in range(layers):
            chunks: dict[str, list[np.ndarray]] = defaultdict(list)
            for part in parts:
                t = tensors[f"blk.{layer}.{part}.weight"]
                k = int(t.shape[0])
                chunks[t.tensor_type.name].append(np.asarray(t.data).reshape(int(t.shape[1]), -1))
            for kind, rows in chunks.items():
                raw = np.concatenate(rows)
                records = interleave(raw, TYPE_NUMBER[kind], raw.shape[0], k)
                name = f"w{layer}_{kind}"
                inits.append(numpy_helper.from_array(records, name))
                nbytes[kind] += records.nbytes
                nodes_by_type[kind].append(helper.make_node(
                    "MatMulGGUF", ["x", name], [f"y{layer}_{kind}"], domain="ai.edge_spec", K=k, N=raw.shape[0], type=TYPE_NUMBER[kind]
                ))  # fmt: skip
        nodes = [n for kind_nodes in nodes_by_type.values() for n in kind_nodes]
        kinds = "+".join(f"{kind} x{len(v)}" for kind, v in nodes_by_type.items())
        out[f"{role} ({kinds})"] = (session(nodes, inits, k, library), k, layers, sum(nbytes.values()))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundle", type=Path, default=DEFAULT_BUNDLE)
    parser.add_argument("--gguf", type=Path, default=DEFAULT_GGUF)
    parser.add_argument("--rows", default="1,4")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    library = build.build()
    graphs = {
        f"lean  {name}": g
        for name, g in lean_graphs(args.bundle / read_manifest(args.bundle)["target"]["onnx"]).items()
    }
    graphs.update({f"gguf  {name}": g for name, g in gguf_graphs(args.gguf, library).items()})
    rng = np.random.default_rng(0)
    for rows in [int(r) for r in args.rows.split(",")]:
        feeds = {name: rng.standard_normal((rows, g[1])).astype(np.float32) for name, g in graphs.items()}
        for name, (sess, *_rest) in graphs.items():
            sess.run(None, {"x": feeds[name]})
        best: dict[str, float] = defaultdict(lambda: float("inf"))
        for _ in range(args.repeats):
            for name, (sess, *_rest) in graphs.items():
                sess.run(None, {"x": feeds[name]})  # its weights back in memory (a VM may reclaim idle pages)
                for _ in range(2):
                    start = time.perf_counter()
                    sess.run(None, {"x": feeds[name]})
                    best[name] = min(best[name], time.perf_counter() - start)
        print(f"{rows} row(s) a pass: ms per layer, MB per layer, GB/s")
        for name, (_sess, _k, layers, nbytes) in sorted(graphs.items(), key=lambda kv: kv[0].split()[1]):
            seconds = best[name]
            print(
                f"  {name:<42} {seconds / layers * 1e3:7.3f} {nbytes / layers / 1e6:8.2f} {nbytes / seconds / 1e9:6.1f}"
            )
        lean = sum(best[n] for n in graphs if n.startswith("lean"))
        ours = sum(best[n] for n in graphs if n.startswith("gguf"))
        lean_mb = sum(g[3] for n, g in graphs.items() if n.startswith("lean")) / 1e6
        gguf_mb = sum(g[3] for n, g in graphs.items() if n.startswith("gguf")) / 1e6
        print(f"  all layers: lean {lean * 1e3:.2f} ms ({lean_mb:.0f} MB), gguf {ours * 1e3:.2f} ms ({gguf_mb:.0f} MB): "
              f"{lean / ours:.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
