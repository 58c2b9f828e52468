"""The EAGLE head's switchable LM heads (full, VocabTrim, SpecVocab over its draft vocabulary): every one
keeps greedy output equal to target-only decoding and sampling on the target's distribution; the manifest
records them; bad names are one-line errors; a bundle whose head is one graph (made before the split)
still loads, and add-heads splits it."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from edge_spec.errors import EdgeSpecError
from edge_spec.runtime.engine import Engine
from edge_spec.runtime.loops.config import loop_config
from tests.helpers import (
    PROMPTS,
    assert_one_line_error,
    cli,
    eagle,
    export_tiny,
    greedy_matches_target_only,
    random_head,
    sampled_matches_target,
    tiny_head_config,
)

CONFIG = tiny_head_config(feature_layers=(0, 1, 1), draft_vocab_size=256)  # the tiny target has 2 layers
TRIM, SPECVOCAB = "trim-128", "specvocab-r16-k48-of256"


@pytest.fixture(scope="module")
def heads_bundle(tmp_path_factory, tiny_pair):
    from edge_spec.export.eagle.attach import attach_eagle_head
    from edge_spec.export.eagle.lm_heads import EagleHeadOptions

    bundle = export_tiny(tmp_path_factory.mktemp("eagle-heads") / "int4", tiny_pair, quant="int4")
    variants = EagleHeadOptions(trim=(128,), specvocab=((16, 48),), calibration_tokens=24)
    attach_eagle_head(bundle, CONFIG, random_head(seed=5, config=CONFIG), variants=variants)
    return bundle


@pytest.fixture(scope="module")
def engine(heads_bundle):
    return Engine.from_bundle(heads_bundle, threads=1, config=loop_config("spec", drafter="eagle"), exact=True)


def greedy_equals_target_only(engine, gamma: int, prompts=PROMPTS[:2]) -> int:
    return greedy_matches_target_only(engine, eagle(gamma), prompts, n=32)


@pytest.mark.parametrize("head", ["full", TRIM, SPECVOCAB])
@pytest.mark.parametrize("gamma", [1, 2, 3])
def test_greedy_equals_target_only_with_every_eagle_head(engine, head, gamma):
    engine.use_eagle_head(head)
    assert greedy_equals_target_only(engine, gamma) > 0, "the head never drafted"


def test_the_heads_draw_on_the_draft_vocabulary_only(engine, heads_bundle):
    from edge_spec.runtime.propose.heads import DraftHead, SpecVocabHead

    d2t = np.load(heads_bundle / "eagle" / "d2t.npy")
    draft_ids = np.arange(len(d2t)) + d2t
    engine.use_eagle_head(TRIM)
    trim = engine.bundle.eagle.lm_head
    assert isinstance(trim, DraftHead) and trim.rows == 128 and np.isin(trim.vocab_ids, draft_ids).all()
    engine.use_eagle_head(SPECVOCAB)
    head = engine.bundle.eagle.lm_head
    assert isinstance(head, SpecVocabHead) and head.rows.shape == (256, 64)
    logits, ids = head(np.random.default_rng(0).standard_normal(64).astype(np.float32))
    assert len(ids) == len(logits) == 48 + head.always.size and np.isin(ids, draft_ids).all()
    assert len(set(ids.tolist())) == len(ids)
    steps = head.seconds
    engine.bundle.eagle.profile_fill(4)
    layer, lm = engine.bundle.eagle.profile_step()
    assert layer > 0 and lm > 0 and head.seconds > steps  # a draft step's cost includes its LM head


@pytest.mark.slow
def test_sampled_specvocab_eagle_matches_target_distribution(engine):
    engine.use_eagle_head(SPECVOCAB)
    sampled_matches_target(engine, eagle(2))


def test_the_manifest_records_the_heads_and_their_files(heads_bundle):
    from edge_spec.manifest import check_manifest, eagle_heads, read_manifest, verify_files

    manifest = read_manifest(heads_bundle)
    verify_files(heads_bundle, manifest, full_hash=True)
    entry = manifest["eagle"]
    assert set(entry["heads"]) == {"full", TRIM, SPECVOCAB} and entry["default_head"] == "full"
    assert eagle_heads(manifest) == entry["heads"]
    recorded = {f["path"] for f in entry["files"]}
    on_disk = {p.relative_to(heads_bundle).as_posix() for p in (heads_bundle / "eagle").rglob("*") if p.is_file()}
    assert recorded == on_disk
    for head in entry["heads"].values():
        for key in ("onnx", "vocab_ids", "rows", "scales", "always_ids", "universe"):
            if head.get(key):
                assert head[key] in recorded
    spec = entry["heads"][SPECVOCAB]
    assert spec["kind"] == "specvocab" and spec["rows_by"] == "universe" and spec["scorer"] == "data"
    assert 0 <= spec["calibration_recall"] <= 1 and entry["heads"][TRIM]["size"] == 128
    broken = json.loads(json.dumps(manifest))
    broken["eagle"]["default_head"] = "nope"
    with pytest.raises(EdgeSpecError, match="eagle.default_head 'nope' is not one of its heads"):
        check_manifest(broken)


def test_a_bad_eagle_head_name_is_one_clear_error(heads_bundle, engine):
    with pytest.raises(EdgeSpecError, match="no EAGLE head 'trim-7'; available: full, trim-128"):
        Engine.from_bundle(heads_bundle, threads=1, eagle_head="trim-7")
    with pytest.raises(EdgeSpecError, match="no EAGLE head 'nope'"):
        engine.use_eagle_head("nope")
    result = cli("generate", str(heads_bundle), "hi", "--drafter", "eagle", "--eagle-head", "nope", "--threads", "1")
    assert_one_line_error(result, "no EAGLE head 'nope'")


def test_bench_runs_one_mode_per_eagle_head(engine):
    from edge_spec.bench.runs import modes_for

    modes = modes_for(engine, ["full"], loop_config("spec", drafter="model"), [2], drafters={"eagle": ["full", TRIM]})
    names = {m.name: m.drafter_head for m in modes}
    assert names["eagle"] == "full" and names[f"eagle+{TRIM}@γ2"] == TRIM and names["spec"] is None
    assert {m.name for m in modes_for(engine, ["full"], loop_config("spec"), drafters={"eagle": None})} >= {"eagle"}
    with pytest.raises(EdgeSpecError, match="no EAGLE head 'x'"):
        modes_for(engine, ["full"], loop_config("spec"), drafters={"eagle": ["x"]})


def make_single_graph(bundle, config, head) -> None:
    """Rewrite ``bundle``'s EAGLE head as bundles before the split held it: one graph with ``logits``."""
    from edge_spec.export.eagle.attach import LEGACY_EAGLE_FILES
    from edge_spec.export.eagle.model import build_eagle_head, eagle_head_weights
    from edge_spec.export.graph.builder import BuildOptions, save_model
    from edge_spec.manifest import file_record, read_manifest, write_manifest

    manifest = read_manifest(bundle)
    quant = manifest["target"]["quantization"]
    options = BuildOptions(quant["weights"], quant["block_size"], quant["accuracy_level"], manifest["context_length"])
    for path in list((bundle / "eagle").iterdir()):
        if path.name not in LEGACY_EAGLE_FILES:
            path.unlink()
    save_model(build_eagle_head(eagle_head_weights(head), options, logits=True), bundle / "eagle" / "head.onnx")
    entry = manifest["eagle"]
    for key in ("heads", "default_head"):
        del entry[key]
    entry["onnx"] = "eagle/head.onnx"
    entry["files"] = [file_record(bundle, f"eagle/{name}") for name in LEGACY_EAGLE_FILES]
    entry["bytes"] = sum(f["bytes"] for f in entry["files"])
    write_manifest(bundle, manifest)


def test_a_single_graph_head_still_drafts_and_add_heads_splits_it(heads_bundle, tmp_path):
    from edge_spec.manifest import read_manifest, verify_files

    old = tmp_path / "old"
    shutil.copytree(heads_bundle, old)
    make_single_graph(old, CONFIG, random_head(seed=5, config=CONFIG))
    engine = Engine.from_bundle(old, threads=1, config=loop_config("spec", drafter="eagle"), exact=True)
    assert engine.bundle.eagle_head == "full" and engine.bundle.eagle.lm_head is None
    with pytest.raises(EdgeSpecError, match="no EAGLE head 'trim-128'; available: full"):
        engine.use_eagle_head("trim-128")
    assert greedy_equals_target_only(engine, 3, PROMPTS[:1]) > 0
    info = cli("info", str(old))
    assert info.returncode == 0 and "single graph" in info.stdout, info.stderr

    result = cli("add-heads", str(old), "--eagle-trim", "64", "--eagle-specvocab", "8:32")
    assert result.returncode == 0, result.stderr
    assert "upgrading the bundle's EAGLE head" in result.stderr
    manifest = read_manifest(old)
    verify_files(old, manifest, full_hash=True)
    assert set(manifest["eagle"]["heads"]) == {"full", "trim-64", "specvocab-r8-k32-of256"}
    assert manifest["eagle"]["onnx"] == "eagle/layer.onnx" and not (old / "eagle" / "head.onnx").exists()
    assert set(manifest["draft"]["heads"]) == {"full"}  # the drafter's heads are left alone
    assert not (old / "eagle.partial").exists() and not (old / "eagle.old").exists()
    for head in ("full", "trim-64", "specvocab-r8-k32-of256"):
        engine = Engine.from_bundle(
            old, threads=1, config=loop_config("spec", drafter="eagle"), exact=True, eagle_head=head
        )
        assert greedy_equals_target_only(engine, 2, PROMPTS[:1]) > 0
    info = cli("info", str(old))
    assert "trim-64 (64 rows)" in info.stdout and "single graph" not in info.stdout


def test_a_saved_head_keeps_what_its_kept_heads_read_and_nothing_else(heads_bundle, tmp_path):
    """Saving some LM heads copies the files those heads name (a SpecVocab head's scorer and int8 rows)
    and leaves out what only the others need."""
    from edge_spec.export.eagle.attach import save_eagle_files

    full = {p.name for p in save_eagle_files(heads_bundle, tmp_path / "full", heads=("full",)).iterdir()}
    assert not any(name.startswith(("scorer_", "head_rows", "always_", f"head_{TRIM}")) for name in full)
    kept = {p.name for p in save_eagle_files(heads_bundle, tmp_path / "sv", heads=("full", SPECVOCAB)).iterdir()}
    entry = json.loads((heads_bundle / "manifest.json").read_text())["eagle"]["heads"][SPECVOCAB]
    for key in ("onnx", "rows", "scales", "always_ids"):
        assert entry[key].removeprefix("eagle/") in kept
    assert entry["onnx"].removeprefix("eagle/") + ".data" in kept and f"head_{TRIM}.onnx" not in kept
