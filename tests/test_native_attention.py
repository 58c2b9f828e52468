"""The native attention op (``edge_spec/native/attention.cc``) against ORT's own ``GroupQueryAttention``.

It replaces ORT's op in the target's graph at load time, so it must compute what ORT's op computes (to
float32 rounding: rotary embedding, cache writes, causal mask, window, tree bias) and, what ORT's op
does not promise, give each query row the same bits whatever the number of rows in its pass.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from edge_spec.native import build

HEADS, KV_HEADS, HEAD = 6, 2, 32
CAPACITY, TABLE = 80, 96  # cache slots; rotary table rows


def _library():
    if build.compiler() is None:
        pytest.skip("no C++ compiler (g++ or clang++): the native attention op cannot be built here")
    try:
        return build.build()
    except build.BuildError as exc:
        pytest.fail(f"the native attention op does not build: {exc}")


@pytest.fixture(scope="module")
def library():
    return _library()


def gqa_model(domain: str, tree: bool, window: int = -1, softcap: float = 0.0, packed: bool = True) -> bytes:
    value = helper.make_tensor_value_info
    width = (HEADS + 2 * KV_HEADS) * HEAD if packed else HEADS * HEAD
    cache = [1, KV_HEADS, CAPACITY, HEAD]
    inputs = [
        value("qkv", TensorProto.FLOAT, [1, "rows", width]),
        value("past_k", TensorProto.FLOAT, cache),
        value("past_v", TensorProto.FLOAT, cache),
        value("seqlens_k", TensorProto.INT32, [1]),
        value("total", TensorProto.INT32, []),
        value("cos", TensorProto.FLOAT, [TABLE, HEAD // 2]),
        value("sin", TensorProto.FLOAT, [TABLE, HEAD // 2]),
    ]
    names = ["qkv", "", "", "past_k", "past_v", "seqlens_k", "total", "cos", "sin"]
    if not packed:
        inputs += [
            value("k", TensorProto.FLOAT, [1, "rows", KV_HEADS * HEAD]),
            value("v", TensorProto.FLOAT, [1, "rows", KV_HEADS * HEAD]),
        ]
        names[1:3] = ["k", "v"]
    if tree:
        inputs += [
            value("position_ids", TensorProto.INT64, [1, "rows"]),
            value("attention_bias", TensorProto.FLOAT, [1, 1, "rows", "total"]),
        ]
        names += ["position_ids", "attention_bias"]
    attrs = dict(num_heads=HEADS, kv_num_heads=KV_HEADS, do_rotary=1, rotary_interleaved=0, scale=0.17)
    if window > 0:
        attrs["local_window_size"] = window
    if softcap:
        attrs["softcap"] = softcap
    node = helper.make_node("GroupQueryAttention", names, ["out", "present_k", "present_v"], domain=domain, **attrs)
    outputs = [
        value("out", TensorProto.FLOAT, [1, "rows", HEADS * HEAD]),
        value("present_k", TensorProto.FLOAT, cache),
        value("present_v", TensorProto.FLOAT, cache),
    ]
    graph = helper.make_graph([node], "gqa", inputs, outputs)
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid(domain, 1)]
    return helper.make_model(graph, opset_imports=opsets).SerializeToString()


def session(model: bytes, library=None, threads: int = 1) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    if library is not None:
        options.register_custom_ops_library(str(library))
    return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])


def feeds(rng, context: int, rows: int, tree: bool, packed: bool = True) -> dict[str, np.ndarray]:
    width = (HEADS + 2 * KV_HEADS) * HEAD if packed else HEADS * HEAD
    angles = np.arange(TABLE)[:, None] * (1e-2 * np.arange(1, HEAD // 2 + 1))[None, :]
    out = {
        "qkv": rng.standard_normal((1, rows, width)).astype(np.float32),
        "past_k": rng.standard_normal((1, KV_HEADS, CAPACITY, HEAD)).astype(np.float32),
        "past_v": rng.standard_normal((1, KV_HEADS, CAPACITY, HEAD)).astype(np.float32),
        "seqlens_k": np.array([context + rows - 1], np.int32),
        "total": np.array(context + rows, np.int32),
        "cos": np.cos(angles).astype(np.float32),
        "sin": np.sin(angles).astype(np.float32),
    }
    if not packed:
        out["k"] = rng.standard_normal((1, rows, KV_HEADS * HEAD)).astype(np.float32)
        out["v"] = rng.standard_normal((1, rows, KV_HEADS * HEAD)).astype(np.float32)
    if tree:  # two branches after the first row: the second branch may not see the first
        positions = context + np.array([0] + [1 + i % ((rows + 1) // 2) for i in range(rows - 1)])
        bias = np.zeros((rows, context + rows), np.float32)
        split = 1 + (rows - 1) // 2
        bias[split:, context + 1 : context + split] = -np.inf
        out["position_ids"] = positions.reshape(1, rows).astype(np.int64)
        out["attention_bias"] = bias.reshape(1, 1, rows, context + rows)
    return out


def run(sess: ort.InferenceSession, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(None, inputs)))


CASES = [
    pytest.param(dict(tree=False), id="plain"),
    pytest.param(dict(tree=True), id="tree"),
    pytest.param(dict(tree=False, window=9), id="window"),
    pytest.param(dict(tree=False, softcap=3.0), id="softcap"),
    pytest.param(dict(tree=False, packed=False), id="unpacked"),
]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("rows", [1, 2, 5, 16])
@pytest.mark.parametrize("context", [0, 7, 60])
def test_the_native_op_computes_what_orts_op_computes(library, case, rows, context):
    if context == 0 and case.get("tree"):
        pytest.skip("a tree pass follows a prompt")
    rng = np.random.default_rng(rows * 100 + context)
    inputs = feeds(rng, context, rows, case.get("tree", False), case.get("packed", True))
    ours = run(session(gqa_model("ai.edge_spec", **case), library), inputs)
    theirs = run(session(gqa_model("com.microsoft", **case)), inputs)
    filled = context + rows  # slots past the sequence are ORT's zeros in both
    np.testing.assert_allclose(
        ours["present_k"][:, :, :filled], theirs["present_k"][:, :, :filled], rtol=1e-5, atol=1e-6
    )
    np.testing.assert_array_equal(ours["present_v"], theirs["present_v"])
    np.testing.assert_allclose(ours["out"], theirs["out"], rtol=1e-4, atol=2e-6)


def test_the_check_can_fail(library):
    """A window one key narrower changes the answer beyond the tolerance above."""
    rng = np.random.default_rng(1)
    inputs = feeds(rng, 40, 3, tree=False)
    ours = run(session(gqa_model("ai.edge_spec", tree=False, window=8), library), inputs)
    theirs = run(session(gqa_model("com.microsoft", tree=False, window=9)), inputs)
    assert np.abs(ours["out"] - theirs["out"]).max() > 1e-3


def _bound_run(sess, inputs: dict[str, np.ndarray], cache: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    """One pass with the cache buffers bound as past input and present output, as the runtime binds them."""
    binding = sess.io_binding()
    binding.bind_output("out")  # first: get_outputs()[0]
    values = [ort.OrtValue.ortvalue_from_numpy(a) for a in cache]
    for name, array in inputs.items():
        if name not in ("past_k", "past_v"):
            binding.bind_cpu_input(name, array)
    for (past, present), v in zip((("past_k", "present_k"), ("past_v", "present_v")), values):
        binding.bind_ortvalue_input(past, v)
        binding.bind_ortvalue_output(present, v)
    sess.run_with_iobinding(binding)
    return binding.get_outputs()[0].numpy()


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("tree", [False, True])
def test_each_row_has_the_same_bits_whatever_the_rows_in_its_pass(library, threads, tree):
    """Row r of a k-row pass equals the same row fed alone after rows 0..r-1 (shared cache, in place)."""
    rng = np.random.default_rng(7)
    context, rows = 50, 9
    inputs = feeds(rng, context, rows, tree)
    sess = session(gqa_model("ai.edge_spec", tree=tree), library, threads)
    cache = (inputs["past_k"].copy(), inputs["past_v"].copy())
    whole = _bound_run(sess, inputs, cache)
    assert not np.array_equal(cache[0], inputs["past_k"])  # written in place
    alone_cache = (inputs["past_k"].copy(), inputs["past_v"].copy())
    for r in range(rows):  # row by row, in the same cache slots
        one = {
            **inputs,
            "qkv": inputs["qkv"][:, r : r + 1],
            "seqlens_k": np.array([context + r], np.int32),
            "total": np.array(context + r + 1, np.int32),
        }
        if tree:
            one["position_ids"] = inputs["position_ids"][:, r : r + 1]
            one["attention_bias"] = inputs["attention_bias"][:, :, r : r + 1, : context + r + 1].copy()
        alone = _bound_run(sess, one, alone_cache)
        np.testing.assert_array_equal(alone[0, 0], whole[0, r])
    np.testing.assert_array_equal(alone_cache[0], cache[0])
    np.testing.assert_array_equal(alone_cache[1], cache[1])
