"""Writing files so that a reader (or a later run after a crash) never sees half of one."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path


def umask() -> int:
    """The process umask, read without changing it where Linux says it (``/proc/self/status``)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def new_file_mode() -> int:
    """The mode ``open`` gives a new file under the umask: what a file written another way (a temporary
    file, which is 0600, or a library that creates its files 0600) is given, so that a bundle is shared
    exactly as far as the user's umask says."""
    return 0o666 & ~umask()


def write_atomic(path: Path, write: Callable[[str], object], mode: int | None = None) -> None:
    """``write(tmp)`` a temporary file in ``path``'s directory, then rename it over ``path``; the
    temporary file is removed when ``write`` fails.  ``mode``: the file's permissions (default: those of
    a new file under the umask, not the temporary file's 0600)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        os.chmod(tmp, new_file_mode() if mode is None else mode)
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
