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
