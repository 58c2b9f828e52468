"""A target graph that pads its own attention (``export.graph.attention_pad``), and the per-device check that
decides whether its one-token passes are exact (``runtime.model.row_invariance``).

The pad serves ONNX Runtime's attention op, so these tests run on it; on edge-spec's native op the runtime
loads the target without the pad (``tests/test_native_attention.py``)."""

from __future__ import annotations

import dataclasses
import io
import json

import numpy as np
import onnx
import pytest

from edge_spec.errors import EdgeSpecError
from edge_spec.export.graph.attention_pad import has_attention_pad, pad_attention, pad_bundle_target
from edge_spec.export.graph.builder import BuildOptions, build_decoder, save_model
from edge_spec.manifest import read_manifest, verify_files
from edge_spec.runtime.engine import Engine
from edge_spec.runtime.model import row_invariance
from edge_spec.runtime.model.attention_unpad import strip_attention_pad
from edge_spec.runtime.model.decoder import Decoder
from edge_spec.runtime.model.row_invariance import one_row_passes_match, padded_passes_match
from tests import tiny_models

CAPACITY = 48


@pytest.fixture(autouse=True)
def orts_attention(monkeypatch):
    monkeypatch.setenv("EDGE_SPEC_NATIVE_ATTENTION", "0")


@pytest.fixture(scope="module")
def graphs(tmp_path_factory):
    """The same tiny int4 target built twice: attention padded by the graph, and not."""
    weights = tiny_models.loaded(
        "target", tiny_models.make_qwen2(seed=3, layers=3), tiny_models.make_tokenizer()
    ).weights
    options = BuildOptions("int4", context_length=CAPACITY, tree_attention=True)
    root = tmp_path_factory.mktemp("pad")
    paths = {}
    for name, pad in (("plain", False), ("padded", True)):
        (root / name).mkdir()
        paths[name] = root / name / "model.onnx"
        save_model(build_decoder(weights, dataclasses.replace(options, attention_pad=pad)), paths[name])
    return paths


def logits(decoder: Decoder, chunks: list[list[int]]) -> np.ndarray:
    decoder.reset()
    return np.concatenate([decoder.forward(chunk, len(chunk))["logits"] for chunk in chunks])


def test_padding_the_attention_changes_no_multi_row_pass(graphs):
    """With two or more rows a pass is row-invariant already: the graph's own pad row changes nothing."""
    plain, padded = (Decoder(graphs[name], threads=1, capacity=CAPACITY, min_rows=2) for name in ("plain", "padded"))
    assert padded.pads_attention and not plain.pads_attention
    chunks = [[5, 17, 42, 99, 7, 3], [11, 12], [301], [77, 8, 8], [140]]  # one-row passes padded by min_rows
    assert np.array_equal(logits(plain, chunks), logits(padded, chunks))


def test_the_padded_graph_keeps_a_spare_slot_so_the_context_still_fills(graphs):
    decoder = Decoder(graphs["padded"], threads=1, capacity=8)
    decoder.forward([5, 17, 42, 99, 7, 3, 250], 1)
    assert decoder.forward([11], 1)["logits"].shape == (1, decoder.vocab_size)  # the pad row's keys: slot 8
    assert decoder.length == decoder.capacity


def test_one_row_passes_of_the_padded_graph_match_where_its_matmuls_are_row_invariant(graphs):
    """Whatever this CPU's kernels are, the check reports what a direct comparison finds, and an
    unpadded graph (attention's one-query path) is never reported row-invariant by it alone."""
    padded = Decoder(graphs["padded"], threads=1, capacity=CAPACITY)
    sequence = [[5, 17, 42, 99, 7, 3], [11], [12], [301], [77]]
    direct = np.array_equal(logits(padded, sequence), logits(padded, [sequence[0], [11, 12, 301, 77]]))
    held = list(padded.tokens)
    following = padded.forward([9], 1)["logits"]
    padded.rewind(len(held))
    calls = dict(padded.stats.calls)
    assert one_row_passes_match(padded, lengths=(6, 30), tokens=4) == direct
    assert padded.min_rows == 1 and padded.tokens == held  # restored, and the cache holds what it held
    assert padded.stats.calls == calls  # the probe's passes are not counted as the decoder's own
    assert np.array_equal(padded.forward([9], 1)["logits"], following)  # its keys and values untouched


def test_a_long_probe_cache_repeats_the_computed_positions(graphs, monkeypatch):
    """Past ``COMPUTED`` positions a host cache is filled with copies of the computed keys and values, not
    prefilled, and a longer probe's cache starts with a shorter one's; the verdict is still the direct
    comparison's, and a one-row path that rounds differently is still caught after such a cache."""
    monkeypatch.setattr(row_invariance, "COMPUTED", 8)
    padded = Decoder(graphs["padded"], threads=1, capacity=CAPACITY)
    padded.forward([5, 17, 42], 3)
    row_invariance._seed_cache(padded, 3, list(range(100, 120)))
    assert padded.tokens == [5, 17, 42] + [100 + i % 8 for i in range(20)]
    assert padded.stats.calls == {3: 1, 8: 1}  # only the first 8 positions went through the model
    for array in padded.kv.arrays:
        assert np.array_equal(array[:, :, 11:19], array[:, :, 3:11]) and array[:, :, 3:11].any()

    sequence = [[5, 17, 42, 99, 7, 3], [11], [12], [301], [77]]
    direct = np.array_equal(logits(padded, sequence), logits(padded, [sequence[0], [11, 12, 301, 77]]))
    passes = []
    forward = padded.forward
    monkeypatch.setattr(
        padded, "forward", lambda ids, *args, **kw: passes.append(len(ids)) or forward(ids, *args, **kw)
    )
    padded.reset()
    assert one_row_passes_match(padded, lengths=(6, 30), tokens=4) == direct
    # one pass seeds both caches (the 30-position one is the 6-position one's, copied on); then each probe's
    # cuts, or, where this CPU's one-row kernels round differently (AVX2), the first probe's reference and
    # its one-row cut, which already decide
    expected = [6] + [4, 1, 1, 1, 1, 2, 2] * 2 if direct else [6, 4, 1, 1, 1, 1]
    assert sorted(passes) == sorted(expected)
    assert not one_row_passes_match(PerturbedOneRow(padded), lengths=(30,), tokens=3)


class PerturbedOneRow:
    """A decoder whose one-row passes round differently (the negative control of the check)."""

    def __init__(self, decoder: Decoder) -> None:
        self.inner = decoder

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def forward(self, ids, num_logits: int = 1, **kw):
        out = self.inner.forward(ids, num_logits, **kw)
        if len(ids) == 1 and self.inner.min_rows == 1:
            out = dict(out, logits=np.nextafter(out["logits"], np.inf))
        return out


def test_a_one_row_path_that_rounds_differently_is_caught(graphs):
    padded = Decoder(graphs["padded"], threads=1, capacity=CAPACITY)
    assert not one_row_passes_match(PerturbedOneRow(padded), lengths=(6,), tokens=3)


def test_the_exported_target_pads_its_attention(target_path):
    assert has_attention_pad(onnx.load(str(target_path), load_external_data=False))
    assert Decoder(target_path, threads=1, capacity=16).pads_attention


def test_the_engine_pads_one_row_passes_only_where_the_check_failed(int4_bundle, monkeypatch):
    """exact_rows is 1 exactly when the check passed; its answer is cached per device, so a second
    engine does not check again; greedy speculative output equals ar --exact either way, and plain ar
    where the check passed."""
    engine = Engine.from_bundle(int4_bundle, threads=1, mode="spec", draft_head="trim-64")
    expected = 1 if one_row_passes_match(engine.bundle.target) else 2
    assert engine.bundle.exact_rows() == expected
    reference = engine.complete("def is_prime", max_new_tokens=20, mode="ar", exact=True).token_ids
    assert engine.bundle.target.min_rows == expected
    assert engine.complete("def is_prime", max_new_tokens=20).token_ids == reference
    assert engine.bundle.target.min_rows == 2  # speculative passes keep a second row for the free guess
    if expected == 1:  # then plain one-row decoding is that same answer too
        assert engine.complete("def is_prime", max_new_tokens=20, mode="ar").token_ids == reference

    def no_second_check(decoder):
        raise AssertionError("checked again although the answer is cached")

    monkeypatch.setattr("edge_spec.runtime.loaded.one_row_passes_match", no_second_check)
    assert Engine.from_bundle(int4_bundle, threads=1, mode="spec", draft_head="trim-64").bundle.exact_rows() == expected


def test_a_failed_check_keeps_the_pad_row(int4_bundle, monkeypatch, tmp_path):
    monkeypatch.setenv("EDGE_SPEC_CACHE", str(tmp_path))  # a device not seen before
    monkeypatch.setattr("edge_spec.runtime.loaded.one_row_passes_match", lambda decoder: False)
    engine = Engine.from_bundle(int4_bundle, threads=1, mode="spec", draft_head="trim-64")
    assert engine.bundle.exact_rows() == 2
    reference = engine.complete("def f", max_new_tokens=16, mode="ar", exact=True).token_ids
    assert engine.bundle.target.min_rows == 2
    assert engine.complete("def f", max_new_tokens=16).token_ids == reference
    # and the next load keeps the graph's own pad: without it one-row logits part further from multi-row ones
    assert Engine.from_bundle(int4_bundle, threads=1, mode="spec", draft_head="trim-64").bundle.target.pads_attention


def test_an_older_bundle_gets_the_pad_in_place(int4_bundle, tmp_path):
    """A bundle whose target graph lacks the pad is rewritten (graph only) and its manifest updated,
    so that the bundle still verifies; a second call changes nothing."""
    import shutil

    bundle = tmp_path / "old"
    shutil.copytree(int4_bundle, bundle)
    graph = bundle / read_manifest(bundle)["target"]["onnx"]
    model = onnx.load(str(graph), load_external_data=False)
    unpadded = strip_attention_pad(model)
    onnx.save_model(unpadded, str(graph))
    assert not Decoder(graph, threads=1, capacity=16).pads_attention
    assert pad_bundle_target(bundle) and not pad_bundle_target(bundle)
    manifest = read_manifest(bundle)
    verify_files(bundle, manifest, full_hash=True)
    assert Decoder(graph, threads=1, capacity=16).pads_attention
    assert json.loads((bundle / "manifest.json").read_text())["target"]["bytes"] == manifest["target"]["bytes"]


def test_only_a_target_graph_with_tree_inputs_is_padded(graphs):
    model = onnx.load(str(graphs["plain"]), load_external_data=False)
    assert not has_attention_pad(model)
    twice = pad_attention(pad_attention(model))
    assert sum(n.op_type == "GroupQueryAttention" for n in twice.graph.node) == 3
    assert sum(n.name.endswith("/cut") for n in twice.graph.node) == 3  # padded once, not twice
    assert sum(n.op_type == "Concat" and n.output[0].startswith("attention_pad/rotary") for n in twice.graph.node) == 2
    model = onnx.load(str(graphs["plain"]), load_external_data=False)
    model.graph.input.remove(next(i for i in model.graph.input if i.name == "position_ids"))
    with pytest.raises(Exception, match="tree-attention inputs"):
        pad_attention(model)


class PassSizeDependent(PerturbedOneRow):
    """A decoder whose rows round differently in passes of three tokens, as a GPU EP's kernels were found
    to (the negative control of the padded-pass check)."""

    def forward(self, ids, num_logits: int = 1, **kw):
        out = self.inner.forward(ids, num_logits, **kw)
        return dict(out, logits=np.nextafter(out["logits"], np.inf)) if len(ids) == 3 else out


def test_the_padded_pass_check_passes_on_the_cpu_and_catches_a_pass_size_dependence(graphs):
    padded = Decoder(graphs["padded"], threads=1, capacity=CAPACITY)
    assert padded_passes_match(padded, 2)  # the CPU EP's passes of two rows and more are batch-invariant
    assert padded.min_rows == 1 and padded.length == 0  # restored, and the cache left empty
    assert not padded_passes_match(PassSizeDependent(padded), 2)


def test_where_padded_passes_differ_exact_is_refused_and_greedy_runs_unpadded(int4_bundle, monkeypatch, tmp_path):
    monkeypatch.setenv("EDGE_SPEC_CACHE", str(tmp_path))  # a device not seen before
    monkeypatch.setattr("edge_spec.runtime.loaded.padded_passes_match", lambda decoder, rows: False)
    engine = Engine.from_bundle(int4_bundle, threads=1, mode="spec", draft_head="trim-64")
    engine.complete("def f", max_new_tokens=8)
    assert engine.bundle.target.min_rows == 2  # before the check's verdict (it follows the first answer): padded
    assert engine.bundle.exact_available(check=False) is False
    engine.complete("def f", max_new_tokens=8)
    assert engine.bundle.target.min_rows == 1  # a pad would buy nothing here, only cost
    for mode in ("ar", "spec"):
        with pytest.raises(EdgeSpecError, match="exact decoding is not available on cpu here"):
            engine.complete("def f", max_new_tokens=8, mode=mode, exact=True)


def test_the_engine_checks_padded_passes_once_per_device(int4_bundle, monkeypatch, tmp_path):
    monkeypatch.setenv("EDGE_SPEC_CACHE", str(tmp_path))
    calls = []
    monkeypatch.setattr(
        "edge_spec.runtime.loaded.padded_passes_match", lambda decoder, rows: calls.append(rows) or True
    )
    for _ in range(2):
        engine = Engine.from_bundle(int4_bundle, threads=1, mode="spec", draft_head="trim-64")
        reference = engine.complete("def f", max_new_tokens=12, mode="ar", exact=True).token_ids
        assert engine.complete("def f", max_new_tokens=12).token_ids == reference
    assert calls == [engine.bundle.exact_rows()]


def test_the_command_line_refuses_exact_at_load_where_padded_passes_differ(int4_bundle, monkeypatch, tmp_path, capsys):
    """A chat or a server started with --exact is refused before its first request, in one line."""
    from edge_spec import cli

    monkeypatch.setenv("EDGE_SPEC_CACHE", str(tmp_path))
    monkeypatch.setattr("edge_spec.runtime.loaded.padded_passes_match", lambda decoder, rows: False)
    monkeypatch.setattr("sys.stdin", io.StringIO(""))  # a chat that would end without a request
    monkeypatch.setattr("sys.argv", ["edge-spec", "chat", str(int4_bundle), "--exact", "--threads", "1"])
    with pytest.raises(SystemExit) as stopped:
        cli.main()
    assert stopped.value.code == 1
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("error: exact decoding is not available on cpu here")


def _structure(model: onnx.ModelProto) -> list:
    return [
        (n.op_type, list(n.input), list(n.output), [a.SerializeToString() for a in n.attribute])
        for n in model.graph.node
    ]


def test_stripping_the_pad_gives_back_the_graph_built_without_it(graphs):
    plain = onnx.load(str(graphs["plain"]), load_external_data=False)
    stripped = strip_attention_pad(onnx.load(str(graphs["padded"]), load_external_data=False))
    assert _structure(stripped) == _structure(plain)
    assert sorted(t.name for t in stripped.graph.initializer) == sorted(t.name for t in plain.graph.initializer)
    assert not has_attention_pad(stripped)
    assert _structure(strip_attention_pad(plain)) == _structure(
        onnx.load(str(graphs["plain"]), load_external_data=False)
    )


def test_a_target_loaded_without_its_pad_computes_as_the_graph_built_without_it(graphs):
    """One-row passes included, bit for bit: the same graph, its weights read from the padded file's folder."""
    plain = Decoder(graphs["plain"], threads=1, capacity=CAPACITY)
    stripped = Decoder(graphs["padded"], threads=1, capacity=CAPACITY, attention_pad=False)
    assert stripped.attention_pad_removed and not stripped.pads_attention
    assert not plain.attention_pad_removed
    chunks = [[5, 17, 42, 99, 7, 3], [11], [12, 301], [77], [140, 8, 8]]
    assert np.array_equal(logits(plain, chunks), logits(stripped, chunks))
