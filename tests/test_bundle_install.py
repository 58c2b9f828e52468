"""Installing a bundle at its path: a complete bundle there at every instant of the install (a process
killed or failing at any step), what killed runs leave beside it cleaned by the next run, and the
permissions a written bundle gets."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from edge_spec.errors import EdgeSpecError
from tests.test_reliability import _cli, _export, _models

STEPS = {
    "exchange": ["staged", "exchanged", "done"],
    "fallback": ["staged", "moved aside", "installed", "done"],
    "empty": ["staged", "moved draft", "moved tokenizer_config.json", "moved manifest.json", "done"],
}

# a writer that stages SOURCE beside FINAL and installs it, killing itself (SIGKILL: no clean-up) at STEP
KILLED_WRITER = """
import os, shutil, signal, sys
from pathlib import Path
from edge_spec.export.bundle import install

source, final, at, mode = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], sys.argv[4]
if mode == "fallback":
    install.exchange = lambda a, b: False
def step(name):
    if name == at:
        os.kill(os.getpid(), signal.SIGKILL)
install.install_step = step
staging = install.staging_dir(final)
shutil.copytree(source, staging, dirs_exist_ok=True)
install.install(staging, final)
"""


def _variant(bundle: Path, dest: Path, label: str) -> Path:
    """A copy of ``bundle`` whose manifest says ``label`` (the files it records are unchanged)."""
    shutil.copytree(bundle, dest)
    manifest = json.loads((dest / "manifest.json").read_text())
    manifest["created"] = label
    (dest / "manifest.json").write_text(json.dumps(manifest))
    return dest


def _which(path: Path) -> str:
    """ "old" or "new": the complete, undamaged bundle at ``path`` (fails the test when there is none)."""
    from edge_spec.manifest import read_manifest, verify_files

    manifest = read_manifest(path)
    verify_files(path, manifest, full_hash=True)
    return manifest["created"]


@pytest.fixture(scope="module")
def variants(tmp_path_factory, fp32_bundle):
    root = tmp_path_factory.mktemp("variants")
    return _variant(fp32_bundle, root / "old", "old"), _variant(fp32_bundle, root / "new", "new")


def _dead_pid() -> int:
    """The id of a process that has exited (and been reaped)."""
    child = subprocess.Popen([sys.executable, "-c", ""])
    child.wait()
    return child.pid


def _stale(final: Path, pid: int) -> list[Path]:
    """Staging directories as a writer ``pid`` killed mid-export and mid-install would leave them."""
    made = [
        final.with_name(f".{final.name}.{pid}-x1y2z3.partial"),
        final.with_name(f".{final.name}.old-{pid}-{time.time_ns()}"),
    ]
    for path in made:
        (path / "target").mkdir(parents=True)
        (path / "target" / "model.onnx").write_bytes(b"half")
    return made


# -- killed or failing at every step ----------------------------------------------------------------


@pytest.mark.parametrize("mode, step", [(mode, step) for mode, steps in STEPS.items() for step in steps])
def test_a_writer_killed_at_any_step_leaves_a_bundle_at_the_path(tmp_path, variants, mode, step):
    from edge_spec.export.bundle import install

    old, new = variants
    final = tmp_path / "out" / "bundle"
    if mode == "empty":
        final.mkdir(parents=True)
    else:
        shutil.copytree(old, final)
    killed = subprocess.run(
        [
            sys.executable,
            "-c",
            KILLED_WRITER,
            str(new),
            str(final),
            step,
            "fallback" if mode == "fallback" else "exchange",
        ],
        capture_output=True,
        text=True,
    )
    assert killed.returncode == -9, killed.stderr
    if mode == "exchange" or (mode == "fallback" and step != "moved aside"):
        assert _which(final) in ("old", "new")  # at that very instant, before any recovery
    if mode == "empty" and step not in ("moved manifest.json", "done"):
        assert not (final / "manifest.json").exists()  # never a manifest before every file is in place
    install.prepare(final)  # what the next export, add-heads or train-head does first
    left = sorted(p.name for p in final.parent.iterdir() if p.name != "bundle")
    if mode == "empty" and step == "staged":
        assert list(final.iterdir()) == []  # nothing had moved: the directory stays as it was
        assert len(left) == 1  # the staged bundle stays until a bundle is at the path
    else:
        assert _which(final) == ("old" if step == "staged" else "new")
        assert left == []


@pytest.mark.parametrize("mode, step", [(mode, step) for mode, steps in STEPS.items() for step in steps])
def test_a_failure_at_any_step_leaves_a_bundle_at_the_path(tmp_path, variants, monkeypatch, mode, step):
    from edge_spec.export.bundle import install

    old, new = variants
    final = tmp_path / "out" / "bundle"
    if mode == "empty":
        final.mkdir(parents=True)
    else:
        shutil.copytree(old, final)
    if mode == "fallback":
        monkeypatch.setattr(install, "exchange", lambda a, b: False)

    def fail(name):
        if name == step:
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(install, "install_step", fail)
    staging = install.staging_dir(final)
    shutil.copytree(new, staging, dirs_exist_ok=True)
    try:
        install.install(staging, final)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)  # as every caller does
    if mode == "empty" and step not in ("moved manifest.json", "done"):
        assert list(final.iterdir()) == []  # the entries moved so far went back
    else:
        assert _which(final) == ("old" if step in ("staged", "moved aside") else "new")
    if mode != "empty":
        assert sorted(p.name for p in final.parent.iterdir()) == ["bundle"] or step == "installed"


def test_the_exchange_is_one_step_on_this_system(tmp_path):
    from edge_spec.export.bundle import install

    if not sys.platform.startswith("linux"):
        pytest.skip("renameat2 is Linux's")
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "from_a").write_text("a")
    assert install.exchange(tmp_path / "a", tmp_path / "b")
    assert [p.name for p in (tmp_path / "b").iterdir()] == ["from_a"] and not any((tmp_path / "a").iterdir())
    with pytest.raises(FileNotFoundError):
        install.exchange(tmp_path / "a", tmp_path / "missing")


# -- what killed runs left, cleaned by the next run -------------------------------------------------


def test_the_next_export_removes_what_killed_runs_left_but_not_a_live_writers(tmp_path, tiny_pair):
    out = tmp_path / "bundle"
    _export(out, tiny_pair)
    dead = _stale(out, _dead_pid())
    live = _stale(out, os.getppid())  # a running process: perhaps still writing
    legacy = out.with_name(f".{out.name}.k3j2h1g0.partial")  # no process id: no telling
    legacy.mkdir()
    _export(out, tiny_pair)
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted(["bundle", legacy.name, *(p.name for p in live)]) and not any(p.exists() for p in dead)


def test_a_missing_bundle_beside_its_moved_aside_copy_is_restored_not_cleaned(tmp_path, variants):
    from edge_spec.export.bundle import install

    old, _ = variants
    final = tmp_path / "bundle"
    pid = _dead_pid()
    shutil.copytree(old, final.with_name(f".bundle.old-{pid}-5"))
    half = final.with_name(f".bundle.{pid}-a1b2c3.partial")  # killed before its bundle was complete
    shutil.copytree(old, half)
    (half / "target" / "model.onnx.data").write_bytes(b"")
    install.clean_stale(final)  # nothing at the path yet: the aside copy may be the only one
    assert final.with_name(f".bundle.old-{pid}-5").is_dir()
    install.prepare(final)
    assert _which(final) == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bundle"]


def test_add_heads_and_train_head_clean_up_first(monkeypatch, capsys, tmp_path, fp32_bundle):
    from edge_spec.export.bundle import build as bundle_module
    from edge_spec.train import features as head_data

    copy = tmp_path / "bundle"
    shutil.copytree(fp32_bundle, copy)

    def stop(*args, **kwargs):
        raise EdgeSpecError("stopped here")

    monkeypatch.setattr(bundle_module, "add_draft_heads", stop)
    monkeypatch.setattr(head_data, "collect", stop)
    for command in (
        ["add-heads", str(copy), "--draft-vocab", "trim"],
        ["train-head", str(copy), "--collect-only", "--work", str(tmp_path / "work")],
    ):
        dead = _stale(copy, _dead_pid())
        code, _, err = _cli(monkeypatch, capsys, *command)
        assert code == 1 and "stopped here" in err
        assert not any(p.exists() for p in dead), command


def test_commands_that_open_a_bundle_clean_what_killed_runs_left_first(monkeypatch, capsys, tmp_path, fp32_bundle):
    """info, generate (and chat, serve, bench: they find the bundle the same way) remove the staging
    directories of dead writers beside the bundle, not those of a live one."""
    copy = tmp_path / "bundle"
    shutil.copytree(fp32_bundle, copy)
    for command in (["info", str(copy)], ["generate", str(copy), "hi", "--max-tokens", "1", "--mode", "ar"]):
        dead = _stale(copy, _dead_pid())
        live = _stale(copy, os.getppid())  # a running process: perhaps still writing
        code, _, err = _cli(monkeypatch, capsys, *command)
        assert code == 0, err
        assert not any(p.exists() for p in dead) and all(p.is_dir() for p in live), command
        assert f"removed 2 staging directories left by killed runs beside {copy}" in err
        for path in live:
            shutil.rmtree(path)


def test_a_process_id_taken_by_a_later_process_does_not_keep_a_staging_directory(tmp_path):
    """A writer killed long ago whose process id a later process has (containers reuse small ids): the
    id's process started after the directory last changed, so it is not the writer."""
    from edge_spec.export.bundle import install

    final = tmp_path / "bundle"
    reused, live = (final.with_name(f".bundle.{os.getpid()}-{tag}.partial") for tag in ("x1y2z3", "a4b5c6"))
    for path in (reused, live):
        (path / "target").mkdir(parents=True)
    os.utime(reused, (0, 0))  # last changed in 1970, long before this process began
    assert install.clean_stale(final) == [reused]
    assert live.is_dir()  # this process's own, changed after it began: perhaps being written


# -- permissions ------------------------------------------------------------------------------------


@pytest.fixture
def umask():
    """Set the process umask for one test."""
    saved = os.umask(0o022)
    yield os.umask
    os.umask(saved)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_new_bundle_follows_the_umask(tmp_path, tiny_pair, umask):
    umask(0o002)
    _export(tmp_path / "shared", tiny_pair, quant="int4", draft_vocab="full,trim", keep=(64,), calibration_tokens=8)
    assert _mode(tmp_path / "shared") == 0o775
    assert _mode(tmp_path / "shared" / "target") == 0o775
    modes = {str(p.relative_to(tmp_path)): _mode(p) for p in (tmp_path / "shared").rglob("*")}
    assert any(name.endswith(".onnx.data") for name in modes)
    assert {name: mode for name, mode in modes.items() if mode not in (0o775, 0o664)} == {}


@pytest.mark.parametrize("mask", [0o002, 0o022, 0o077])
def test_graph_files_and_atomic_writes_follow_the_umask(tmp_path, umask, mask):
    """onnx writes a new external-data file 0600 whatever the umask, and a temporary file renamed into
    place is 0600 too: both would keep a bundle from the other users its directories are shared with."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from edge_spec.export.graph.builder import save_model
    from edge_spec.files import write_atomic, write_text_atomic

    umask(mask)
    weight = numpy_helper.from_array(np.ones((64, 64), np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64])],
        [weight],
    )
    save_model(helper.make_model(graph), tmp_path / "m.onnx")
    write_atomic(tmp_path / "atomic.onnx", lambda tmp: onnx.save_model(helper.make_model(graph), tmp))
    write_text_atomic(tmp_path / "text.json", "{}")
    expected = 0o666 & ~mask
    for name in ("m.onnx", "m.onnx.data", "atomic.onnx", "text.json"):
        assert _mode(tmp_path / name) == expected, name


def test_add_heads_keeps_the_bundle_directory_mode(tmp_path, tiny_pair, fp32_bundle, umask):
    from edge_spec.export.bundle.build import ExportOptions, add_draft_heads

    copy = tmp_path / "bundle"
    shutil.copytree(fp32_bundle, copy)
    copy.chmod(0o755)
    (copy / "draft").chmod(0o750)
    calibration = tmp_path / "calibration.txt"
    calibration.write_text("def f(x):\nThe quick brown fox\n")
    umask(0o077)
    add_draft_heads(
        copy,
        ExportOptions(draft_vocab="trim", keep=(64,), calibration=calibration, calibration_tokens=8),
        "tiny-draft",
        loader=_models(tiny_pair).__getitem__,
    )
    assert _mode(copy) == 0o755 and _mode(copy / "draft") == 0o750
    assert (copy / "draft" / "vocab_trim-64.npy").is_file()
