"""What one decode step's attention costs after a long prompt, and what reading each KV head once would save.

After a 2,800-token prompt ``GroupQueryAttention`` is about a third of the target's decode step on a 2-core
CPU (``benchmarks/profile_step.py --context 2800``).  ORT's CPU kernel works one query head at a time, so a
key/value head shared by g query heads is read g times.  This times, for the target's attention shape
(Qwen2.5-1.5B: 12 query heads over 2 KV heads of 128, 28 layers) and one new token, or ``--rows`` of them as
a verify pass carries:

* ``GroupQueryAttention`` over the shared KV buffer of fixed capacity, as the exported graph runs it, with an
  fp32 and an fp16 cache;
* the attention maths alone written as one ``MatMul`` per KV head with the g query heads as g rows
  (``softmax(q Kᵀ) V`` over exactly the context's keys): the cost of reading each KV head once.

* a drop-in replacement: ``GroupQueryAttention`` with the KV heads as its only query heads (it applies the
  rotary embedding and writes the new key and value into the buffer, at a sixth of the full op's attention
  work), then the grouped ``MatMul`` attention over the whole buffer with a mask (ONNX cannot slice a
  buffer without copying it, so the maths runs over the buffer's capacity, not the context).

* the native op (``edge_spec/native/attention.cc``, built here at first use): the fused op's inputs, outputs
  and semantics, each KV head's keys and values read once for all its query heads and new rows.

The second leaves out what the fused op also does (rotary embedding, writing the new key and value into the
cache, causal masking over several new rows), so it bounds what regrouping could save; the third is what a
graph could run instead; the fourth is what the runtime loads in place of the fused op where it builds.

    python benchmarks/studies/gqa_grouping.py --threads 2
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

from edge_spec.native import build

HEADS, KV_HEADS, HEAD_DIM, LAYERS, CAPACITY = 12, 2, 128, 28, 4096
GROUP = HEADS // KV_HEADS


NATIVE_DOMAIN = "ai.edge_spec"  # edge_spec/native/attention.cc: the same op, each KV head read once


def _model(nodes: list, inputs: list, outputs: list, initializers: list | None = None) -> bytes:
    graph = helper.make_graph(nodes, "attention", inputs, outputs, initializers)
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    opsets.append(helper.make_opsetid(NATIVE_DOMAIN, 1))
    return helper.make_model(graph, opset_imports=opsets).SerializeToString()


def gqa_node(layer: int, query: str, output: str, heads: int, domain: str = "com.microsoft") -> onnx.NodeProto:
    """Layer ``layer``'s ``GroupQueryAttention`` over its shared buffers, ``heads`` query heads from ``query``
    (``domain``: ORT's op, or the native one)."""
    return helper.make_node(
        "GroupQueryAttention",
        [query, "k", "v", f"past_k{layer}", f"past_v{layer}", "seqlens_k", "total"],
        [output, f"present_k{layer}", f"present_v{layer}"],
        domain=domain,
        num_heads=heads,
        kv_num_heads=KV_HEADS,
    )


def gqa_model(dtype: np.dtype, domain: str = "com.microsoft") -> bytes:
    """``LAYERS`` GroupQueryAttention nodes over shared past/present buffers of ``CAPACITY`` positions, for
    any number of new rows (a verify pass's)."""
    elem = TensorProto.FLOAT if dtype == np.float32 else TensorProto.FLOAT16
    value = helper.make_tensor_value_info
    inputs = [
        value("q", elem, [1, "rows", HEADS * HEAD_DIM]),
        value("k", elem, [1, "rows", KV_HEADS * HEAD_DIM]),
        value("v", elem, [1, "rows", KV_HEADS * HEAD_DIM]),
        value("seqlens_k", TensorProto.INT32, [1]),
        value("total", TensorProto.INT32, []),
    ]
    outputs, nodes = [], []
    cache = [1, KV_HEADS, CAPACITY, HEAD_DIM]
    for i in range(LAYERS):
        inputs += [value(f"past_k{i}", elem, cache), value(f"past_v{i}", elem, cache)]
        outputs += [
            value(f"out{i}", elem, [1, "rows", HEADS * HEAD_DIM]),
            value(f"present_k{i}", elem, cache),
            value(f"present_v{i}", elem, cache),
        ]
        nodes.append(gqa_node(i, "q", f"out{i}", HEADS, domain))
    return _model(nodes, inputs, outputs)


def grouped_model() -> bytes:
    """``LAYERS`` times softmax(q Kᵀ) V with each KV head's ``GROUP`` query heads as the rows of one MatMul."""
    value = helper.make_tensor_value_info
    inputs = [value("q", TensorProto.FLOAT, [1, KV_HEADS, "group_rows", HEAD_DIM])]
    outputs, nodes = [], []
    for i in range(LAYERS):
        inputs += [
            value(f"kt{i}", TensorProto.FLOAT, [1, KV_HEADS, HEAD_DIM, "context"]),
            value(f"v{i}", TensorProto.FLOAT, [1, KV_HEADS, "context", HEAD_DIM]),
        ]
        outputs.append(value(f"out{i}", TensorProto.FLOAT, [1, KV_HEADS, "group_rows", HEAD_DIM]))
        nodes += [
            helper.make_node("MatMul", ["q", f"kt{i}"], [f"scores{i}"]),
            helper.make_node("Softmax", [f"scores{i}"], [f"probs{i}"], axis=-1),
            helper.make_node("MatMul", [f"probs{i}", f"v{i}"], [f"out{i}"]),
        ]
    return _model(nodes, inputs, outputs)


def dropin_model(capacity: int) -> bytes:
    """``LAYERS`` times: GQA with ``KV_HEADS`` query heads writing the shared buffers, then the grouped maths over
    the whole buffer (``mask``: 0 where a row may look, -inf elsewhere)."""
    value = helper.make_tensor_value_info
    inputs = [
        value("q", TensorProto.FLOAT, [1, "rows", HEADS * HEAD_DIM]),
        value("k", TensorProto.FLOAT, [1, "rows", KV_HEADS * HEAD_DIM]),
        value("v", TensorProto.FLOAT, [1, "rows", KV_HEADS * HEAD_DIM]),
        value("seqlens_k", TensorProto.INT32, [1]),
        value("total", TensorProto.INT32, []),
        value("mask", TensorProto.FLOAT, [1, 1, "group_rows", capacity]),
    ]
    shapes = {  # query heads grouped by their KV head: [1, rows, KV, GROUP, D] <-> [1, KV, rows * GROUP, D]
        "by_head": [1, -1, KV_HEADS, GROUP, HEAD_DIM],
        "grouped": [1, KV_HEADS, -1, HEAD_DIM],
        "by_kv_head": [1, KV_HEADS, -1, GROUP, HEAD_DIM],
        "flat": [1, -1, HEADS * HEAD_DIM],
    }
    initializers = [helper.make_tensor(name, TensorProto.INT64, [len(v)], v) for name, v in shapes.items()]
    nodes = [
        helper.make_node("Reshape", ["q", "by_head"], ["q_heads"]),
        helper.make_node("Transpose", ["q_heads"], ["q_kv_first"], perm=[0, 2, 1, 3, 4]),
        helper.make_node("Reshape", ["q_kv_first", "grouped"], ["q_grouped"]),
    ]
    outputs, cache = [], [1, KV_HEADS, capacity, HEAD_DIM]
    for i in range(LAYERS):
        inputs += [value(f"past_k{i}", TensorProto.FLOAT, cache), value(f"past_v{i}", TensorProto.FLOAT, cache)]
        outputs += [
            value(f"out{i}", TensorProto.FLOAT, [1, "rows", HEADS * HEAD_DIM]),
            value(f"writer{i}", TensorProto.FLOAT, [1, "rows", KV_HEADS * HEAD_DIM]),
            value(f"present_k{i}", TensorProto.FLOAT, cache),
            value(f"present_v{i}", TensorProto.FLOAT, cache),
        ]
        nodes += [
            gqa_node(i, "k", f"writer{i}", KV_HEADS),
            helper.make_node(
                "FusedMatMul",
                ["q_grouped", f"present_k{i}"],
                [f"scores{i}"],
                domain="com.microsoft",
                transB=1,
                alpha=float(1 / np.sqrt(HEAD_DIM)),
            ),
            helper.make_node("Add", [f"scores{i}", "mask"], [f"masked{i}"]),
            helper.make_node("Softmax", [f"masked{i}"], [f"probs{i}"], axis=-1),
            helper.make_node("MatMul", [f"probs{i}", f"present_v{i}"], [f"grouped_out{i}"]),
            helper.make_node("Reshape", [f"grouped_out{i}", "by_kv_head"], [f"out_heads{i}"]),
            helper.make_node("Transpose", [f"out_heads{i}"], [f"out_rows_first{i}"], perm=[0, 2, 1, 3, 4]),
            helper.make_node("Reshape", [f"out_rows_first{i}", "flat"], [f"out{i}"]),
        ]
    return _model(nodes, inputs, outputs, initializers)


def session(model: bytes, threads: int, library: str | None = None) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    if library is not None:
        options.register_custom_ops_library(library)
    return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])


def timed(sess: ort.InferenceSession, binding: ort.IOBinding, runs: int) -> float:
    """Milliseconds per run, after three warm-up runs."""
    for _ in range(3):
        sess.run_with_iobinding(binding)
    start = time.perf_counter()
    for _ in range(runs):
        sess.run_with_iobinding(binding)
    return (time.perf_counter() - start) / runs * 1e3


def bind_fused_inputs(
    sess: ort.InferenceSession, dtype: np.dtype, context: int, rows: int, capacity: int, rng: np.random.Generator
) -> ort.IOBinding:
    """The fused op's inputs after ``context`` cached positions; each cache buffer is bound as past input and
    present output, as the runtime binds them."""
    binding = sess.io_binding()
    for name, width in (("q", HEADS), ("k", KV_HEADS), ("v", KV_HEADS)):
        binding.bind_cpu_input(name, rng.random((1, rows, width * HEAD_DIM)).astype(dtype))
    binding.bind_cpu_input("seqlens_k", np.array([context + rows - 1], np.int32))
    binding.bind_cpu_input("total", np.array(context + rows, np.int32))
    buffers = []
    for i in range(LAYERS):
        for kind in ("k", "v"):
            buffer = ort.OrtValue.ortvalue_from_numpy(rng.random((1, KV_HEADS, capacity, HEAD_DIM)).astype(dtype))
            buffers.append(buffer)
            binding.bind_ortvalue_input(f"past_{kind}{i}", buffer)
            binding.bind_ortvalue_output(f"present_{kind}{i}", buffer)
        binding.bind_output(f"out{i}")
    binding.buffers = buffers  # the binding does not own them
    return binding


def gqa_ms(
    sess: ort.InferenceSession, dtype: np.dtype, context: int, rows: int, runs: int, rng: np.random.Generator
) -> float:
    return timed(sess, bind_fused_inputs(sess, dtype, context, rows, CAPACITY, rng), runs)


def dropin_mask(context: int, rows: int, capacity: int) -> np.ndarray:
    """The drop-in's causal mask: query row r * GROUP + h is new token r, which sees the context and new tokens
    0..r, as the fused op's own mask lets it."""
    mask = np.full((1, 1, GROUP * rows, capacity), -np.inf, np.float32)
    for row in range(rows):
        mask[0, 0, row * GROUP : (row + 1) * GROUP, : context + row + 1] = 0
    return mask


def dropin_ms(
    sess: ort.InferenceSession, capacity: int, context: int, rows: int, runs: int, rng: np.random.Generator
) -> float:
    binding = bind_fused_inputs(sess, np.float32, context, rows, capacity, rng)
    binding.bind_cpu_input("mask", dropin_mask(context, rows, capacity))
    for i in range(LAYERS):
        binding.bind_output(f"writer{i}")
    return timed(sess, binding, runs)


def grouped_ms(sess: ort.InferenceSession, context: int, rows: int, runs: int, rng: np.random.Generator) -> float:
    binding = sess.io_binding()
    binding.bind_cpu_input("q", rng.random((1, KV_HEADS, GROUP * rows, HEAD_DIM)).astype(np.float32))
    for i in range(LAYERS):
        binding.bind_cpu_input(f"kt{i}", rng.random((1, KV_HEADS, HEAD_DIM, context)).astype(np.float32))
        binding.bind_cpu_input(f"v{i}", rng.random((1, KV_HEADS, context, HEAD_DIM)).astype(np.float32))
        binding.bind_output(f"out{i}")
    return timed(sess, binding, runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--contexts", default="64,1400,2800", help="comma list of context lengths")
    parser.add_argument("--rows", type=int, default=1, help="new tokens per pass (a verify pass has 1 + drafts)")
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    if not all(0 < c and c + args.rows <= CAPACITY for c in contexts):
        raise SystemExit(f"--contexts: each plus --rows must lie between 1 and {CAPACITY}")
    rng = np.random.default_rng(0)
    rows = {
        "GroupQueryAttention, fp32 cache": (session(gqa_model(np.float32), args.threads), np.float32),
        "GroupQueryAttention, fp16 cache": (session(gqa_model(np.float16), args.threads), np.float16),
    }
    library = build.library_path()
    if library is None:
        print("(the native op is not built here: no C++ compiler, or EDGE_SPEC_NATIVE_ATTENTION=0)")
    else:
        native = session(gqa_model(np.float32, NATIVE_DOMAIN), args.threads, str(library))
        rows["native op, fp32 cache"] = (native, np.float32)
    grouped = session(grouped_model(), args.threads)
    print(f"ORT {ort.__version__}, {args.threads} threads; ms per step for {LAYERS} layers, {args.rows} new token(s)")
    print(f"{'':36}" + "".join(f"{c:>10}" for c in contexts))
    for label, (sess, dtype) in rows.items():
        print(f"{label:36}" + "".join(f"{gqa_ms(sess, dtype, c, args.rows, args.runs, rng):10.1f}" for c in contexts))
    label = "one MatMul per KV head (maths only)"
    print(f"{label:36}" + "".join(f"{grouped_ms(grouped, c, args.rows, args.runs, rng):10.1f}" for c in contexts))
    label = f"drop-in, {CAPACITY}-position buffer"
    dropin = session(dropin_model(CAPACITY), args.threads)
    print(
        f"{label:36}" + "".join(f"{dropin_ms(dropin, CAPACITY, c, args.rows, args.runs, rng):10.1f}" for c in contexts)
    )
    label = "drop-in, buffer fitted to the context"  # a buffer that grew with the context, 256 positions a time
    fitted = [-(-(c + args.rows) // 256) * 256 for c in contexts]
    times = [
        dropin_ms(session(dropin_model(f), args.threads), f, c, args.rows, args.runs, rng)
        for c, f in zip(contexts, fitted)
    ]
    print(f"{label:36}" + "".join(f"{t:10.1f}" for t in times))


if __name__ == "__main__":
    main()
