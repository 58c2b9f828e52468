"""A bundle file damaged in place (same size, different bytes) is caught at load, before any answer;
a bundle unchanged since it was last found whole is not hashed again."""

from __future__ import annotations

import os
import shutil

import pytest

from edge_spec.errors import EdgeSpecError
from edge_spec.manifest import read_manifest
from edge_spec.runtime.engine import Engine


@pytest.fixture()
def bundle(int4_bundle, tmp_path, monkeypatch):
    monkeypatch.setenv("EDGE_SPEC_CACHE", str(tmp_path / "cache"))
    copy = tmp_path / "bundle"
    shutil.copytree(int4_bundle, copy)
    return copy


def weights_file(bundle):
    records = read_manifest(bundle)["target"]["files"]
    return bundle / max(records, key=lambda r: r["bytes"])["path"]


def zero_block(path, size=1024):
    with open(path, "r+b") as fh:
        fh.seek(os.path.getsize(path) // 2)
        fh.write(b"\0" * size)


def test_a_block_zeroed_inside_the_weights_is_refused_before_any_answer(bundle):
    path = weights_file(bundle)
    before = path.stat().st_size
    zero_block(path)
    assert path.stat().st_size == before  # the cheap size check cannot see it
    engine = Engine.from_bundle(bundle, threads=1, mode="ar")
    with pytest.raises(EdgeSpecError, match="corrupted.*" + path.name):
        engine.complete("hello", max_new_tokens=4)


def test_a_whole_bundle_answers_and_is_hashed_once(bundle):
    first = Engine.from_bundle(bundle, threads=1, mode="ar")
    assert first.bundle.weight_check.files_to_hash  # never seen: every recorded file
    assert first.complete("hello", max_new_tokens=4).token_ids
    second = Engine.from_bundle(bundle, threads=1, mode="ar")
    assert second.bundle.weight_check.files_to_hash == []  # unchanged since found whole: nothing to hash
    path = weights_file(bundle)
    os.utime(path)  # rewritten (here: touched): hashed again, that file alone
    third = Engine.from_bundle(bundle, threads=1, mode="ar")
    assert third.bundle.weight_check.files_to_hash == [str(path.relative_to(bundle))]
    assert third.complete("hello", max_new_tokens=4).token_ids


def test_damage_after_a_clean_check_is_still_caught(bundle):
    """Negative control for the stamps: a file changed after it was stamped is hashed again."""
    Engine.from_bundle(bundle, threads=1, mode="ar").complete("hello", max_new_tokens=2)
    zero_block(weights_file(bundle))
    with pytest.raises(EdgeSpecError, match="corrupted"):
        Engine.from_bundle(bundle, threads=1, mode="ar").complete("hello", max_new_tokens=2)
