"""The native op's build cache keeps only the current build, and never one another process still uses.

A stand-in compiler (a shell script that writes its ``-o`` file) keeps these tests to file handling:
what the real compiler builds is checked by ``test_native_attention.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from edge_spec.native import build

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the native op is built on Linux only")


@pytest.fixture
def fake_compiler(monkeypatch, tmp_path):
    """A compiler whose version (so the build key) the test sets through ``$FAKE_CXX_VERSION``."""
    script = tmp_path / "fake-c++"
    script.write_text(
        textwrap.dedent(
            """\
            #!/bin/sh
            if [ "$1" = "--version" ]; then echo "fake c++ $FAKE_CXX_VERSION"; exit 0; fi
            while [ $# -gt 0 ]; do
              if [ "$1" = "-o" ]; then shift; echo library > "$1"; fi
              shift
            done
            """
        )
    )
    script.chmod(0o755)
    cache = tmp_path / "cache"
    monkeypatch.setenv("EDGE_SPEC_CACHE", str(cache))
    monkeypatch.setattr(build, "compiler", lambda: str(script))
    monkeypatch.setattr(build, "_held", {})
    yield cache / "native"
    _forget_builds()


def _forget_builds() -> None:
    """Drop this process's locks, as if the process that built so far had ended."""
    for fd in build._held.values():
        os.close(fd)
    build._held.clear()


def _build(monkeypatch, version: str):
    monkeypatch.setenv("FAKE_CXX_VERSION", version)
    return build.build()


def test_a_new_build_removes_the_stale_ones(monkeypatch, fake_compiler):
    first = _build(monkeypatch, "1")
    _forget_builds()
    second = _build(monkeypatch, "2")
    assert first.parent != second.parent and second.is_file()
    assert [p.name for p in fake_compiler.iterdir()] == [second.parent.name]
    assert _build(monkeypatch, "2") == second  # found, not built again


def test_a_build_another_process_uses_stays(monkeypatch, fake_compiler):
    first = _build(monkeypatch, "1")
    _forget_builds()
    holder = subprocess.Popen(  # another process using the first build until told to stop
        [
            sys.executable,
            "-c",
            "import sys; from pathlib import Path; from edge_spec.native import build; "
            f"build._hold(Path({str(first.parent)!r})); print('held', flush=True); sys.stdin.read()",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        second = _build(monkeypatch, "2")
        assert first.is_file() and second.is_file()
        assert build.prune(keep=second.parent) == []
    finally:
        holder.communicate("", timeout=30)
    assert build.prune(keep=second.parent) == [first.parent]
    assert not first.parent.exists()


def test_the_running_process_keeps_its_own_build(monkeypatch, fake_compiler):
    """The process that built the first library still holds it when it builds another one."""
    first = _build(monkeypatch, "1")
    second = _build(monkeypatch, "2")
    assert first.is_file() and second.is_file()
