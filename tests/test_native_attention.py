"""The native attention op (``edge_spec/native/attention.cc``) against ORT's own ``GroupQueryAttention``.

It replaces ORT's op in the target's graph at load time, so it must compute what ORT's op computes (to
float32 rounding: rotary embedding, cache writes, causal mask, window, tree bias) and, what ORT's op
does not promise, give each query row the same bits whatever the number of rows in its pass.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from edge_spec.native import build
from tests.helpers import native_first_output, native_kernels

HEADS, KV_HEADS, HEAD = 6, 2, 32
CAPACITY, TABLE = 80, 96  # cache slots; rotary table rows


@pytest.fixture(autouse=True)
def switched_on(monkeypatch):
    """These tests run the native op whatever ``EDGE_SPEC_NATIVE_ATTENTION`` the suite was started with."""
    monkeypatch.setenv("EDGE_SPEC_NATIVE_ATTENTION", "1")


def gqa_model(
    domain: str,
    tree: bool,
    window: int = -1,
    softcap: float = 0.0,
    packed: bool = True,
    shape: tuple[int, int, int, int, int] | None = None,
    **extra: int,
) -> bytes:
    """One ``GroupQueryAttention`` node; ``shape``: (heads, kv heads, head size, cache slots, rotary rows),
    this module's sizes when None (read at the call: a test may change them); ``extra``: more attributes."""
    heads, kv_heads, head, capacity, table = shape or (HEADS, KV_HEADS, HEAD, CAPACITY, TABLE)
    value = helper.make_tensor_value_info
    width = (heads + 2 * kv_heads) * head if packed else heads * head
    cache = [1, kv_heads, capacity, head]
    inputs = [
        value("qkv", TensorProto.FLOAT, [1, "rows", width]),
        value("past_k", TensorProto.FLOAT, cache),
        value("past_v", TensorProto.FLOAT, cache),
        value("seqlens_k", TensorProto.INT32, [1]),
        value("total", TensorProto.INT32, []),
        value("cos", TensorProto.FLOAT, [table, head // 2]),
        value("sin", TensorProto.FLOAT, [table, head // 2]),
    ]
    names = ["qkv", "", "", "past_k", "past_v", "seqlens_k", "total", "cos", "sin"]
    if not packed:
        inputs += [
            value("k", TensorProto.FLOAT, [1, "rows", kv_heads * head]),
            value("v", TensorProto.FLOAT, [1, "rows", kv_heads * head]),
        ]
        names[1:3] = ["k", "v"]
    if tree:
        inputs += [
            value("position_ids", TensorProto.INT64, [1, "rows"]),
            value("attention_bias", TensorProto.FLOAT, [1, 1, "rows", "total"]),
        ]
        names += ["position_ids", "attention_bias"]
    attrs = dict(num_heads=heads, kv_num_heads=kv_heads, do_rotary=1, rotary_interleaved=0, scale=0.17, **extra)
    if window > 0:
        attrs["local_window_size"] = window
    if softcap:
        attrs["softcap"] = softcap
    node = helper.make_node("GroupQueryAttention", names, ["out", "present_k", "present_v"], domain=domain, **attrs)
    outputs = [
        value("out", TensorProto.FLOAT, [1, "rows", heads * head]),
        value("present_k", TensorProto.FLOAT, cache),
        value("present_v", TensorProto.FLOAT, cache),
    ]
    graph = helper.make_graph([node], "gqa", inputs, outputs)
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid(domain, 1)]
    return helper.make_model(graph, opset_imports=opsets).SerializeToString()


def session(model: bytes, native_library=None, threads: int = 1) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    if native_library is not None:
        options.register_custom_ops_library(str(native_library))
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
def test_the_native_op_computes_what_orts_op_computes(native_library, case, rows, context):
    if context == 0 and case.get("tree"):
        pytest.skip("a tree pass follows a prompt")
    rng = np.random.default_rng(rows * 100 + context)
    inputs = feeds(rng, context, rows, case.get("tree", False), case.get("packed", True))
    ours = run(session(gqa_model("ai.edge_spec", **case), native_library), inputs)
    theirs = run(session(gqa_model("com.microsoft", **case)), inputs)
    filled = context + rows  # slots past the sequence are ORT's zeros in both
    np.testing.assert_allclose(
        ours["present_k"][:, :, :filled], theirs["present_k"][:, :, :filled], rtol=1e-5, atol=1e-6
    )
    np.testing.assert_array_equal(ours["present_v"], theirs["present_v"])
    np.testing.assert_allclose(ours["out"], theirs["out"], rtol=1e-4, atol=2e-6)


@pytest.mark.parametrize("shape", [(8, 2, 32), (6, 3, 48), (4, 4, 64)], ids=["group-4", "head-48", "no-grouping"])
def test_other_head_layouts(native_library, monkeypatch, shape):
    """Groups that are no multiple of three, head sizes that are no multiple of four vectors."""
    import tests.test_native_attention as here

    heads, kv_heads, head = shape
    monkeypatch.setattr(here, "HEADS", heads)
    monkeypatch.setattr(here, "KV_HEADS", kv_heads)
    monkeypatch.setattr(here, "HEAD", head)
    rng = np.random.default_rng(heads)
    for context, rows in ((0, 3), (33, 1), (33, 7)):
        inputs = feeds(rng, context, rows, tree=True) if context else feeds(rng, context, rows, tree=False)
        tree = bool(context)
        ours = run(session(gqa_model("ai.edge_spec", tree=tree), native_library), inputs)
        theirs = run(session(gqa_model("com.microsoft", tree=tree)), inputs)
        np.testing.assert_array_equal(ours["present_v"], theirs["present_v"])
        np.testing.assert_allclose(ours["out"], theirs["out"], rtol=1e-4, atol=2e-6)


def test_the_check_can_fail(native_library):
    """A window one key narrower changes the answer beyond the tolerance above."""
    rng = np.random.default_rng(1)
    inputs = feeds(rng, 40, 3, tree=False)
    ours = run(session(gqa_model("ai.edge_spec", tree=False, window=8), native_library), inputs)
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
@pytest.mark.parametrize("context, rows", [(50, 9), (23, 40)], ids=["verify", "prompt"])
def test_each_row_has_the_same_bits_whatever_the_rows_in_its_pass(native_library, threads, tree, context, rows):
    """Row r of a k-row pass equals the same row fed alone after rows 0..r-1 (shared cache, in place); a pass
    of more than 16 rows scores on other kernels than one row does."""
    rng = np.random.default_rng(7)
    inputs = feeds(rng, context, rows, tree)
    sess = session(gqa_model("ai.edge_spec", tree=tree), native_library, threads)
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


@pytest.mark.parametrize(
    "shape",
    [(12, 2, 128, 300, 320), (14, 2, 64, 300, 320), (6, 3, 48, 300, 320)],
    ids=["qwen-1.5b", "group-7", "head-48"],
)
def test_the_avx512_kernels_give_the_avx2_bits(native_library, tmp_path, monkeypatch, shape):
    """Where the CPU has AVX-512 the scores and value sums run on it; every output keeps the AVX2 path's bits
    (rows and windows that fill no whole block of queries or keys included)."""
    import tests.test_native_attention as here

    if native_kernels(native_library, "EdgeSpecAttentionPath", {}) != "avx512":
        pytest.skip("no AVX-512 here: one path only")
    assert native_kernels(native_library, "EdgeSpecAttentionPath", {"EDGE_SPEC_NATIVE_AVX512": "0"}) == "avx2"
    heads, kv_heads, head, capacity, table = shape
    for name, value in zip(("HEADS", "KV_HEADS", "HEAD", "CAPACITY", "TABLE"), shape):
        monkeypatch.setattr(here, name, value)
    model = gqa_model("ai.edge_spec", tree=False, shape=shape)
    rng = np.random.default_rng(head)
    for context, rows in ((0, 1), (37, 1), (61, 5), (2, 23), (230, 40)):
        inputs = feeds(rng, context, rows, tree=False)
        got = {
            path: native_first_output(native_library, model, inputs, env, tmp_path)
            for path, env in (("avx512", {}), ("avx2", {"EDGE_SPEC_NATIVE_AVX512": "0"}))
        }
        assert np.abs(got["avx2"]).max() > 0
        assert np.array_equal(got["avx512"], got["avx2"]), (context, rows)


# -- the runtime: the target's attention moved to the native op at load time ------------------------------


def test_the_target_runs_its_attention_on_the_native_op(native_library, target_path):
    """Loaded with the native op and a float32 cache, the target gives ORT's op's logits to float32 rounding; the
    file is untouched."""
    from edge_spec.runtime.model.decoder import Decoder

    before = target_path.read_bytes()
    native = Decoder(target_path, threads=1, capacity=64, half_cache=False)
    plain = Decoder(target_path, threads=1, capacity=64, native_attention=False)
    assert native.native_attention and not plain.native_attention
    assert not native.half_cache and native.kv.arrays[0].dtype == np.float32
    prompt = [5, 17, 42, 99, 7, 3, 250, 61, 11, 12]
    ours, theirs = native.forward(prompt, len(prompt))["logits"], plain.forward(prompt, len(prompt))["logits"]
    np.testing.assert_allclose(ours, theirs, rtol=1e-3, atol=1e-3)
    assert target_path.read_bytes() == before


def test_on_the_native_op_the_target_drops_its_attention_pad(native_library, target_path):
    """The pad row exists to take ORT's op off its one-query path; the native op has none, so a target loaded
    on it runs without the pad (a row of attention and three nodes a layer less) and computes what it
    computes with the pad bit for bit, one-row passes included, on any CPU (the matmuls see the same rows)."""
    from edge_spec.runtime.model.decoder import Decoder

    native = Decoder(target_path, threads=1, capacity=19)
    padded = Decoder(target_path, threads=1, capacity=19, attention_pad=True)
    assert native.native_attention and native.attention_pad_removed and not native.pads_attention
    assert padded.native_attention and padded.pads_attention and not padded.attention_pad_removed
    assert native.one_row_attention_exact and padded.one_row_attention_exact
    chunks = [[5, 17, 42, 99, 7, 3, 250, 61, 11, 12], [40], [41, 42], [43], [44, 45, 46], [47], [48]]

    def logits(decoder: Decoder) -> np.ndarray:
        return np.concatenate([decoder.forward(chunk, len(chunk))["logits"] for chunk in chunks])

    assert np.array_equal(logits(native), logits(padded))
    assert native.length == native.capacity  # the last slot still fills without the pad row's spare


def test_orts_op_keeps_the_attention_pad(native_library, target_path):
    from edge_spec.runtime.model.decoder import Decoder

    plain = Decoder(target_path, threads=1, capacity=64, native_attention=False)
    assert plain.pads_attention and not plain.attention_pad_removed and plain.one_row_attention_exact
    stripped = Decoder(target_path, threads=1, capacity=64, native_attention=False, attention_pad=False)
    assert not stripped.pads_attention and not stripped.one_row_attention_exact


def test_a_target_exported_without_the_pad_is_exact_in_one_row_on_the_native_op(native_library, target_path, tmp_path):
    """A graph that never had the attention pad has no one-query path once all its attention runs on the native
    op, as a graph whose pad was stripped at load has none: its one-row passes are exact as far as attention
    goes, and only the matmuls are left for the device check."""
    import onnx

    from edge_spec.runtime.model.attention_unpad import strip_attention_pad
    from edge_spec.runtime.model.decoder import Decoder

    model = onnx.load(str(target_path))
    strip_attention_pad(model)
    unpadded = tmp_path / "unpadded.onnx"
    onnx.save(model, str(unpadded))
    native = Decoder(unpadded, threads=1, capacity=19)
    assert not native.pads_attention and not native.attention_pad_removed
    assert native.native_attention and native.one_row_attention_exact
    plain = Decoder(unpadded, threads=1, capacity=19, native_attention=False)  # ORT's op: its one-query path
    assert not plain.native_attention and not plain.one_row_attention_exact


def test_greedy_speculative_equals_autoregressive_on_the_native_op(native_library, int4_bundle):
    from edge_spec.runtime.engine import Engine
    from edge_spec.runtime.verify.sampling import SamplingParams
    from tests.helpers import PROMPTS, chain, run

    engine = Engine.from_bundle(int4_bundle, threads=1, mode="spec", draft_head="full")
    assert engine.bundle.target.native_attention
    rejections = 0
    for prompt in PROMPTS[:3]:
        ids = engine.bundle.tokenizer.encode(prompt)
        reference, _ = run(engine, ids, SamplingParams(), 40, None)
        for gamma in (1, 3, 6):
            got, stats = run(engine, ids, SamplingParams(), 40, chain(gamma))
            assert got == reference, f"γ={gamma} prompt={prompt!r}"
            rejections += sum(d - a for d, a in zip(stats.drafted, stats.accepted))
    assert rejections > 0, "the drafter never disagreed: rollback not exercised"


def test_without_the_pad_the_engine_still_finds_one_row_passes_exact_where_they_are(
    native_library, int4_bundle, monkeypatch, tmp_path
):
    """The device check still runs for the unpadded target on the native op, and what it finds holds: greedy
    speculative output equals ar --exact's, and plain one-row ar's where one row was found exact."""
    from edge_spec.runtime.engine import Engine
    from edge_spec.runtime.model.row_invariance import one_row_passes_match

    monkeypatch.setenv("EDGE_SPEC_CACHE", str(tmp_path))  # a device not seen before
    engine = Engine.from_bundle(int4_bundle, threads=1, mode="spec", draft_head="trim-64")
    assert engine.bundle.target.attention_pad_removed
    expected = 1 if one_row_passes_match(engine.bundle.target) else 2
    assert engine.bundle.exact_rows() == expected
    reference = engine.complete("def is_prime", max_new_tokens=24, mode="ar", exact=True).token_ids
    assert engine.complete("def is_prime", max_new_tokens=24).token_ids == reference
    if expected == 1:
        assert engine.complete("def is_prime", max_new_tokens=24, mode="ar").token_ids == reference


def test_without_a_compiler_the_runtime_keeps_orts_op(monkeypatch, tmp_path, target_path):
    """No compiler: one debug line, no native_library, and the decoder loads ORT's op as before."""
    from edge_spec.runtime.model.decoder import Decoder

    monkeypatch.setenv("EDGE_SPEC_CACHE", str(tmp_path))  # nothing built there yet
    monkeypatch.setattr(build, "compiler", lambda: None)
    build._built.cache_clear()
    try:
        with pytest.raises(build.BuildError, match="no C\\+\\+ compiler"):
            build.build()
        assert build.library_path() is None
        decoder = Decoder(target_path, threads=1, capacity=32)
        assert not decoder.native_attention
        assert decoder.forward([5, 17, 42], 1)["logits"].shape == (1, decoder.vocab_size)
    finally:
        build._built.cache_clear()


def test_without_the_source_the_build_says_so(monkeypatch, tmp_path):
    """A frozen build that left the source out falls back like a machine without a compiler."""
    monkeypatch.setenv("EDGE_SPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(build, "SOURCE", tmp_path / "attention.cc")
    with pytest.raises(build.BuildError, match="not installed"):
        build.build()


def test_a_failing_build_leaves_nothing_in_the_cache(monkeypatch, tmp_path):
    if build.compiler() is None:
        pytest.skip("no C++ compiler (g++ or clang++): the native attention op cannot be built here")
    monkeypatch.setenv("EDGE_SPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(build, "FLAGS", [*build.FLAGS, "-DEDGE_SPEC_NO_SUCH_FLAG", "-Werror=nonexistent-warning-x"])
    with pytest.raises(build.BuildError):
        build.build()
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]


def test_the_native_op_is_the_default_where_it_builds(monkeypatch, native_library, target_path):
    from edge_spec.runtime.model.decoder import Decoder

    monkeypatch.delenv(build.SWITCH)
    assert build.library_path() == native_library
    assert Decoder(target_path, threads=1, capacity=32).native_attention


def test_the_switch_turns_the_native_op_off(monkeypatch, native_library, target_path):
    from edge_spec.runtime.model.decoder import Decoder

    monkeypatch.setenv(build.SWITCH, "0")
    assert build.library_path() is None
    assert not Decoder(target_path, threads=1, capacity=32).native_attention


def test_only_nodes_the_native_op_takes_are_moved():
    from edge_spec.runtime.model.native_attention import NATIVE_DOMAIN, use_native_attention

    model = onnx.load_from_string(gqa_model("com.microsoft", tree=True))
    assert use_native_attention(model) == 1
    assert model.graph.node[0].domain == NATIVE_DOMAIN
    assert any(o.domain == NATIVE_DOMAIN for o in model.opset_import)
    smooth = onnx.load_from_string(gqa_model("com.microsoft", tree=False))
    smooth.graph.node[0].attribute.append(helper.make_attribute("smooth_softmax", 1))
    assert use_native_attention(smooth) == 0 and smooth.graph.node[0].domain == "com.microsoft"


def test_device_facts_are_kept_apart_for_the_native_op(native_library, int4_bundle, monkeypatch):
    """Cost profiles and exactness verdicts measured with one attention op are not read for the other."""
    from edge_spec.runtime.engine import Engine

    native = Engine.from_bundle(int4_bundle, threads=1, mode="ar")
    monkeypatch.setenv(build.SWITCH, "0")
    plain = Engine.from_bundle(int4_bundle, threads=1, mode="ar")
    assert native.bundle.target.native_attention and not plain.bundle.target.native_attention
    assert native.bundle._placement() != plain.bundle._placement()
