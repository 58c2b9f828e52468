"""The int8 prompt graph (``export --prompt-reader``): derived from the target's own weights, read into the same
cache, chunk-invariant, and speculative decoding stays token-identical to target-only decoding on it."""

from __future__ import annotations

import json
import shutil

import numpy as np
import onnx
import pytest

from edge_spec.errors import EdgeSpecError
from edge_spec.export.gguf.blocks import CarriedBlocks, add_carried_linear
from edge_spec.export.graph.builder import BuildOptions, Graph
from edge_spec.export.graph.prompt_reader import _Initializers, effective_weight, int8_rows
from edge_spec.manifest import read_manifest
from edge_spec.runtime.engine import Engine
from edge_spec.runtime.model.decoder import Decoder
from tests.helpers import chain, cli, export_tiny, greedy_drafts_kept_and_refused

PROMPT = [int(t) for t in np.random.default_rng(5).integers(5, 300, 41)]


@pytest.fixture(scope="module")
def reader_bundle(tmp_path_factory, tiny_pair):
    # the tiny pair has no GGUF blocks: its matmuls are MatMulNBits' (a native bundle's: test_prompt_reader_native)
    return export_tiny(tmp_path_factory.mktemp("b") / "reader", tiny_pair, quant="int4", prompt_reader=True)


def _decoders(bundle, **kwargs):
    manifest = read_manifest(bundle)
    target = bundle / manifest["target"]["onnx"]
    prompt = bundle / manifest["target"]["prompt_reader"]["onnx"]
    return Decoder(target, threads=1, capacity=128, **kwargs), Decoder(
        target, threads=1, capacity=128, prompt_graph=prompt, **kwargs
    )


def test_export_records_the_prompt_graph_and_its_weights(reader_bundle, int4_bundle):
    manifest = read_manifest(reader_bundle)
    record = manifest["target"]["prompt_reader"]
    assert record["onnx"] == "target/prompt.onnx"
    paths = {f["path"] for f in manifest["target"]["files"]}
    assert {"target/prompt.onnx", "target/prompt.onnx.data"} <= paths
    assert manifest["draft"]["prompt_reader"]["onnx"] == "draft/prompt.onnx"
    assert (reader_bundle / "target" / "prompt.onnx.data").stat().st_size > 0
    assert "prompt_reader" not in read_manifest(int4_bundle)["target"]  # an option, not the default
    info = cli("info", str(reader_bundle))
    assert info.returncode == 0 and info.stdout.count("int8 prompt reader") == 2, info.stdout + info.stderr


def test_prompt_graph_reads_prompts_into_the_decode_graphs_cache(reader_bundle):
    plain, reader = _decoders(reader_bundle)
    expected = plain.prefill(PROMPT)["logits"]
    got = reader.prefill(PROMPT)["logits"]
    assert not np.array_equal(got, expected)  # other kernels: the int8 graph computed it
    assert np.corrcoef(got[0], expected[0])[0, 1] > 0.99  # the same model (a random tiny one: argmaxes tie)
    assert np.abs(got - expected).max() < 0.1 * np.abs(expected).max()
    assert reader.stats.costed == {}  # not a sample of the decode graph's cost
    assert reader.stats.prefill_calls == {len(PROMPT): 1}
    # the next token is the decode graph's pass over what the prompt graph wrote
    nxt = int(np.argmax(expected))
    a, b = plain.forward([nxt])["logits"], reader.forward([nxt])["logits"]
    assert np.corrcoef(a[0], b[0])[0, 1] > 0.99
    assert 1 in reader.stats.costed or 2 in reader.stats.costed


def test_prompt_graph_rows_do_not_depend_on_the_passes_that_carry_them(reader_bundle):
    _, whole = _decoders(reader_bundle)
    _, chunked = _decoders(reader_bundle)
    chunked.prefill_chunk = 8
    np.testing.assert_array_equal(chunked.prefill(PROMPT, 4)["logits"], whole.prefill(PROMPT, 4)["logits"])
    for a, b in zip(whole.kv.arrays, chunked.kv.arrays):
        np.testing.assert_array_equal(a[:, :, : len(PROMPT)], b[:, :, : len(PROMPT)])


def test_an_input_is_rounded_once_and_split_parts_are_matmuls_of_their_own(reader_bundle):
    """The query and the value read one rounding of their input; the gate and the up projection are two
    products written where the decode graph's Split wrote them, so nothing copies them apart."""
    manifest = read_manifest(reader_bundle)
    decode = onnx.load(str(reader_bundle / manifest["target"]["onnx"]), load_external_data=False)
    prompt = onnx.load(str(reader_bundle / manifest["target"]["prompt_reader"]["onnx"]), load_external_data=False)
    matmuls = [n for n in decode.graph.node if n.op_type == "MatMulNBits" and n.name.startswith("layers.")]
    splits = [n for n in decode.graph.node if n.op_type == "Split" and n.input[0] in {m.output[0] for m in matmuls}]
    ops = [n.op_type for n in prompt.graph.node]
    assert splits and ops.count("Split") == sum(n.op_type == "Split" for n in decode.graph.node) - len(splits)
    rounded = [n.input[0] for n in prompt.graph.node if n.op_type == "QuantizeLinear"]
    assert len(rounded) == len(set(rounded)) <= len(matmuls)
    assert ops.count("MatMulIntegerToFloat") == len(matmuls) + len(splits)
    written = {o for n in prompt.graph.node for o in n.output}
    assert all(o in written for s in splits for o in s.output)


@pytest.mark.parametrize("gamma", [1, 3, 6])
def test_greedy_speculative_equals_autoregressive_with_the_prompt_reader(reader_bundle, gamma):
    engine = Engine.from_bundle(reader_bundle, threads=1, mode="spec")
    assert engine.bundle.target.prompt_session is not None
    _, refused = greedy_drafts_kept_and_refused(engine, chain(gamma))
    assert refused > 0, "the drafter never disagreed: rollback over a prompt-graph cache not exercised"
    drafter = engine.bundle.active_drafter(chain(gamma))
    assert drafter.body.prompt_session is not None  # the drafter reads prompts through its own int8 graph
    assert drafter.body.stats.prefill_calls


def test_engine_answers_with_the_prompt_reader_and_without_it(reader_bundle):
    messages = [{"role": "user", "content": "def is_prime(n):"}]
    on = Engine.from_bundle(reader_bundle, threads=1)
    off = Engine.from_bundle(reader_bundle, threads=1, prompt_reader=False)
    assert on.bundle.target.prompt_session is not None and off.bundle.target.prompt_session is None
    spec, ar = on.complete(messages, max_new_tokens=20), on.complete(messages, max_new_tokens=20, mode="ar")
    assert spec.token_ids == ar.token_ids
    assert len(off.complete(messages, max_new_tokens=20).token_ids) > 0


def test_a_manifest_naming_a_prompt_graph_without_its_files_is_refused(reader_bundle, tmp_path):
    copy = tmp_path / "bundle"
    shutil.copytree(reader_bundle, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["target"]["files"] = [f for f in manifest["target"]["files"] if "prompt" not in f["path"]]
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(EdgeSpecError, match="no record of target/prompt.onnx"):
        read_manifest(copy)


def test_a_prompt_graph_of_another_signature_is_refused(reader_bundle, int4_bundle):
    target = read_manifest(int4_bundle)["target"]["onnx"]
    draft = read_manifest(reader_bundle)["draft"]["onnx"]
    with pytest.raises(EdgeSpecError, match="does not match"):
        Decoder(int4_bundle / target, threads=1, capacity=64, prompt_graph=reader_bundle / draft)


def test_effective_weight_adds_a_folded_correction_back_to_its_columns(tmp_path):
    """A Q4_K-like carried weight with a per-block correction, folded into extra K columns as the export
    folds it: the prompt graph's weight is the carried weight itself, within the fold's own rounding."""
    rng = np.random.default_rng(0)
    n, k, block = 24, 128, 32
    packed = rng.integers(0, 256, (n, k // block, block // 2)).astype(np.uint8)
    scales = (rng.random((n, k // block)) * 0.02 + 0.001).astype(np.float32)
    zero = rng.integers(0, 16, (n, k // block)).astype(np.uint8)
    correction = (rng.standard_normal((n, k // block)) * 0.01).astype(np.float32)
    carried = CarriedBlocks(packed, scales, zero, 4, block, "Q4_K", correction)
    graph = Graph()
    add_carried_linear(graph, "x", carried, "layers.0.o", BuildOptions("int4", block, 4, 64))
    (matmul,) = [node for node in graph.nodes if node.op_type == "MatMulNBits"]
    producers = {o: node for node in graph.nodes for o in node.output}
    model_graph = type("G", (), {"initializer": graph.initializers})()
    weight, x, chain_nodes = effective_weight(matmul, producers, _Initializers(model_graph, tmp_path))
    assert x == "x" and {node.op_type for node in chain_nodes} >= {"Concat", "ReduceSum", "Reshape"}
    exact = carried.dequantize()
    assert weight.shape == exact.shape
    # the zero points move into the correction first, which the fold rounds to 1/196 of its row's largest
    folded = correction + scales * (zero.astype(np.float32) - 8)
    step = np.abs(folded).max(axis=1, keepdims=True)
    assert (np.abs(weight - exact) <= step / 150).all()
    assert np.abs(weight - exact).max() > 0  # the fold's rounding is there: the comparison is a real one


def test_int8_rows_round_each_row_on_its_own_scale():
    weight = np.array([[1.0, -0.5, 0.25], [100.0, 50.0, -25.0], [0.0, 0.0, 0.0]], np.float32)
    codes, scales = int8_rows(weight)
    assert codes.shape == (3, 3) and codes.dtype == np.int8
    np.testing.assert_allclose(codes.T * scales[:, None], weight, rtol=0.01)
    assert codes[:, 0].tolist() == [127, -64, 32] and codes[:, 1].tolist() == [127, 64, -32]


def test_an_answer_leaves_the_cache_target_only_decoding_leaves(reader_bundle):
    """The next turn reads what the cache lacks through the prompt graph, whose rows differ from the decode
    graph's: an answer must leave the cache holding exactly what target-only decoding's leaves (the prompt
    and the answer before its last token), or a conversation's later turns part from it.  An answer that
    ends at an accepted draft of its end token (a suffix-cache draft of ``<|im_end|>``) is the case."""
    engine = Engine.from_bundle(reader_bundle, threads=1)
    target, tokenizer = engine.bundle.target, engine.bundle.tokenizer
    turn = [{"role": "user", "content": "def is_prime(n):"}]
    answer = engine.complete(turn, max_new_tokens=24, mode="ar").token_ids
    ends = tokenizer.eos_token_ids
    caches = {}
    try:
        for end in dict.fromkeys(answer[2:]):  # each answer token in turn made the end token
            tokenizer.eos_token_ids = {end}
            for mode in ("spec", "ar"):
                engine.complete(turn, max_new_tokens=24, mode=mode)
                caches[mode] = list(target.tokens)
            assert caches["spec"] == caches["ar"], f"an answer ended by {end}"
    finally:
        tokenizer.eos_token_ids = ends
