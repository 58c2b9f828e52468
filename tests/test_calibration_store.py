"""Shipped calibration text: an export of the same target from the same prompts uses it instead of
generating, and gets the same heads; anything else generates as before."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from edge_spec.export.heads import calibration_store, vocabtrim
from tests.helpers import export_tiny

HEADS = dict(draft_vocab="trim", keep=(64,), calibration_tokens=12)


@pytest.fixture
def shipped(tmp_path, monkeypatch):
    directory = tmp_path / "shipped"
    directory.mkdir()
    monkeypatch.setattr(calibration_store, "shipped_dir", lambda: directory)
    return directory


@pytest.fixture
def generations(monkeypatch):
    """Counts the exports that generated their calibration text."""
    calls = []
    generate = vocabtrim.generate_calibration

    def counted(*args, **kwargs):
        calls.append(args)
        return generate(*args, **kwargs)

    monkeypatch.setattr(vocabtrim, "generate_calibration", counted)
    return calls


def test_an_export_of_the_same_target_uses_the_shipped_text_and_builds_the_same_heads(
    tmp_path, tiny_pair, shipped, generations
):
    first = export_tiny(tmp_path / "first", tiny_pair, **HEADS)
    assert len(generations) == 1
    made = first / "draft" / "calibration.npz"
    assert calibration_store.stored_key(made)  # the file says what made it: it can be shipped as it is
    shutil.copy(made, shipped / "tiny.npz")

    second = export_tiny(tmp_path / "second", tiny_pair, **HEADS)
    assert len(generations) == 1  # nothing generated the second time
    assert vocabtrim.load_calibration(second / "draft" / "calibration.npz") == vocabtrim.load_calibration(made)
    for name in ("token_counts.npy", "vocab_trim-64.npy"):
        assert np.array_equal(np.load(first / "draft" / name), np.load(second / "draft" / name))


def test_text_made_otherwise_is_not_used(tmp_path, tiny_pair, shipped, generations):
    """Negative controls: text generated with other settings (here fewer tokens per prompt), a file with an
    empty key, a file from before keys and a file that is not a calibration file are all passed over."""
    first = export_tiny(tmp_path / "first", tiny_pair, **dict(HEADS, calibration_tokens=8))
    shutil.copy(first / "draft" / "calibration.npz", shipped / "other-settings.npz")
    sequences = vocabtrim.load_calibration(first / "draft" / "calibration.npz")
    vocabtrim.save_calibration(shipped / "no-key.npz", sequences)
    with np.load(first / "draft" / "calibration.npz") as made:  # the layout written before keys existed
        np.savez(shipped / "before-keys.npz", **{name: made[name] for name in made.files if name != "key"})
    (shipped / "broken.npz").write_bytes(b"not a zip file")
    assert calibration_store.stored_key(shipped / "no-key.npz") == ""
    assert calibration_store.stored_key(shipped / "before-keys.npz") is None
    assert calibration_store.stored_key(shipped / "broken.npz") is None

    export_tiny(tmp_path / "second", tiny_pair, **HEADS)
    assert len(generations) == 2 and generations[1][2] == 12  # generated, with its own setting


def test_an_export_of_the_same_gguf_in_another_layout_takes_its_text(
    tmp_path, tiny_pair, shipped, generations, monkeypatch
):
    """Two exports of one GGUF file whose target graphs differ (here: blocks of 32 against 64, as two layouts
    differ) share the text: the second takes the first's shipped file by the file it came from, and its heads
    are the first's."""
    monkeypatch.setattr(
        calibration_store, "source_digest", lambda source: "f" * 64 if source == "memory:tiny-target" else None
    )
    first = export_tiny(tmp_path / "first", tiny_pair, **HEADS)
    made = first / "draft" / "calibration.npz"
    assert calibration_store.stored_key(made, "source")  # it says which file it came from
    shutil.copy(made, shipped / "tiny.npz")
    second = export_tiny(tmp_path / "second", tiny_pair, **dict(HEADS, block_size=64))
    assert len(generations) == 1  # taken, not generated
    assert calibration_store.stored_key(second / "draft" / "calibration.npz") != calibration_store.stored_key(made)
    assert vocabtrim.load_calibration(second / "draft" / "calibration.npz") == vocabtrim.load_calibration(made)
    assert np.array_equal(
        np.load(first / "draft" / "vocab_trim-64.npy"), np.load(second / "draft" / "vocab_trim-64.npy")
    )
    # another file, or no GGUF file at all (a checkpoint): generated
    monkeypatch.setattr(calibration_store, "source_digest", lambda source: "e" * 64)
    export_tiny(tmp_path / "third", tiny_pair, **dict(HEADS, block_size=64))
    monkeypatch.setattr(calibration_store, "source_digest", lambda source: None)
    export_tiny(tmp_path / "fourth", tiny_pair, **dict(HEADS, block_size=64))
    assert len(generations) == 3


def test_a_ggufs_digest_is_its_files_and_other_sources_have_none(tmp_path):
    from edge_spec.manifest import sha256_file

    folder = tmp_path / "model"
    folder.mkdir()
    gguf = folder / "m.gguf"
    gguf.write_bytes(b"GGUF" + bytes(range(256)) * 8)
    assert calibration_store.source_digest(str(gguf)) == sha256_file(gguf)
    assert calibration_store.source_digest(str(folder)) == sha256_file(gguf)  # a folder holding one
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text("{}")
    assert calibration_store.source_digest(str(checkpoint)) is None
    assert calibration_store.source_digest(str(tmp_path / "missing.gguf")) is None
    assert calibration_store.source_digest(None) is None
    assert calibration_store.source_digest("Qwen/Not-A-Local-Model") is None  # a hub id: nothing fetched


def test_a_registry_names_digest_is_the_registrys_without_reading_a_file(monkeypatch):
    from edge_spec import fetch

    def no_fetch(*args, **kwargs):
        raise AssertionError("fetched")

    monkeypatch.setattr(fetch, "fetch_gguf", no_fetch)
    name, entry = next((n, e) for n, e in fetch.load_registry()["models"].items() if isinstance(e.get("gguf"), dict))
    assert calibration_store.source_digest(name) == entry["gguf"]["sha256"]
    assert calibration_store.source_digest("registry:" + name) == entry["gguf"]["sha256"]
