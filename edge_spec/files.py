"""Writing files so that a reader (or a later run after a crash) never sees half of one."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path


def write_atomic(path: Path, write: Callable[[str], object]) -> None:
    """``write(tmp)`` a temporary file in ``path``'s directory, then rename it over ``path``; the
    temporary file is removed when ``write`` fails."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_text_atomic(path: Path, text: str) -> None:
    """``path`` holds ``text`` or what it held before, never a part of it (its directory is created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, lambda tmp: Path(tmp).write_text(text))
