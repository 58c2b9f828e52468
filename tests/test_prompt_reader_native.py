"""The int8 prompt reader of a native-layout bundle: its layer matmuls are ``MatMulGGUF`` nodes over GGUF's own
Q4_K and Q6_K blocks, which the prompt graph replaces by int8 products of the same (dequantized) weights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest

pytest.importorskip("gguf")

from gguf import GGMLQuantizationType, quants  # noqa: E402

from edge_spec.export.bundle.build import ExportOptions, export_bundle  # noqa: E402
from edge_spec.export.graph import prompt_reader  # noqa: E402
from edge_spec.export.graph.prompt_reader import _Initializers, native_weight, write_prompt_graph  # noqa: E402
from edge_spec.manifest import read_manifest  # noqa: E402
from edge_spec.runtime.engine import Engine  # noqa: E402
from edge_spec.runtime.model.decoder import Decoder  # noqa: E402
from tests import tiny_models  # noqa: E402
from tests.helpers import chain, cli, greedy_drafts_kept_and_refused, logit_rows  # noqa: E402

HIDDEN = tiny_models.NATIVE_WIDTH
PARTS = tiny_models.LAYER_PARTS
PROMPT = [int(t) for t in np.random.default_rng(5).integers(5, 300, 41)]


@pytest.fixture(scope="module")
def carried_raw():
    return tiny_models.carried_pair(HIDDEN)


@pytest.fixture(scope="module")
def native_reader_bundle(tmp_path_factory, carried_raw, native_library):
    models, _ = carried_raw
    out = tmp_path_factory.mktemp("b") / "native-reader"
    options = ExportOptions(draft_vocab="full", context_length=256, gguf_layout="native", prompt_reader=True)
    export_bundle("tiny-target", "tiny-draft", out, options, loader=models.__getitem__)
    return out


def _graphs(bundle):
    manifest = read_manifest(bundle)
    target = bundle / manifest["target"]["onnx"]
    return target, bundle / manifest["target"]["prompt_reader"]["onnx"]


def _layer_nodes(path, op_type):
    graph = onnx.load(str(path), load_external_data=False).graph
    return [n for n in graph.node if n.op_type == op_type and n.name.startswith("layers.")]


def test_a_native_bundle_gets_a_prompt_graph_of_int8_products(native_reader_bundle):
    target, prompt = _graphs(native_reader_bundle)
    native = _layer_nodes(target, "MatMulGGUF")
    swiglu = [n for n in native if any(a.name == "glu" and a.i for a in n.attribute)]
    assert native and swiglu
    assert not _layer_nodes(prompt, "MatMulGGUF")  # every layer matmul replaced
    # one product a matmul, two for a SwiGLU (its gate and its up rows), written where the op wrote its result
    nodes = onnx.load(str(prompt), load_external_data=False).graph.node
    assert sum(n.op_type == "MatMulIntegerToFloat" for n in nodes) == len(native) + len(swiglu)
    assert all(n.output[0] in {o for m in nodes for o in m.output} for n in native)


def test_the_prompt_graph_multiplies_by_ggufs_blocks_gate_rows_first(native_reader_bundle, carried_raw):
    _, raw = carried_raw
    target, _ = _graphs(native_reader_bundle)
    graph = onnx.load(str(target), load_external_data=False).graph
    arrays = _Initializers(graph, target.parent)

    def dequantized(name):
        return quants.dequantize(raw[name], GGMLQuantizationType.Q4_K)

    compared = 0
    for node in _layer_nodes(target, "MatMulGGUF"):
        layer, part = node.input[1].split(".")[1:3]
        if part == "gate_up":
            expected = np.concatenate([dequantized(f"layers.{layer}.gate"), dequantized(f"layers.{layer}.up")])
        elif part in ("o", "down"):
            expected = dequantized(f"layers.{layer}.{part}")
        else:  # the query, key and value rows: the export reorders the first two for its rotary embedding
            continue
        np.testing.assert_array_equal(native_weight(node, arrays), expected)
        compared += 1
    assert compared == 6


def _reader_logits(target, prompt, **kwargs):
    decoder = Decoder(target, threads=1, capacity=128, prompt_graph=prompt, **kwargs)
    return decoder, logit_rows(decoder.prefill(PROMPT, 4))


def test_the_prompt_graph_reads_prompts_into_the_native_decode_graphs_cache(native_reader_bundle):
    target, prompt = _graphs(native_reader_bundle)
    plain = Decoder(target, threads=1, capacity=128)
    expected = logit_rows(plain.prefill(PROMPT, 4))
    reader, got = _reader_logits(target, prompt)
    assert reader.prompt_session is not None and reader.stats.prefill_calls == {len(PROMPT): 1}
    assert not np.array_equal(got, expected)  # the int8 graph computed it
    assert got.shape == (4, expected.shape[1])
    for a, b in zip(got, expected):  # as near as the lean layout's form of the same blocks is (0.98-1.00 here)
        assert np.corrcoef(a, b)[0, 1] > 0.97
    nxt = int(np.argmax(expected[-1]))  # the decode graph's pass over what the prompt graph wrote
    assert np.corrcoef(logit_rows(plain.forward([nxt]))[-1], logit_rows(reader.forward([nxt]))[-1])[0, 1] > 0.97


def test_a_prompt_graph_with_the_gate_and_up_rows_swapped_is_told_apart(native_reader_bundle, tmp_path, monkeypatch):
    """Negative control for the test above: the same graph over the up rows as gates reads another model."""
    target, _ = _graphs(native_reader_bundle)
    copy = tmp_path / "target"
    shutil.copytree(target.parent, copy)
    original = prompt_reader.native_weight

    def swapped(node, arrays):
        weight = original(node, arrays)
        if any(a.name == "glu" and a.i for a in node.attribute):
            half = len(weight) // 2
            weight = np.concatenate([weight[half:], weight[:half]])
        return weight

    monkeypatch.setattr(prompt_reader, "native_weight", swapped)
    prompt = write_prompt_graph(copy / target.name)
    expected = logit_rows(Decoder(target, threads=1, capacity=128).prefill(PROMPT, 4))
    _, got = _reader_logits(copy / target.name, prompt)
    correlations = [np.corrcoef(a, b)[0, 1] for a, b in zip(got, expected)]
    assert max(correlations) < 0.9, correlations


def test_prompt_graph_rows_do_not_depend_on_the_passes_that_carry_them(native_reader_bundle):
    target, prompt = _graphs(native_reader_bundle)
    whole, whole_logits = _reader_logits(target, prompt)
    chunked = Decoder(target, threads=1, capacity=128, prompt_graph=prompt)
    chunked.prefill_chunk = 8
    np.testing.assert_array_equal(logit_rows(chunked.prefill(PROMPT, 4)), whole_logits)
    for a, b in zip(whole.kv.arrays, chunked.kv.arrays):
        np.testing.assert_array_equal(a[:, :, : len(PROMPT)], b[:, :, : len(PROMPT)])


def test_without_the_native_op_the_prompt_graph_reads_the_same(native_reader_bundle, monkeypatch):
    """The prompt graph's layers are ONNX Runtime's int8 products either way; only the decode graph changes form."""
    target, prompt = _graphs(native_reader_bundle)
    _, with_op = _reader_logits(target, prompt)
    monkeypatch.setenv("EDGE_SPEC_NATIVE_MATMUL", "0")
    lean, without = _reader_logits(target, prompt)
    assert lean._lean_weights  # the decode graph was loaded in the lean layout's form
    np.testing.assert_array_equal(without, with_op)


@pytest.mark.parametrize("gamma", [1, 3])
def test_greedy_speculative_equals_autoregressive_with_a_native_prompt_reader(native_reader_bundle, gamma):
    engine = Engine.from_bundle(native_reader_bundle, threads=1, mode="spec")
    assert engine.bundle.target.prompt_session is not None
    accepted, refused = greedy_drafts_kept_and_refused(engine, chain(gamma))
    assert accepted > 0 and refused > 0, "both a draft kept and one refused over a prompt-graph cache"


@pytest.mark.parametrize(
    "layout, library, path, pays",
    [
        ("lean", "lib.so", "", True),  # over MatMulNBits the int8 graph is several times faster anywhere
        (None, "lib.so", "", True),
        ("native", None, "", True),  # the decode graph then runs in the lean layout's form
        ("native", "lib.so", "", False),  # the native op reads prompts about as fast without AMX
        ("native", "lib.so", "amx", True),
    ],
)
def test_a_prompt_graph_is_loaded_where_it_pays(monkeypatch, layout, library, path, pays):
    from edge_spec.runtime import loaded

    monkeypatch.setattr(loaded, "native_matmul_here", lambda provider: (library, "" if library else "no op"))
    monkeypatch.setattr(loaded, "prompt_path", lambda library: path)
    entry = {"quantization": {"gguf_layout": layout}, "prompt_reader": {"onnx": "target/prompt.onnx"}}
    assert loaded.prompt_reader_pays(entry, "cpu") is pays
    assert (loaded.prompt_graph(Path("b"), entry, loaded.LoadOptions(), "cpu") is not None) is pays
    assert loaded.prompt_graph(Path("b"), entry, loaded.LoadOptions(prompt_reader=False), "cpu") is None


def _as_exported_from_gguf(bundle, tmp_path):
    """A copy of ``bundle`` whose manifest names its target's layout, as an export of a GGUF file records it."""
    copy = tmp_path / "bundle"
    shutil.copytree(bundle, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["target"]["quantization"]["gguf_layout"] = "native"
    (copy / "manifest.json").write_text(json.dumps(manifest))
    return copy


def test_an_engine_leaves_a_native_targets_prompt_graph_where_it_does_not_pay(
    native_reader_bundle, tmp_path, monkeypatch
):
    from edge_spec.runtime import loaded

    bundle = _as_exported_from_gguf(native_reader_bundle, tmp_path)
    monkeypatch.setattr(loaded, "prompt_path", lambda library: "")  # a CPU without AMX
    engine = Engine.from_bundle(bundle, threads=1)
    assert engine.bundle.target.prompt_session is None
    assert engine.complete([{"role": "user", "content": "hi"}], max_new_tokens=4).token_ids


def test_info_says_where_a_prompt_reader_is_left_unloaded(native_reader_bundle, tmp_path):
    from edge_spec.native import build
    from edge_spec.runtime.model.native_attention import prompt_path

    info = cli("info", str(native_reader_bundle))  # no layout recorded: read as the lean layouts are
    assert info.returncode == 0 and info.stdout.count("int8 prompt reader") == 2, info.stdout + info.stderr
    assert "left unloaded" not in info.stdout
    info = cli("info", str(_as_exported_from_gguf(native_reader_bundle, tmp_path)))
    assert info.returncode == 0 and info.stdout.count("int8 prompt reader") == 2, info.stderr
    without_amx = prompt_path(build.library_path()) != "amx"
    assert ("left unloaded here: without AMX" in info.stdout) is without_amx, info.stdout


@pytest.mark.parametrize("pays", [False, True])
def test_the_export_says_where_the_targets_prompt_graph_will_not_be_read(carried_raw, tmp_path, monkeypatch, pays):
    from edge_spec.runtime import loaded

    models, _ = carried_raw
    monkeypatch.setattr(loaded, "prompt_reader_pays", lambda entry, provider: pays)
    said: list[str] = []
    options = ExportOptions(draft_vocab="full", context_length=256, gguf_layout="native", prompt_reader=True)
    export_bundle("tiny-target", "tiny-draft", tmp_path / "b", options, said.append, loader=models.__getitem__)
    notes = [line for line in said if line.startswith("prompt reader: this CPU has no AMX")]
    assert len(notes) == (0 if pays else 1), said
