"""Weight integrity at load: a bundle file that changed since it was last found whole is hashed again.

A file damaged in place keeps its size (a zeroed block, a bad sector, a half-finished copy over it), so
the size check every load makes cannot see it, and a damaged int4 block does not produce NaN: the model
answers, quietly wrong.  Hashing every file at every load would cost seconds each time, so each file's
SHA-256 is checked against the manifest once per change of the file on disk (its size, mtime, inode or
device), and the files found whole are remembered in the user cache (one stamp file per bundle path).

The hashing runs in a thread beside the (slower) loading of the ONNX sessions; ``hashlib`` releases the
GIL on large blocks, so the two overlap.  The engine waits for the verdict before its first answer, so
a damaged bundle refuses to answer at all.
"""

from __future__ import annotations

import hashlib
import json
import threading
from pathlib import Path

from edge_spec.errors import EdgeSpecError
from edge_spec.files import write_text_atomic
from edge_spec.manifest import ROLES, sha256_file
from edge_spec.paths import cache_root


def _identity(path: Path) -> list[int]:
    """What changes when a file is rewritten, replaced or moved: size, mtime (ns), inode, device."""
    info = path.stat()
    return [info.st_size, info.st_mtime_ns, info.st_ino, info.st_dev]


def _stamp_path(bundle_dir: Path) -> Path:
    key = hashlib.sha256(str(Path(bundle_dir).resolve()).encode()).hexdigest()[:24]
    return cache_root() / "verified" / f"{key}.json"


def _read_stamps(path: Path) -> dict:
    try:
        stamps = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return stamps if isinstance(stamps, dict) else {}


def _write_stamps(path: Path, stamps: dict) -> None:
    """A cache that cannot be written only means hashing again next time."""
    try:
        write_text_atomic(path, json.dumps(stamps))
    except OSError:
        pass


class _Stopped(Exception):
    pass


class WeightCheck:
    """Hashes the bundle's changed files in a background thread; :meth:`result` waits for the verdict."""

    def __init__(self, bundle_dir: Path, manifest: dict) -> None:
        self.bundle_dir = Path(bundle_dir)
        self._stamp_file = _stamp_path(self.bundle_dir)
        self._stamps = _read_stamps(self._stamp_file)
        self._pending: list[tuple[str, str, list[int]]] = []  # (relative path, sha256, identity)
        for role in ROLES:
            for record in (manifest.get(role) or {}).get("files", []):
                identity = _identity(self.bundle_dir / record["path"])
                if self._stamps.get(record["path"]) != [record["sha256"], identity]:
                    self._pending.append((record["path"], record["sha256"], identity))
        self._error: EdgeSpecError | None = None
        self._thread: threading.Thread | None = None
        self.total_bytes = sum(identity[0] for _, _, identity in self._pending)  # what there is to hash
        self.hashed_bytes = 0  # read so far (a load's progress reports it)
        self._stop = threading.Event()
        if self._pending:
            self._thread = threading.Thread(target=self._run, name="edge-spec weight check", daemon=True)
            self._thread.start()

    @property
    def files_to_hash(self) -> list[str]:
        return [relative for relative, _, _ in self._pending]

    def _count(self, size: int) -> None:
        if self._stop.is_set():
            raise _Stopped
        self.hashed_bytes += size

    def _run(self) -> None:
        for relative, expected, identity in self._pending:
            path = self.bundle_dir / relative
            try:
                whole = sha256_file(path, on_block=self._count) == expected
            except _Stopped:  # the files found whole so far are remembered; the rest is no verdict
                self._error = EdgeSpecError(f"the check of {self.bundle_dir}'s files was stopped before it ended")
                break
            except OSError as exc:
                self._error = EdgeSpecError(f"cannot read bundle file {path}: {exc.strerror or exc}")
                return
            if not whole:
                self._error = EdgeSpecError(
                    f"bundle file corrupted (its sha256 differs from the manifest's, its size does not): {path}; "
                    "export the bundle again (edge-spec info BUNDLE --verify checks every file)"
                )
                return
            self._stamps[relative] = [expected, identity]
        _write_stamps(self._stamp_file, self._stamps)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` seconds for the hashing to end; whether it has."""
        if self._thread is not None:
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return True

    def stop(self) -> None:
        """Stop hashing (a load given up) at the next block, and wait for the thread."""
        self._stop.set()
        self.wait()

    def result(self) -> None:
        """Wait for the check; raises :class:`EdgeSpecError` when a file is damaged."""
        if self._thread is not None:
            self._thread.join()
        if self._error is not None:
            raise self._error
