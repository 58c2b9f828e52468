"""The project's own checks, run with the suite so CI runs them: lint and format (ruff, configured in
pyproject.toml) and one-way imports inside the runtime (tools/import_layers.py)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run(*command: str) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)


@pytest.mark.skipif(shutil.which("ruff") is None, reason="ruff is in the test extra: pip install -e '.[test]'")
@pytest.mark.parametrize("command", [("ruff", "check", "."), ("ruff", "format", "--check", ".")])
def test_ruff(command):
    result = run(*command)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]


def test_runtime_imports_run_one_way():
    result = run(sys.executable, "tools/import_layers.py")
    assert result.returncode == 0, result.stdout[-3000:]
