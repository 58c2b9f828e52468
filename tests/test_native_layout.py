"""The native layout (``--gguf-layout native``): carried Q4_K and Q6_K matrices as GGUF's own bytes under
``MatMulGGUF``, built into a decoder graph and run by the runtime's ``Decoder``."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import onnx
import pytest

pytest.importorskip("gguf")

from edge_spec.export.bundle.options import ExportOptions, layout_name  # noqa: E402
from edge_spec.export.gguf.blocks import carry_gguf  # noqa: E402
from edge_spec.export.gguf.interleaved import Q4_K, Q6_K, deinterleave, interleave  # noqa: E402
from edge_spec.export.graph.builder import BuildOptions, build_decoder, save_model  # noqa: E402
from edge_spec.native import build  # noqa: E402
from edge_spec.runtime.model import native_attention  # noqa: E402
from edge_spec.runtime.model.decoder import Decoder  # noqa: E402
from edge_spec.runtime.model.last_rows import SUFFIX, cut_rows_early  # noqa: E402
from tests import tiny_models  # noqa: E402

HIDDEN = 256  # the native op takes rows of whole 256-weight super-blocks
IDS = [5, 17, 42, 99, 7, 230, 64, 3, 11, 150]
PARTS = ("q", "k", "v", "o", "gate", "up", "down")


@pytest.fixture(scope="module")
def weights():
    """A tiny Qwen2 whose layer matrices are carried as (random) Q4_K blocks, layer 0's value and down as Q6_K
    (as a Q4_K_M file mixes them)."""
    w = tiny_models.loaded("t", tiny_models.make_qwen2(seed=0, hidden=HIDDEN), tiny_models.make_tokenizer()).weights
    rng = np.random.default_rng(0)
    for i, layer in enumerate(w.layers):
        for part in PARTS:
            n, k = getattr(layer, part).shape
            kind = "Q6_K" if i == 0 and part in ("v", "down") else "Q4_K"
            raw = tiny_models.random_k_quant_blocks(rng, kind, n, k, factor=(1e-4, 5e-4))
            w.carried[f"layers.{i}.{part}"] = carry_gguf(raw, kind, n, k)
    return w


def _path(weights, folder, **options):
    name = "compact" if options.get("carry_compact") else "native" if options.get("carry_native") else "lean"
    path = folder / f"{name}.onnx"
    if not path.exists():
        save_model(build_decoder(weights, BuildOptions("int4", context_length=64, **options)), path)
    return path


def _logits(path, chunks):
    decoder = Decoder(path, capacity=64, threads=1)
    return np.concatenate([decoder.forward(c, len(c))["logits"].reshape(len(c), -1) for c in chunks])


def test_the_native_layout_multiplies_ggufs_blocks(weights, native_library, tmp_path):
    path = _path(weights, tmp_path, carry_native=True)
    nodes = onnx.load(str(path), load_external_data=False).graph.node
    ops = [(n.op_type, n.domain) for n in nodes]
    assert ops.count(("MatMulGGUF", "ai.edge_spec")) >= len(weights.layers) * 4
    # each layer's gate and up with SwiGLU in the op: no Split, Sigmoid or Mul between it and the down projection
    swiglu = [n for n in nodes if n.op_type == "MatMulGGUF" and any(a.name == "glu" and a.i == 1 for a in n.attribute)]
    assert len(swiglu) == len(weights.layers) and all(n.output[0].endswith("/glu") for n in swiglu)
    assert not any(n.op_type in ("Split", "Sigmoid") for n in nodes)
    assert ops.count(("MatMulNBits", "com.microsoft")) == 1  # the LM head, not carried here
    native = _logits(path, [IDS])
    lean = _logits(_path(weights, tmp_path), [IDS])  # the same blocks through MatMulNBits
    assert native.shape == lean.shape
    # the same weights, activations rounded in blocks of 256 instead of 32: close, not equal
    assert not np.array_equal(native, lean)
    assert np.corrcoef(native.ravel(), lean.ravel())[0, 1] > 0.999
    assert (native.argmax(-1) == lean.argmax(-1)).mean() >= 0.9


def _gguf_types(path) -> list[int]:
    nodes = onnx.load(str(path), load_external_data=False).graph.node
    return [next(a.i for a in n.attribute if a.name == "type") for n in nodes if n.op_type == "MatMulGGUF"]


def test_the_compact_layout_rounds_the_layers_q6_k_blocks_to_q4_k(weights, native_library, tmp_path):
    native = _path(weights, tmp_path, carry_native=True)
    compact = _path(weights, tmp_path, carry_native=True, carry_compact=True)
    assert Q6_K in _gguf_types(native) and set(_gguf_types(compact)) == {Q4_K}
    size = {p: sum(f.stat().st_size for f in tmp_path.glob(p.name + "*")) for p in (native, compact)}
    assert size[compact] < size[native]  # fewer bytes a step
    a, b = _logits(native, [IDS]), _logits(compact, [IDS])
    assert not np.array_equal(a, b)  # rounded once more: close, not equal
    assert np.corrcoef(a.ravel(), b.ravel())[0, 1] > 0.999
    assert (a.argmax(-1) == b.argmax(-1)).mean() >= 0.9


def test_a_q6_k_weight_rounds_to_llama_cpps_q4_k_of_its_values_and_others_stay():
    from edge_spec.export.gguf.blocks import round_q6k_to_q4k
    from edge_spec.export.gguf.q4_k import quantize_q4_k

    rng = np.random.default_rng(3)
    q6k = carry_gguf(tiny_models.random_k_quant_blocks(rng, "Q6_K", 32, 512, factor=(1e-3, 5e-3)), "Q6_K", 32, 512)
    rounded = round_q6k_to_q4k(q6k)
    assert rounded.source_type == "Q4_K" and np.array_equal(rounded.raw, quantize_q4_k(q6k.dequantize()))
    step = np.abs(q6k.dequantize()).max() / 7  # about a Q4_K step of the largest block
    assert np.abs(rounded.dequantize() - q6k.dequantize()).max() < step
    q4k = carry_gguf(tiny_models.random_k_quant_blocks(rng, "Q4_K", 32, 512, factor=(1e-3, 5e-3)), "Q4_K", 32, 512)
    assert round_q6k_to_q4k(q4k) is q4k


def test_a_rows_logits_do_not_depend_on_the_rows_beside_it(weights, native_library, tmp_path):
    path = _path(weights, tmp_path, carry_native=True)
    whole = _logits(path, [IDS])
    parts = _logits(path, [IDS[:1], IDS[1:4], IDS[4:]])
    np.testing.assert_array_equal(parts, whole)


def test_the_last_layer_runs_only_the_rows_whose_logits_are_asked(weights, native_library, tmp_path, monkeypatch):
    """Its output projection, MLP and the final norm see the pass's last num_logits rows alone, and every logit
    keeps its bits: prompt-sized passes asking for one row, verify-sized ones asking for all, one-row ones."""
    path = _path(weights, tmp_path, carry_native=True)
    graph = onnx.load(str(path), load_external_data=False)
    assert cut_rows_early(graph) == 5  # the last layer's o, norm, gate and up, down, and the final norm
    cuts = [n for n in graph.graph.node if n.name.endswith(SUFFIX)]
    assert sorted(n.input[0].split("/")[-1] for n in cuts) == ["attn", "resid1"]
    assert cut_rows_early(onnx.load(str(_path(weights, tmp_path)), load_external_data=False)) == 0  # lean: kept

    def logits(decoder: Decoder) -> list[np.ndarray]:
        passes = [(IDS[:7], 1), (IDS[7:8], 1), (IDS[8:], 2), (IDS[:4], 4), (IDS[4:9], 3)]
        return [decoder.forward(chunk, asked)["logits"] for chunk, asked in passes]

    early = logits(Decoder(path, capacity=64, threads=1))
    monkeypatch.setattr("edge_spec.runtime.model.decoder.cut_rows_early", lambda model: 0)
    late = logits(Decoder(path, capacity=64, threads=1))
    assert [a.shape for a in early] == [(1, 384), (1, 384), (2, 384), (4, 384), (3, 384)]
    for a, b in zip(early, late):
        np.testing.assert_array_equal(a, b)


def test_without_the_library_a_native_graph_runs_as_the_lean_layout_does(weights, tmp_path, monkeypatch, caplog):
    path = _path(weights, tmp_path, carry_native=True)
    monkeypatch.setenv("EDGE_SPEC_NATIVE_ATTENTION", "0")  # no library: ORT's attention in both
    lean = _logits(_path(weights, tmp_path), [IDS])
    monkeypatch.setattr(build, "required_library_path", lambda: None)
    with caplog.at_level(logging.WARNING):
        fallback = _logits(path, [IDS])
    # the exporter's lean nodes for the same blocks (the biases back inside MatMulNBits): the same bits
    np.testing.assert_array_equal(fallback, lean)
    warned = [r.getMessage() for r in caplog.records if "MatMulNBits" in r.getMessage()]
    assert len(warned) == 1 and "does not build here" in warned[0] and "\n" not in warned[0]
    assert onnx.load(str(path), load_external_data=False).graph.node  # the bundle's file is left as it was
    assert any(n.op_type == "MatMulGGUF" for n in onnx.load(str(path), load_external_data=False).graph.node)


def test_the_lean_form_can_be_told_from_the_native_op(weights, native_library, tmp_path, monkeypatch):
    """The negative control of the test above: with the op, the logits are not lean's."""
    path = _path(weights, tmp_path, carry_native=True)
    lean = _logits(_path(weights, tmp_path), [IDS])
    assert not np.array_equal(_logits(path, [IDS]), lean)
    monkeypatch.setenv("EDGE_SPEC_NATIVE_MATMUL", "0")
    np.testing.assert_array_equal(_logits(path, [IDS]), lean)


@pytest.mark.parametrize(
    "provider, env, path, why",
    [
        ("cpu", "0", "avx2", "EDGE_SPEC_NATIVE_MATMUL=0"),
        ("webgpu", "1", "avx2", "CPU execution provider only"),
        ("cpu", "1", "scalar", "no AVX2"),
        ("cpu", "1", "avx512", ""),
    ],
)
def test_the_route_says_why_the_native_op_does_not_run(weights, tmp_path, monkeypatch, provider, env, path, why):
    graph = onnx.load(str(_path(weights, tmp_path, carry_native=True)), load_external_data=False)
    monkeypatch.setenv("EDGE_SPEC_NATIVE_MATMUL", env)
    monkeypatch.setattr(build, "required_library_path", lambda: tmp_path / "libedge_spec.so")
    monkeypatch.setattr(native_attention, "gguf_matmul_path", lambda library: path)
    library, reason = native_attention.native_matmul_route(graph, provider)
    assert why in reason and (library is None) == bool(why)
    plain = onnx.load(str(_path(weights, tmp_path)), load_external_data=False)
    assert native_attention.native_matmul_route(plain, provider) == (None, "")


@pytest.mark.parametrize("kind", [Q4_K, Q6_K])
def test_records_give_back_ggufs_own_bytes(kind):
    rng = np.random.default_rng(kind)
    name = {Q4_K: "Q4_K", Q6_K: "Q6_K"}[kind]
    for n in (16, 37, 5):
        raw = tiny_models.random_k_quant_blocks(rng, name, n, 512, factor=(1e-4, 5e-4)).reshape(n, -1)
        records = interleave(raw, kind, n, 512)
        np.testing.assert_array_equal(deinterleave(records, kind, n, 512), raw)
        for offset in (0, {Q4_K: 320, Q6_K: 288}[kind] + 128):  # row 0's scale factor, then one of its code bytes
            changed = records.copy()
            changed[0, 0, offset] ^= 0x10
            assert not np.array_equal(deinterleave(changed, kind, n, 512), raw)


def test_the_native_layout_is_named_in_the_manifest_and_takes_the_prompt_reader():
    assert layout_name(False, False, 64, True) == "native"
    assert layout_name(False, False, 64, True, True) == "compact"
    ExportOptions(gguf_layout="native", prompt_reader=True).check()  # tests/test_prompt_reader_native.py
    ExportOptions(gguf_layout="compact", prompt_reader=True).check()


def test_the_runtime_knows_the_native_layouts_by_what_they_build():
    from edge_spec.export.bundle.options import GGUF_LAYOUTS
    from edge_spec.manifest import NATIVE_LAYOUTS

    assert set(NATIVE_LAYOUTS) == {name for name, fields in GGUF_LAYOUTS.items() if fields.get("carry_native")}


def test_auto_is_compact_where_the_native_op_runs_here_and_lean_elsewhere(monkeypatch):
    from edge_spec.export.bundle.build import chosen_layout

    said = []
    monkeypatch.setattr(native_attention, "native_matmul_here", lambda provider="cpu": (Path("lib.so"), ""))
    assert chosen_layout(ExportOptions(), said.append) == "compact" and not said
    assert chosen_layout(ExportOptions(prompt_reader=True), said.append) == "compact"
    monkeypatch.setattr(native_attention, "native_matmul_here", lambda provider="cpu": (None, "no compiler here"))
    assert chosen_layout(ExportOptions(), said.append) == "lean"
    assert said == ["GGUF layout: lean, not compact, since no compiler here"]
    assert chosen_layout(ExportOptions(gguf_layout="native"), said.append) == "native"  # asked for: kept
    assert chosen_layout(ExportOptions(gguf_layout="fast"), said.append) == "fast"


RESCORED = 8


@pytest.fixture(scope="module")
def headed():
    """The tiny Qwen2 with only its LM head carried, as Q6_K blocks (a Q4_K_M file's head): the layers are the
    same int4 matrices in every layout, so two layouts' logits differ only where their LM heads do."""
    from gguf import GGMLQuantizationType, quants

    w = tiny_models.loaded("h", tiny_models.make_qwen2(seed=0, hidden=HIDDEN), tiny_models.make_tokenizer()).weights
    n, k = w.lm_head.shape
    raw = tiny_models.random_k_quant_blocks(np.random.default_rng(1), "Q6_K", n, k, factor=(5e-4, 2e-3))
    w.lm_head = quants.dequantize(raw, GGMLQuantizationType.Q6_K).reshape(n, k)  # the rows scored again
    w.carried["lm_head"] = carry_gguf(raw, "Q6_K", n, k)
    return w


def _best(logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return logits.argmax(-1), logits.max(-1)


def test_the_native_layout_ranks_an_8_bit_head_by_q4_k_blocks_under_its_op(headed, native_library, tmp_path):
    from edge_spec.export.gguf.blocks import ACCURACY_LEVEL_KEY

    path = _path(headed, tmp_path, carry_native=True, head_rescore=RESCORED)
    model = onnx.load(str(path), load_external_data=False)
    head = [n for n in model.graph.node if n.op_type in ("MatMulGGUF", "MatMulNBits") and n.name.startswith("lm_head/")]
    assert [(n.op_type, {a.name: a.i for a in n.attribute}["type"]) for n in head] == [("MatMulGGUF", Q4_K)]
    assert any(n.op_type == "TopK" for n in model.graph.node)  # its best rows are still scored again
    assert {p.key: p.value for p in model.metadata_props}[ACCURACY_LEVEL_KEY] == "4"
    native = _logits(path, [IDS])
    lean = _logits(_path(headed, tmp_path, head_rescore=RESCORED), [IDS])  # the head ranked in MatMulNBits blocks
    # the best rows come from the same 8-bit rows and the same hidden states: the same token, the same logit
    for a, b in zip(_best(native), _best(lean)):
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(native, lean)  # negative control: the rows left at 4 bits are rounded otherwise
    assert np.corrcoef(native.ravel(), lean.ravel())[0, 1] > 0.99


def test_without_the_library_the_q4_k_head_runs_in_matmulnbits(headed, native_library, tmp_path, monkeypatch):
    path = _path(headed, tmp_path, carry_native=True, head_rescore=RESCORED)
    native = _logits(path, [IDS])
    monkeypatch.setenv("EDGE_SPEC_NATIVE_MATMUL", "0")
    fallback = _logits(path, [IDS])
    for a, b in zip(_best(fallback), _best(native)):
        np.testing.assert_array_equal(a, b)
    assert np.corrcoef(native.ravel(), fallback.ravel())[0, 1] > 0.999


@pytest.mark.parametrize("recorded, level", [("2", 2), (None, 4)])
def test_the_lean_form_takes_the_accuracy_level_the_export_recorded(headed, tmp_path, recorded, level):
    from edge_spec.export.gguf.blocks import ACCURACY_LEVEL_KEY
    from edge_spec.export.gguf.native_to_lean import rewrite_as_lean

    path = _path(headed, tmp_path, carry_native=True, head_rescore=RESCORED)
    model = onnx.load(str(path), load_external_data=False)
    kept = [p for p in model.metadata_props if p.key != ACCURACY_LEVEL_KEY]
    del model.metadata_props[:]
    model.metadata_props.extend(kept)
    if recorded is not None:
        model.metadata_props.append(onnx.StringStringEntryProto(key=ACCURACY_LEVEL_KEY, value=recorded))
    rewrite_as_lean(model, path.parent)
    head = [n for n in model.graph.node if n.op_type == "MatMulNBits" and n.name.startswith("lm_head")]
    assert [next(a.i for a in n.attribute if a.name == "accuracy_level") for n in head] == [level]


NARROW = 224  # a drafter's width short of whole super-blocks by an eighth (Qwen2.5-0.5B's 896 is three and a half)


@pytest.fixture(scope="module")
def narrow(tmp_path_factory):
    """A tiny Qwen2 of width 224 (no GGUF blocks: re-quantized, as the drafter is) built three ways: float32,
    ``MatMulNBits`` int4 (the lean layouts' drafter) and rounded to Q4_K under the native op."""
    w = tiny_models.loaded("n", tiny_models.make_qwen2(seed=4, hidden=NARROW), tiny_models.make_tokenizer()).weights
    folder = tmp_path_factory.mktemp("narrow")
    paths = {"weights": w}
    for name, options in {
        "fp32": dict(quant="fp32"),
        "int4": dict(gguf_blocks=False),
        "rounded": dict(gguf_blocks=False, carry_native=True, round_native=True),
    }.items():
        paths[name] = folder / f"{name}.onnx"
        save_model(build_decoder(w, BuildOptions(**{"quant": "int4", "context_length": 64, **options})), paths[name])
    return paths


def test_a_requantized_body_is_rounded_to_q4_k_blocks_under_the_native_op(narrow):
    nodes = onnx.load(str(narrow["rounded"]), load_external_data=False).graph.node
    native = [n for n in nodes if n.op_type == "MatMulGGUF" and n.name.startswith("layers.")]
    widths = sorted({a.i for n in native for a in n.attribute if a.name == "K"})
    assert widths == [NARROW, 2 * NARROW]  # the projections read 224 (and the down 448) inputs: no padded input
    assert len(native) == 2 * 4  # per layer: Q/K/V, O, gate/up with SwiGLU, down
    assert sum(any(a.name == "glu" and a.i for a in n.attribute) for n in native) == 2
    assert not [n for n in nodes if n.op_type == "MatMulNBits" and n.name.startswith("layers.")]


def test_a_body_rounded_to_q4_k_computes_what_its_int4_blocks_do(narrow, native_library):
    """Q4_K's rows, zero-padded to whole super-blocks, stay as close to the float model as MatMulNBits' int4 blocks
    of 32 (the drafter's rounding moves acceptance only, but must not move it far)."""
    exact = _logits(narrow["fp32"], [IDS])
    logits = {name: _logits(narrow[name], [IDS]) for name in ("int4", "rounded")}
    errors = {name: np.abs(got - exact).mean() for name, got in logits.items()}
    agree = {name: (got.argmax(-1) == exact.argmax(-1)).mean() for name, got in logits.items()}
    assert 0 < errors["rounded"] < 1.5 * errors["int4"]
    assert agree["rounded"] >= agree["int4"]  # (this random model is touchy: int4 keeps 2 of 10 best tokens)


def test_without_the_library_a_rounded_body_reads_its_input_padded_with_zeros(narrow, native_library, monkeypatch):
    native = _logits(narrow["rounded"], [IDS])
    monkeypatch.setenv("EDGE_SPEC_NATIVE_MATMUL", "0")
    fallback = _logits(narrow["rounded"], [IDS])  # MatMulNBits over the same blocks, after a Pad of the input
    assert not np.array_equal(fallback, native)  # activations rounded otherwise: blocks of 32 against the op's 256
    # the same Q4_K weights: the two forms are far nearer each other than either is to the float model
    rounding = np.abs(native - _logits(narrow["fp32"], [IDS])).mean()
    assert np.abs(fallback - native).mean() < 0.25 * rounding, (np.abs(fallback - native).mean(), rounding)


def test_the_prompt_reader_takes_a_rounded_matmuls_weights_at_the_inputs_width(narrow):
    from edge_spec.export.graph.prompt_reader import _Initializers, native_weight

    model = onnx.load(str(narrow["rounded"]), load_external_data=False)
    node = next(n for n in model.graph.node if n.op_type == "MatMulGGUF" and n.name.startswith("layers.0.qkv"))
    weight = native_weight(node, _Initializers(model.graph, narrow["rounded"].parent))
    layer = narrow["weights"].layers[0]
    expected = np.concatenate([np.asarray(layer.q), np.asarray(layer.k), np.asarray(layer.v)])
    assert weight.shape == expected.shape == (NARROW + 2 * 2 * NARROW // 4, NARROW)  # 4 query heads, 2 key, 2 value
    assert np.abs(weight - expected).max() < 0.1 * np.abs(expected).max()  # Q4_K's rounding, no shifted column


SHORT = 896  # Qwen2.5-0.5B's width: its rows end 128 columns into their fourth super-block


@pytest.fixture(scope="module")
def short(tmp_path_factory):
    """A tiny Qwen2 of width 896 rounded to Q4_K under the native op twice: its last blocks' records short (the
    first four sub-blocks alone, as the export writes them) and whole."""
    from edge_spec.export.gguf import blocks

    w = tiny_models.loaded("s", tiny_models.make_qwen2(seed=5, hidden=SHORT), tiny_models.make_tokenizer()).weights
    folder = tmp_path_factory.mktemp("short")
    options = BuildOptions(quant="int4", context_length=64, gguf_blocks=False, carry_native=True, round_native=True)
    paths = {"short": folder / "short.onnx", "whole": folder / "whole.onnx"}
    save_model(build_decoder(w, options), paths["short"])
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(blocks, "short_tail", lambda kind, width: False)
        save_model(build_decoder(w, options), paths["whole"])
    return paths


def _records(path: Path) -> dict[str, tuple[int, int, int]]:
    """Each layer ``MatMulGGUF``'s (K, tail, bytes of records)."""
    from onnx import numpy_helper

    model = onnx.load(str(path))
    sizes = {t.name: numpy_helper.to_array(t).nbytes for t in model.graph.initializer}
    found = {}
    for n in model.graph.node:
        if n.op_type == "MatMulGGUF" and n.name.startswith("layers."):
            attrs = {a.name: a.i for a in n.attribute}
            found[n.name] = (attrs["K"], attrs.get("tail", 8), sizes[n.input[1]])
    return found


def test_rows_ending_early_in_their_last_block_read_short_records_with_the_same_logits(
    short, native_library, monkeypatch
):
    short_nodes, whole_nodes = _records(short["short"]), _records(short["whole"])
    assert {k: tail for k, tail, _ in short_nodes.values()} == {SHORT: 4, 2 * SHORT: 8}  # the down projection: whole
    for name, (k, tail, size) in short_nodes.items():
        tiles = size // (3 * 2368 + 1344) if tail == 4 else None
        assert size == whole_nodes[name][2] - (tiles * 1024 if tail == 4 else 0), name
    assert np.array_equal(_logits(short["short"], [IDS]), _logits(short["whole"], [IDS]))
    monkeypatch.setenv("EDGE_SPEC_NATIVE_MATMUL", "0")  # the lean layout's nodes, from the records padded back
    assert np.array_equal(_logits(short["short"], [IDS]), _logits(short["whole"], [IDS]))


def test_the_prompt_reader_takes_short_records_weights_whole(short):
    from edge_spec.export.graph.prompt_reader import _Initializers, native_weight

    weights = []
    for path in (short["short"], short["whole"]):
        model = onnx.load(str(path), load_external_data=False)
        node = next(n for n in model.graph.node if n.op_type == "MatMulGGUF" and n.name.startswith("layers.0.qkv"))
        weights.append(native_weight(node, _Initializers(model.graph, path.parent)))
    assert weights[0].shape == (SHORT + 2 * 2 * SHORT // 4, SHORT)
    np.testing.assert_array_equal(*weights)


@pytest.fixture(scope="module")
def rounded_bundle(tmp_path_factory, native_library):
    """The tiny pair at width 224 exported in the native layout on a CPU whose op reads one-row records ahead:
    the drafter's body rounded to Q4_K under the op."""
    from edge_spec.export.bundle.build import export_bundle

    tokenizer = tiny_models.make_tokenizer()
    target = tiny_models.make_qwen2(seed=0, hidden=NARROW)
    models = {
        "t": tiny_models.loaded("t", target, tokenizer),
        "d": tiny_models.loaded("d", tiny_models.perturbed_copy(target, seed=1, noise=0.15), tokenizer),
    }
    out = tmp_path_factory.mktemp("rounded") / "bundle"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(native_attention, "gguf_matmul_asks_ahead", lambda library: True)
        options = ExportOptions(draft_vocab="full", context_length=256, gguf_layout="native")
        export_bundle("t", "d", out, options, loader=models.__getitem__)
    return out


def test_a_native_export_rounds_the_drafters_body_where_the_op_reads_ahead(rounded_bundle):
    from edge_spec.manifest import read_manifest

    draft = read_manifest(rounded_bundle)["draft"]
    assert draft["quantization"]["body"] == "Q4_K" and draft["quantization"]["gguf_layout"] == "native"
    nodes = onnx.load(str(rounded_bundle / draft["onnx"]), load_external_data=False).graph.node
    layers = [n.op_type for n in nodes if n.op_type in ("MatMulGGUF", "MatMulNBits") and n.name.startswith("layers.")]
    assert layers and set(layers) == {"MatMulGGUF"}


@pytest.mark.parametrize("gamma", [2, 5])
def test_greedy_speculation_with_a_rounded_drafter_equals_the_targets_own(rounded_bundle, gamma):
    from edge_spec.runtime.engine import Engine
    from tests.helpers import chain, greedy_drafts_kept_and_refused

    engine = Engine.from_bundle(rounded_bundle, threads=1, mode="spec")
    accepted, refused = greedy_drafts_kept_and_refused(engine, chain(gamma))
    assert accepted > 0 and refused > 0


@pytest.mark.parametrize(
    "layout, widths, ahead, rounds",
    [
        ("native", (896, 4864), True, True),  # Qwen2.5-0.5B: rows of 896 padded by an eighth
        ("native", (896, 4864), False, False),  # AMD's cores: the prefetcher keeps up, MatMulNBits reads less
        ("native", (64, 128), True, False),  # a tiny model padded to 256 would read four times its weights
        ("lean", (896, 4864), True, False),  # no native op in the bundle
    ],
)
def test_the_drafter_is_rounded_where_it_pays(monkeypatch, layout, widths, ahead, rounds):
    from types import SimpleNamespace

    from edge_spec.export.bundle.build import rounds_drafter_native
    from edge_spec.export.bundle.options import layout_settings

    monkeypatch.setattr(native_attention, "native_matmul_here", lambda provider="cpu": (Path("lib.so"), ""))
    monkeypatch.setattr(native_attention, "gguf_matmul_asks_ahead", lambda library: ahead)
    build = BuildOptions(gguf_blocks=False, **layout_settings(layout))
    config = SimpleNamespace(hidden_size=widths[0], intermediate_size=widths[1])
    assert rounds_drafter_native(build, ExportOptions(), config) is rounds


def test_a_compact_export_is_named_so_and_speculates_losslessly(tmp_path, native_library, monkeypatch):
    """The compact layout (the default where the native op runs) end to end: the export rounds the target's Q6_K
    blocks, the runtime routes its target to the native op, and greedy speculation gives the target's own tokens;
    where the op cannot run the same bundle loads in the lean layout's form and stays lossless."""
    from collections import Counter

    from edge_spec.export.bundle.build import ExportOptions as Options
    from edge_spec.export.bundle.build import export_bundle
    from edge_spec.export.gguf.carry import CarryReport
    from edge_spec.manifest import read_manifest
    from edge_spec.runtime.engine import Engine
    from tests.helpers import chain, cli, greedy_drafts_kept_and_refused

    models, _ = tiny_models.carried_pair()
    carried = models["tiny-target"].weights.carried
    down = np.asarray(models["tiny-target"].weights.layers[0].down)  # as a Q4_K_M file has some: a Q6_K down
    carried["layers.0.down"] = carry_gguf(tiny_models.q6_k_blocks(down), "Q6_K", *down.shape)
    # what a GGUF source's loader reports of its carried blocks (the manifest records the layout beside it)
    models["tiny-target"].gguf_carry = CarryReport(Counter({"Q4_K": len(carried) - 1, "Q6_K": 1}))
    assert np.abs(carried["layers.0.down"].dequantize() - down).max() < 0.02 * np.abs(down).max()
    out = tmp_path / "bundle"
    options = Options(draft_vocab="full", context_length=256, gguf_layout="compact")
    export_bundle("tiny-target", "tiny-draft", out, options, loader=models.__getitem__)
    target = read_manifest(out)["target"]
    assert set(_gguf_types(out / target["onnx"])) == {Q4_K} and target["quantization"]["gguf_layout"] == "compact"
    engine = Engine.from_bundle(out, threads=1, mode="spec")
    accepted, refused = greedy_drafts_kept_and_refused(engine, chain(4))
    assert accepted > 0
    monkeypatch.setenv("EDGE_SPEC_NATIVE_MATMUL", "0")
    fallback = Engine.from_bundle(out, threads=1, mode="spec")
    accepted, refused = greedy_drafts_kept_and_refused(fallback, chain(4))
    assert accepted > 0
    info = cli("info", str(out))
    assert info.returncode == 0, info.stderr
    lines = {line.split()[0]: line for line in info.stdout.splitlines() if line.split()}
    assert "int4 in the compact layout, " in lines["target"]
    assert "layout" not in lines["draft"]  # its body was re-quantized: no GGUF layout to name
