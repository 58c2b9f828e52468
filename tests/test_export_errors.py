"""What export, add-heads and train-head say when the system refuses a write (a full disk, a read-only
or forbidden directory): one line, exit code 1, nothing left behind, the bundle that was there kept."""

from __future__ import annotations

import errno
import functools
import shutil
from pathlib import Path

import pytest

from tests.test_reliability import _cli, _export, _models


def _one_line(code, err, *fragments):
    """Exit code 1 and one ``error:`` line, after the progress lines (``- ...``) of the steps that ran."""
    lines = [line for line in err.strip().splitlines() if line.strip() and not line.startswith("- ")]
    assert code == 1 and len(lines) == 1 and lines[0].startswith("error:"), err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def _refusing_writer(code: int):
    """``save_model`` on a full disk (the write names no file) or in a forbidden directory (it does)."""
    def save_model(model, path):
        Path(path).write_bytes(b"\0" * 1000)  # half a file, as a write cut short leaves it
        if code == errno.ENOSPC:
            raise OSError(code, "No space left on device")
        raise PermissionError(code, "Permission denied", str(path))

    return save_model


REASONS = {errno.ENOSPC: "no space left on device", errno.EACCES: "permission denied"}


@pytest.fixture
def in_memory(monkeypatch, tiny_pair):
    """export and add-heads through the CLI load the tiny models from memory."""
    from edge_spec.export import bundle

    loader = _models(tiny_pair).__getitem__
    monkeypatch.setattr(bundle, "export_bundle", functools.partial(bundle.export_bundle, loader=loader))
    monkeypatch.setattr(bundle, "add_draft_heads", functools.partial(bundle.add_draft_heads, loader=loader))
    return bundle


@pytest.mark.parametrize("code, existing", [(errno.ENOSPC, True), (errno.EACCES, True), (errno.ENOSPC, False)])
def test_export_on_a_refusing_disk_is_one_line_and_keeps_the_bundle(monkeypatch, capsys, tmp_path, tiny_pair,
                                                                     in_memory, code, existing):
    from edge_spec.manifest import read_manifest, verify_files

    out = tmp_path / "bundle"
    if existing:
        _export(out, tiny_pair)
        before = (out / "manifest.json").read_text()
    monkeypatch.setattr(in_memory, "save_model", _refusing_writer(code))
    result = _cli(monkeypatch, capsys, "export", "--target", "tiny-target", "--draft", "tiny-draft", "--out",
                  str(out), "--quant", "fp32", "--context-length", "64", "--eagle", "none")
    kept = f"the existing bundle at {out} was kept" if existing else f"nothing was written to {out}"
    line = _one_line(result[0], result[2], REASONS[code], f"writing {out}", kept)
    assert ".partial" not in line  # the hidden staging directory is not what the user named
    assert sorted(p.name for p in tmp_path.iterdir()) == (["bundle"] if existing else [])
    if existing:
        assert (out / "manifest.json").read_text() == before
        verify_files(out, read_manifest(out), full_hash=True)


def test_add_heads_on_a_full_disk_is_one_line_and_keeps_the_bundle(monkeypatch, capsys, tmp_path, fp32_bundle,
                                                                     in_memory):
    from edge_spec.manifest import read_manifest, verify_files

    copy = tmp_path / "bundle"
    shutil.copytree(fp32_bundle, copy)
    before = (copy / "manifest.json").read_text()
    calibration = tmp_path / "calibration.txt"
    calibration.write_text("def f(x):\n")
    monkeypatch.setattr(in_memory, "save_model", _refusing_writer(errno.ENOSPC))
    code, _, err = _cli(monkeypatch, capsys, "add-heads", str(copy), "--draft", "tiny-draft", "--draft-vocab",
                        "trim", "--keep", "64", "--calibration", str(calibration))
    _one_line(code, err, "no space left on device", f"writing {copy}", f"the bundle at {copy} was kept as it was")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bundle", "calibration.txt"]
    assert (copy / "manifest.json").read_text() == before
    verify_files(copy, read_manifest(copy), full_hash=True)


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS, errno.EMFILE])
def test_any_other_system_error_is_one_line(monkeypatch, capsys, tmp_path, fp32_bundle, code):
    import os

    from edge_spec.export import head_data

    def collect(*args, **kwargs):
        raise OSError(code, os.strerror(code), str(tmp_path / "work" / "shards" / "0.npz"))

    monkeypatch.setattr(head_data, "collect", collect)
    result = _cli(monkeypatch, capsys, "train-head", str(fp32_bundle), "--collect-only", "--work",
                  str(tmp_path / "work"))
    _one_line(result[0], result[2], os.strerror(code).lower(), str(tmp_path / "work" / "shards" / "0.npz"))
