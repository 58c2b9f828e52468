"""Two builds of the native ops in one process: a kernel change timed against the kernel it replaces.

The runtime finds its native library through :mod:`edge_spec.native.build`; a benchmark that loads one
decoder or engine per build points that lookup at each build in turn while the sessions are made (each
session registers the library it was given, and keeps it).
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from edge_spec.native import build

ROOT = Path(__file__).resolve().parents[2]


def build_revision(revision: str, into: Path) -> Path:
    """The native library built from ``revision``'s sources (``git show``), with the runtime's own flags."""
    names = [build.SOURCE.name, *build.OTHER_SOURCES, *(f"include/{h.name}" for h in build.HEADERS)]
    for name in names:
        text = subprocess.run(
            ["git", "show", f"{revision}:edge_spec/native/{name}"], cwd=ROOT, capture_output=True, check=True
        ).stdout
        (into / name).parent.mkdir(parents=True, exist_ok=True)
        (into / name).write_bytes(text)
    library = into / "before.so"
    sources = [str(into / name) for name in [build.SOURCE.name, *build.OTHER_SOURCES]]
    subprocess.run([build.compiler(), *build.FLAGS, f"-I{into / 'include'}", "-o", str(library), *sources], check=True)
    return library


@contextmanager
def native_library(library: Path) -> Iterator[None]:
    """Sessions made inside register ``library`` as the native ops (attention and ``MatMulGGUF`` alike)."""
    chosen = build._built
    build._built = lambda: library
    try:
        yield
    finally:
        build._built = chosen
