"""GGUF blocks carried into MatMulNBits compute x @ W.T for W exactly as the gguf package dequantizes it
(float rounding aside); re-quantizing the same W to our int4 blocks (the old path) does not."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

gguf = pytest.importorskip("gguf", reason="the gguf package (the export extra) reads GGUF blocks")
from gguf import GGMLQuantizationType as T  # noqa: E402
from gguf import quants  # noqa: E402
from onnx import TensorProto, helper  # noqa: E402

from edge_spec.export.gguf.blocks import (  # noqa: E402
    CORRECTION_DIGITS,
    CarriedBlocks,
    add_carried_linear,
    carry_gguf,
    concat_blocks,
    fast_layout,
    folded_width,
    narrow_to_4bit,
    zero_points_into_correction,
)
from edge_spec.export.graph.builder import BuildOptions, Graph, add_linear, make_model  # noqa: E402
from tests.gguf_models import count_gguf_parses, finish_gguf  # noqa: E402

N, K = 24, 512  # K: two K-quant super-blocks


def _f16_bytes(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).view(np.uint8).reshape(len(values), 2)


def gguf_bytes(kind: str, rng: np.random.Generator) -> np.ndarray:
    """Raw bytes of a [N, K] tensor in GGUF type ``kind``: the gguf package's quantizer where it has one,
    hand-packed random blocks (valid scales, random codes) for the K-quants it cannot write."""
    if kind in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"):
        return quants.quantize(rng.standard_normal((N, K)).astype(np.float32), getattr(T, kind))
    blocks = N * K // 256
    if kind in ("Q4_K", "Q5_K"):  # d, dmin (f16), 12 bytes of 6-bit scales and mins, (Q5_K: 32 bytes of high
        # bits), 128 bytes of nibbles
        d, dmin = _f16_bytes(rng.uniform(0.001, 0.02, blocks)), _f16_bytes(rng.uniform(0.0, 0.02, blocks))
        rest = rng.integers(0, 256, (blocks, 140 if kind == "Q4_K" else 172), dtype=np.uint8)
        rest[0, :12] = 0  # one block whose sub-block scales are 0: a constant -dmin*m, carried exactly too
        return np.concatenate([d, dmin, rest], axis=1).reshape(N, -1)
    if kind == "Q6_K":  # 128 bytes low bits, 64 high bits, 16 int8 scales, d (f16)
        codes = rng.integers(0, 256, (blocks, 208), dtype=np.uint8)
        return np.concatenate([codes, _f16_bytes(rng.uniform(0.001, 0.01, blocks))], axis=1).reshape(N, -1)
    raise ValueError(kind)


def matmul_session(build) -> ort.InferenceSession:
    g = Graph()
    out = build(g)
    graph = helper.make_graph(
        g.nodes,
        "m",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, K])],
        [helper.make_tensor_value_info(out, TensorProto.FLOAT, None)],
        g.initializers,
    )
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return ort.InferenceSession(make_model(graph).SerializeToString(), options, providers=["CPUExecutionProvider"])


OPTS = BuildOptions("int4", accuracy_level=0, carry_exact=True)  # fp32 activations: the weight path alone
FAST = BuildOptions("int4", accuracy_level=0)  # the default: carried blocks in the layout ORT runs fastest


@pytest.mark.parametrize("kind", ["Q4_0", "Q8_0", "Q4_1", "Q4_K", "Q6_K", "Q5_0", "Q5_1", "Q5_K"])
def test_carried_blocks_match_gguf_dequantization(kind):
    rng = np.random.default_rng(0)
    raw = gguf_bytes(kind, rng)
    reference = quants.dequantize(raw, getattr(T, kind)).reshape(N, K).astype(np.float32)
    carried = carry_gguf(raw, kind, N, K)
    # affine formats compute scale * (q - dmin*m / (d*sc)) where GGUF has d*sc*q - dmin*m: float rounding apart
    np.testing.assert_allclose(carried.dequantize(), reference, rtol=1e-6, atol=1e-6 * np.abs(reference).max())
    x = rng.standard_normal((1, 3, K)).astype(np.float32)
    expected = x @ reference.T
    scale = np.abs(expected).max()
    got = matmul_session(lambda g: add_carried_linear(g, "x", carried, "w", OPTS)).run(None, {"x": x})[0]
    assert np.abs(got - expected).max() <= 1e-5 * scale
    # negative control: the old path (dequantize, then re-quantize to int4 blocks of 32) is off by far more;
    # except for Q4_0, whose rule (scale = signed extreme / -8) is ours, so its blocks came back unchanged
    requant = matmul_session(lambda g: add_linear(g, "x", reference, "w", OPTS)).run(None, {"x": x})[0]
    old_error = np.abs(requant - expected).max()
    if kind == "Q4_0":
        assert old_error <= 1e-5 * scale
    else:
        assert old_error > 1e-3 * scale


def _rounding_bound(exact: CarriedBlocks) -> np.ndarray:
    """Per weight, how far :func:`fast_layout` may move it: a quarter step of the larger scale of a merged
    pair of 16-blocks, the folded correction's digits (each a factor 2 * 7 at 4 bits, 2 * 127 at 8, below
    the largest |c| among the 32 blocks it shares a scale with; c with 4-bit zero points moved into it)."""
    bound = np.zeros(exact.scales.shape, np.float32)
    if exact.bits == 8 and exact.block_size == 16:
        pair = np.abs(exact.scales).reshape(exact.n, -1, 2).max(axis=-1)
        bound += np.repeat(pair / 8, 2, axis=1)
    if exact.correction is not None:
        c = np.abs(zero_points_into_correction(exact).correction)
        pad = -c.shape[1] % exact.block_size
        groups = np.pad(c, ((0, 0), (0, pad))).reshape(exact.n, -1, exact.block_size).max(axis=-1)
        levels = 2 ** (exact.bits - 1) - 1
        bound += np.repeat(groups, exact.block_size, axis=1)[:, : c.shape[1]] / (2 * levels) ** CORRECTION_DIGITS
    return np.repeat(bound, exact.block_size, axis=1) * (1 + 1e-5) + 1e-7


@pytest.mark.parametrize("kind", ["Q4_1", "Q4_K", "Q6_K", "Q5_1", "Q5_K", "Q4_0"])
def test_fast_layout_rounds_within_its_bound_and_the_graph_computes_it(kind):
    """The default layout (16-blocks merged, correction folded into the matmul): each weight moves by at
    most its stated bound from GGUF's value, the graph computes exactly that layout, and the whole stays
    far closer to GGUF than re-quantizing to int4 blocks (the old path) does."""
    rng = np.random.default_rng(2)
    raw = gguf_bytes(kind, rng)
    reference = quants.dequantize(raw, getattr(T, kind)).reshape(N, K).astype(np.float32)
    exact = carry_gguf(raw, kind, N, K)
    fast = fast_layout(exact)
    assert fast.correction is None and fast.block_size == (32 if kind == "Q6_K" else exact.block_size)
    assert fast.k == K + folded_width(exact)
    effective = fast.dequantize()[:, :K]  # weights on x; the extra columns multiply x's block sums, once a digit
    if exact.correction is not None:
        sums, width = K // exact.block_size, folded_width(exact) // CORRECTION_DIGITS
        starts = range(K, K + folded_width(exact), width)
        digits = sum(fast.dequantize()[:, start : start + sums] for start in starts)
        effective = effective + np.repeat(digits, exact.block_size, axis=1)
    moved = np.abs(effective - reference)
    assert (moved <= _rounding_bound(exact) + 1e-5 * np.abs(reference).max()).all()  # + float rounding
    if kind in ("Q4_K", "Q6_K"):
        assert moved.max() > 0  # it does round: the bound is what the test checks, not exactness
    x = rng.standard_normal((1, 3, K)).astype(np.float32)
    got = matmul_session(lambda g: add_carried_linear(g, "x", exact, "w", FAST)).run(None, {"x": x})[0]
    np.testing.assert_allclose(got, x @ effective.T, rtol=1e-4, atol=1e-4 * np.abs(x @ effective.T).max())
    expected = x @ reference.T
    requant = matmul_session(lambda g: add_linear(g, "x", reference, "w", FAST)).run(None, {"x": x})[0]
    if kind != "Q4_0":  # Q4_0 is our own int4 rule: re-quantizing gives it back unchanged
        assert np.abs(got - expected).max() < np.abs(requant - expected).max() / 4


@pytest.mark.parametrize("kind", ["Q6_K", "Q8_0", "Q5_K", "Q5_1"])
def test_the_small_layout_rounds_8_bit_blocks_to_4_bits_closer_than_re_quantizing(kind):
    """``--gguf-layout small``: an 8-bit carried weight becomes 4-bit blocks of 32 with a zero point (half a
    byte a weight); its rounding error is that of one 4-bit step (about step / sqrt(12) RMS), below what
    re-quantizing GGUF's values to our symmetric int4 blocks (the old path, the negative control) leaves,
    and the graph computes exactly the narrowed weights."""
    rng = np.random.default_rng(3)
    raw = gguf_bytes(kind, rng)
    reference = quants.dequantize(raw, getattr(T, kind)).reshape(N, K).astype(np.float32)
    small = narrow_to_4bit(carry_gguf(raw, kind, N, K))
    assert (small.bits, small.block_size, small.correction) == (4, 32, None) and small.zero_points is not None
    assert small.packed.nbytes == N * K // 2
    error = small.dequantize() - reference
    steps = np.repeat(np.abs(small.scales), 32, axis=1)
    assert np.sqrt(np.mean((error / steps) ** 2)) < 0.35  # one rounding at a 4-bit step: 0.29 for a uniform spread
    x = rng.standard_normal((1, 3, K)).astype(np.float32)
    got = matmul_session(lambda g: add_carried_linear(g, "x", small, "w", FAST)).run(None, {"x": x})[0]
    narrowed = x @ small.dequantize().T
    np.testing.assert_allclose(got, narrowed, rtol=1e-4, atol=1e-4 * np.abs(narrowed).max())
    expected = x @ reference.T
    requant = matmul_session(lambda g: add_linear(g, "x", reference, "w", FAST)).run(None, {"x": x})[0]
    assert np.sqrt(np.mean((got - expected) ** 2)) < np.sqrt(np.mean((requant - expected) ** 2))


@pytest.mark.parametrize("kind", ["Q4_1", "Q4_K"])
def test_the_fast_layout_reads_4_bit_blocks_without_zero_points(kind):
    """ORT's int8-activation kernel runs a 4-bit matrix without zero points faster, so the fast layout moves
    the affine formats' integer zero points into the per-block correction: the weights stay the same (float
    rounding apart) and no zero points reach the graph."""
    exact = carry_gguf(gguf_bytes(kind, np.random.default_rng(5)), kind, N, K)
    assert exact.zero_points is not None  # the exact layout has them
    moved = zero_points_into_correction(exact)
    assert moved.zero_points is None and (moved.packed is exact.packed)
    np.testing.assert_allclose(
        moved.dequantize(), exact.dequantize(), rtol=0, atol=1e-6 * np.abs(exact.dequantize()).max()
    )
    assert fast_layout(exact).zero_points is None
    g = Graph()
    add_carried_linear(g, "x", exact, "w", FAST)
    assert not [i for node in g.nodes if node.op_type == "MatMulNBits" for i in node.input[3:4] if i]
    narrowed = narrow_to_4bit(carry_gguf(gguf_bytes("Q6_K", np.random.default_rng(5)), "Q6_K", N, K))
    assert zero_points_into_correction(narrowed) is narrowed  # no correction to carry them: left alone


def test_the_small_layout_leaves_4_bit_blocks_as_they_are():
    exact = carry_gguf(gguf_bytes("Q4_K", np.random.default_rng(4)), "Q4_K", N, K)
    assert narrow_to_4bit(exact) is exact


def test_fast_layout_leaves_blocks_without_a_correction_or_half_blocks_alone():
    rng = np.random.default_rng(3)
    for kind in ("Q4_0", "Q8_0", "Q5_0"):
        exact = carry_gguf(gguf_bytes(kind, rng), kind, N, K)
        assert fast_layout(exact) is exact


def test_unsupported_types_are_not_carried():
    raw = np.zeros((N, K // 256 * 110), np.uint8)  # Q3_K: no MatMulNBits layout here
    assert carry_gguf(raw, "Q3_K", N, K) is None


def test_concatenated_blocks_of_two_types_keep_both_exact():
    """A fused projection whose parts came as Q4_0 and Q4_K (one layout: 4 bits, blocks of 32)."""
    rng = np.random.default_rng(1)
    parts = [carry_gguf(gguf_bytes(kind, rng), kind, N, K) for kind in ("Q4_0", "Q4_K")]
    fused = concat_blocks(parts)
    np.testing.assert_allclose(fused.dequantize(), np.concatenate([p.dequantize() for p in parts]), rtol=1e-6)
    rows = np.array([3, 30, 7])
    np.testing.assert_array_equal(fused.rows(rows).dequantize(), fused.dequantize()[rows])


def _llama_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's conversion order of a Llama q/k weight's rows (its rotary layout)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


GGUF_TYPES = {
    "attn_q": "Q8_0",
    "attn_k": "Q4_0",
    "attn_v": "Q4_1",
    "attn_output": "Q4_0",
    "ffn_gate": "Q4_1",
    "ffn_up": "Q4_1",
    "ffn_down": "Q5_0",
}
FIELDS = {
    "attn_q": "q",
    "attn_k": "k",
    "attn_v": "v",
    "attn_output": "o",
    "ffn_gate": "gate",
    "ffn_up": "up",
    "ffn_down": "down",
}


def test_gguf_file_blocks_attach_to_the_weights_transformers_loaded(tmp_path):
    """A tiny Llama written as a GGUF file the way llama.cpp writes one (q/k rows permuted, mixed types):
    every matrix is carried, q/k in transformers' row order, and the carried int4 graph computes what the
    fp32 graph of the dequantized weights computes; a matrix whose bytes disagree falls back."""
    from gguf import GGUFWriter

    from edge_spec.export.gguf.carry import attach_gguf_blocks
    from edge_spec.export.graph.builder import build_decoder, save_model
    from edge_spec.export.graph.quantize import quantize_blockwise
    from edge_spec.export.graph.weights import weights_from_state_dict
    from edge_spec.runtime.model.decoder import Decoder
    from tests.test_model_families import ids_for, tiny_model

    model = tiny_model("llama3")
    state = {k: v.detach().float().numpy().copy() for k, v in model.state_dict().items()}
    weights = weights_from_state_dict(model.config, state)
    cfg = weights.config
    writer = GGUFWriter(tmp_path / "tiny.gguf", "llama")
    for i, layer in enumerate(weights.layers):
        for gguf_name, kind in GGUF_TYPES.items():
            w = getattr(layer, FIELDS[gguf_name])
            heads = {"attn_q": cfg.num_heads, "attn_k": cfg.num_kv_heads}.get(gguf_name)
            raw = quants.quantize(_llama_permute(w, heads) if heads else w, getattr(T, kind))
            writer.add_tensor(f"blk.{i}.{gguf_name}.weight", raw, raw_dtype=getattr(T, kind))
            loaded = quants.dequantize(raw, getattr(T, kind)).reshape(w.shape)  # what transformers would load
            if heads:
                loaded = loaded[np.argsort(_llama_permute(np.arange(w.shape[0]), heads))]
            setattr(layer, FIELDS[gguf_name], loaded)
    embed_raw = quants.quantize(weights.embed, T.Q8_0)
    writer.add_tensor("token_embd.weight", embed_raw, raw_dtype=T.Q8_0)
    weights.lm_head = quants.dequantize(embed_raw, T.Q8_0).reshape(weights.embed.shape)
    # the lookup table is re-quantized to int8 beside carried blocks; start it on that grid so both match
    weights.embed = quantize_blockwise(weights.lm_head, 8, 32).dequantize()
    finish_gguf(writer)

    down = weights.layers[1].down
    weights.layers[1].down = down + 1e-3  # as if transformers had loaded other bytes for this one
    report = attach_gguf_blocks(tmp_path / "tiny.gguf", weights)
    assert list(report.fallback) == ["layers.1.down"] and "differ" in report.fallback["layers.1.down"]
    weights.layers[1].down, weights.carried = down, {}
    report = attach_gguf_blocks(tmp_path / "tiny.gguf", weights)
    assert dict(report.carried) == {"Q8_0": 3, "Q4_0": 4, "Q4_1": 6, "Q5_0": 2} and not report.fallback

    ids = ids_for(4)
    logits = {}
    for name, options in {
        "exact": dict(carry_exact=True),
        "fast": {},
        "fp32": {},
        "requant": dict(gguf_blocks=False),
    }.items():
        path = tmp_path / f"{name}.onnx"
        quant = "fp32" if name == "fp32" else "int4"
        save_model(build_decoder(weights, BuildOptions(quant, accuracy_level=0, context_length=64, **options)), path)
        # the same float32 cache for all: what differs is how the weights were carried
        decoder = Decoder(path, capacity=64, threads=1, half_cache=False)
        logits[name] = decoder.forward(ids, len(ids))["logits"]
    np.testing.assert_allclose(logits["exact"], logits["fp32"], atol=1e-4)
    # the key and value (both 4-bit blocks of 32) share one matmul beside the 8-bit query's: a node each
    # costs step time, and the correction's block sums of their common input are computed once
    import onnx

    for name in ("exact", "fast"):
        graph = onnx.load(str(tmp_path / f"{name}.onnx"), load_external_data=False).graph
        matmuls = sorted(n.name.split("/")[0] for n in graph.node if n.op_type == "MatMulNBits")
        attention_inputs = [m for m in matmuls if m.split(".")[-1] in ("q", "k", "v", "kv", "qkv")]
        assert attention_inputs == [f"layers.{i}.{part}" for i in range(cfg.num_layers) for part in ("kv", "q")]
    # negative control: the same weights re-quantized to int4 blocks (the old path) are far off; the default
    # layout (Q4_1's correction folded into the matmul at 4 bits) stays much closer than that
    requant_error = np.abs(logits["requant"] - logits["fp32"]).max()
    assert requant_error > 1e-2
    assert np.abs(logits["fast"] - logits["fp32"]).max() < requant_error / 4


@pytest.mark.parametrize("layout", ["fast", "lean", "exact", "small"])
def test_export_says_and_records_what_kept_its_blocks(tmp_path, tiny_pair, layout):
    """One line in the export log and the manifest's quantization record per model, with the layout
    (--gguf-layout) the target graph was built in; by default only the target keeps GGUF blocks (the
    drafter's rounding moves acceptance, not the output)."""
    from collections import Counter

    import onnx

    from edge_spec.export.bundle.build import ExportOptions, export_bundle
    from edge_spec.export.gguf.carry import CarryReport
    from tests import tiny_models

    tokenizer, target, draft = tiny_pair
    models = {"t": tiny_models.loaded("t", target, tokenizer), "d": tiny_models.loaded("d", draft, tokenizer)}
    for model in models.values():  # as load_model leaves a GGUF source
        model.gguf_carry = CarryReport(Counter({"Q4_K": 3}), {"layers.0.down": "Q3_K: no exact MatMulNBits layout"})
    o = models["t"].weights.layers[0].o  # one affine matrix carried, so the layout shows in the graph
    models["t"].weights.carried["layers.0.o"] = carry_gguf(quants.quantize(o, T.Q4_1), "Q4_1", *o.shape)
    head = models["t"].weights.lm_head  # and one 8-bit matrix: the small layout rounds it to 4 bits
    models["t"].weights.carried["lm_head"] = carry_gguf(quants.quantize(head, T.Q8_0), "Q8_0", *head.shape)
    lines: list[str] = []
    manifest = export_bundle(
        "t",
        "d",
        tmp_path / "b",
        ExportOptions(context_length=64, gguf_layout=layout),
        lines.append,
        loader=models.__getitem__,
    )
    assert manifest["target"]["quantization"]["gguf_blocks"] == {
        "carried": {"Q4_K": 3},
        "requantized": {"layers.0.down": "Q3_K: no exact MatMulNBits layout"},
    }
    assert manifest["target"]["quantization"]["gguf_layout"] == layout
    assert manifest["draft"]["quantization"]["gguf_blocks"] == "requantized"
    said = [line for line in lines if "GGUF blocks" in line]
    assert said == [
        f"t: GGUF blocks carried: 3 matrices (Q4_K 3); re-quantized: layers.0.down (Q3_K: no "
        f"exact MatMulNBits layout) ({layout} layout); embedding table re-quantized to int8"
    ]
    graph = onnx.load(str(tmp_path / "b" / manifest["target"]["onnx"]), load_external_data=False).graph
    nodes = {n.name for n in graph.node}
    assert ("layers.0.o/x_and_sums/Concat" in nodes) == (layout in ("fast", "lean", "small"))
    assert ("layers.0.o/correction/MatMul" in nodes) == (layout == "exact")
    bits = {
        n.name: next(a.i for a in n.attribute if a.name == "bits") for n in graph.node if n.op_type == "MatMulNBits"
    }
    assert bits["lm_head/out/MatMulNBits"] == (4 if layout in ("lean", "small") else 8)
    assert ("lm_head/rescored/ScatterElements" in nodes) == (layout == "lean")


def test_an_unknown_gguf_layout_is_one_line():
    from edge_spec.errors import EdgeSpecError
    from edge_spec.export.bundle.build import ExportOptions

    with pytest.raises(
        EdgeSpecError,
        match=r"^--gguf-layout must be one of auto, fast, lean, exact, small, native, compact, not 'quick'$",
    ):
        ExportOptions(gguf_layout="quick").check()


def test_a_gguf_file_is_parsed_once_per_load(tmp_path, monkeypatch):
    """transformers and the exporter open a GGUF file seven times a load; inside ``gguf_parsed_once``
    they share one reader (also through ``from gguf import GGUFReader`` inside a function, as transformers
    imports it), a file that fails to parse is not remembered, and outside it every call parses again."""
    import gguf
    from gguf import GGUFWriter

    from edge_spec.errors import EdgeSpecError
    from edge_spec.export.sources.resolve import check_gguf, gguf_parsed_once

    path = tmp_path / "one.gguf"
    writer = GGUFWriter(path, "llama")
    raw = quants.quantize(np.random.default_rng(0).normal(size=(4, 64)).astype(np.float32), T.Q8_0)
    writer.add_tensor("token_embd.weight", raw, raw_dtype=T.Q8_0)
    finish_gguf(writer)
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\0" * 12)

    parses = count_gguf_parses(monkeypatch)
    counted = gguf.GGUFReader

    def as_transformers_opens_it(p):
        from gguf import GGUFReader

        return GGUFReader(p)

    with gguf_parsed_once():
        check_gguf(path)
        first = as_transformers_opens_it(path)
        assert as_transformers_opens_it(str(path)) is first and len(parses) == 1
        for _ in range(2):
            with pytest.raises(EdgeSpecError, match="not a valid GGUF file"):
                check_gguf(broken)
        assert len(parses) == 3
    assert gguf.GGUFReader is counted
    assert as_transformers_opens_it(path) is not first and len(parses) == 4
