"""Putting a finished bundle directory in place, so that its path holds a complete bundle at every instant.

A bundle is built in a hidden staging directory beside its path (``.NAME.PID-XXXX.partial``, same
filesystem) and installed only once complete:

* over an existing bundle, Linux swaps the two directories in one step (``renameat2`` with
  ``RENAME_EXCHANGE``) and then deletes the old copy, now at the staging name.  Where that call is not
  available (another OS, a filesystem without it) the old bundle is renamed aside (``.NAME.old-PID-NS``)
  and the new one renamed in: a process killed between the two renames leaves no bundle at the path,
  and :func:`recover` (run by the next export, add-heads or train-head on that path) puts one back;
* into a missing path, one rename;
* into an empty directory (``--out .`` in a new directory: the shell's working directory must stay the
  same inode), its entries are moved in with ``manifest.json`` last, so the directory looks like a
  bundle only once it is one; :func:`recover` finishes a move that was cut short.

Staging names carry the writer's process id: :func:`clean_stale` (run by every command that writes or
opens the bundle) removes those of processes that are gone or that started after the directory last
changed (another process got the id), never those of a live writer, and never a complete or
moved-aside copy while the path itself holds no valid bundle.  :func:`explained_os_errors` turns a failed write into one line saying what was kept.

``install_step`` is called at each step of an install, so tests can kill or fail the install there.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from edge_spec.errors import EdgeSpecError, os_error_reason
from edge_spec.files import umask
from edge_spec.manifest import FORMAT, MANIFEST, check_manifest, verify_files

AT_FDCWD = -100
RENAME_EXCHANGE = 2
# what renameat2 answers where the kernel, the C library or the filesystem cannot exchange
_NOT_HERE = {errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV}


def _no_step(step: str) -> None:
    pass


install_step: Callable[[str], None] = _no_step


def _step(step: str) -> None:
    install_step(step)


# -- the bundle at a path ---------------------------------------------------------------------------


def is_bundle(path: Path) -> bool:
    """Whether ``path`` holds an edge-spec bundle's manifest (a stray ``manifest.json`` of another tool
    does not count)."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(manifest, dict) and manifest.get("format") == FORMAT and "target" in manifest


def is_complete(path: Path) -> bool:
    """Whether ``path`` holds a bundle whose manifest is sound and whose recorded files are all there,
    at their recorded sizes: what recovery may put at a bundle's path."""
    if not is_bundle(path):
        return False
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        check_manifest(manifest, path / MANIFEST)
        verify_files(path, manifest)
    except (EdgeSpecError, OSError, ValueError):
        return False
    return True


# -- permissions ------------------------------------------------------------------------------------


def new_directory_mode() -> int:
    """The mode ``mkdir`` would give a new directory: a new bundle is shared exactly as far as the user's
    umask says (a staging directory from ``mkdtemp`` would be 0700 whatever the umask)."""
    return 0o777 & ~umask()


# -- staging names ----------------------------------------------------------------------------------


def staging_dir(final: Path, mode: int | None = None) -> Path:
    """A new hidden directory beside ``final`` (same filesystem, so it can be renamed into place), named
    after this process so that a later run can tell whether its writer is still alive; ``mode``: its
    permissions (default: those of a new directory under the umask)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix=f".{final.name}.{os.getpid()}-", suffix=".partial", dir=final.parent))
    try:
        os.chmod(path, new_directory_mode() if mode is None else mode)
    except BaseException:
        path.rmdir()
        raise
    return path


def _as_named(filename, final: Path) -> Path:
    """A path inside a staging directory of ``final`` as the user knows it: inside ``final``."""
    if filename is None:
        return final
    path = Path(os.fsdecode(filename))
    try:
        parts = path.relative_to(final.parent).parts
    except ValueError:
        return path
    if parts and parts[0].startswith(f".{final.name}."):
        return final.joinpath(*parts[1:])
    return path


@contextmanager
def explained_os_errors(final: Path, kept: str) -> Iterator[None]:
    """Turn an operating-system error (a full disk, a forbidden or read-only directory, too many open
    files, ...) while writing the bundle at ``final`` into one line: the system's reason, the path as
    the user named it (not the hidden staging directory) and ``kept``, what is still there."""
    try:
        yield
    except OSError as exc:
        raise EdgeSpecError(f"{os_error_reason(exc)} writing {_as_named(exc.filename, final)}: {kept}") from exc


def _aside_name(final: Path) -> Path:
    return final.with_name(f".{final.name}.old-{os.getpid()}-{time.time_ns()}")


_PARTIAL = re.compile(r"(\d+)-\w+\.partial")
_OLD = re.compile(r"old-(\d+)-(\d+)")


def _leftovers(final: Path) -> list[tuple[str, int, Path]]:
    """The staging directories beside ``final``: (kind "partial" or "old", writer pid, path), oldest
    first.  Names without a process id (of no known writer) are not listed: nothing tells whether
    their writer still runs."""
    prefix = f".{final.name}."
    found = []
    try:
        entries = list(final.parent.iterdir())
    except OSError:
        return []
    for path in entries:
        if not path.name.startswith(prefix) or not path.is_dir() or path.is_symlink():
            continue
        rest = path.name[len(prefix) :]
        if match := _PARTIAL.fullmatch(rest):
            found.append(("partial", int(match.group(1)), path))
        elif match := _OLD.fullmatch(rest):
            found.append(("old", int(match.group(1)), path))
    return sorted(found, key=lambda item: _mtime(item[2]))


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


REUSE_SLACK = 3600.0  # seconds: a process started this long after a staging directory last changed is not its writer


def _writer_alive(kind: str, pid: int, path: Path) -> bool:
    """Whether the writer ``pid`` of the staging directory ``path`` may still be writing: its process
    runs, and (where this system says when it started) started before it made the directory (a staging
    directory: before it last changed; an aside copy: before the time in its name).  A process started
    later only got the id of a writer that is gone (containers reuse small ids); the slack keeps a clock
    set forward since the writer began from making a live writer look new."""
    if not _alive(pid):
        return False
    started = _started(pid)
    if started is None:
        return True
    made = _mtime(path) if kind == "partial" else int(path.name.rsplit("-", 1)[1]) / 1e9  # .NAME.old-PID-NS
    return started <= made + REUSE_SLACK


def _started(pid: int) -> float | None:
    """When process ``pid`` started (seconds since the epoch), where Linux says it; None elsewhere."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat_file:
            fields = stat_file.read().rsplit(b")", 1)[1].split()
        with open("/proc/stat", "rb") as system:
            boot = next(int(line.split()[1]) for line in system if line.startswith(b"btime "))
        return boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def _alive(pid: int) -> bool:
    """Whether process ``pid`` may still be writing (this process counts as alive: another of its threads
    may be; so does anything this system cannot tell)."""
    if pid == os.getpid():
        return True
    if os.name == "nt":  # os.kill there terminates the process
        return _alive_on_windows(pid)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # someone else's process (EPERM): alive
        return True
    return True


def _alive_on_windows(pid: int) -> bool:
    from ctypes import wintypes

    kernel32 = ctypes.WinDLL("kernel32", use_last_error=True)
    kernel32.OpenProcess.restype = wintypes.HANDLE
    kernel32.OpenProcess.argtypes = [wintypes.DWORD, wintypes.BOOL, wintypes.DWORD]
    kernel32.GetExitCodeProcess.argtypes = [wintypes.HANDLE, ctypes.POINTER(wintypes.DWORD)]
    kernel32.CloseHandle.argtypes = [wintypes.HANDLE]
    handle = kernel32.OpenProcess(0x1000, False, pid)  # PROCESS_QUERY_LIMITED_INFORMATION
    if not handle:
        return ctypes.get_last_error() != 87  # ERROR_INVALID_PARAMETER: no such process
    try:
        code = wintypes.DWORD()
        if not kernel32.GetExitCodeProcess(handle, ctypes.byref(code)):
            return True
        return code.value == 259  # STILL_ACTIVE
    finally:
        kernel32.CloseHandle(handle)


# -- exchange ---------------------------------------------------------------------------------------

_renameat2_fn = None


def _renameat2():
    """libc's ``renameat2`` (glibc 2.28+), or None where there is none."""
    global _renameat2_fn
    if _renameat2_fn is None:
        try:
            function = ctypes.CDLL(None, use_errno=True).renameat2
            function.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
            function.restype = ctypes.c_int
        except (AttributeError, OSError):
            function = False
        _renameat2_fn = function
    return _renameat2_fn or None


def exchange(a: Path, b: Path) -> bool:
    """Swap directories ``a`` and ``b`` in one atomic step; False (nothing changed) where this system or
    filesystem cannot, so the caller falls back to two renames."""
    if not sys.platform.startswith("linux"):
        return False
    function = _renameat2()
    if function is None:
        return False
    if function(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in _NOT_HERE:
        return False
    raise OSError(code, os.strerror(code), str(a), None, str(b))


# -- install ----------------------------------------------------------------------------------------


def install(staging: Path, final: Path) -> None:
    """Put the complete bundle ``staging`` at ``final`` (see the module docstring); on an exception the
    path holds what it held before or the new bundle, and ``staging`` is left for the caller to remove."""
    _step("staged")
    if final.is_dir() and not final.is_symlink() and not any(final.iterdir()):
        _move_entries(staging, final)
        return
    if not final.exists() and not final.is_symlink():
        staging.rename(final)
        _step("installed")
        return
    if exchange(staging, final):  # the old bundle is now at the staging name
        _step("exchanged")
        shutil.rmtree(staging, ignore_errors=True)
        _step("done")
        return
    old = _aside_name(final)
    final.rename(old)
    try:
        _step("moved aside")
        staging.rename(final)
    except BaseException:
        old.rename(final)
        raise
    _step("installed")
    shutil.rmtree(old, ignore_errors=True)
    _step("done")


def _move_entries(staging: Path, final: Path) -> None:
    """Move ``staging``'s entries into the empty directory ``final``, the manifest last; on an exception
    before the manifest is in, the entries already moved go back (``final`` is empty again)."""
    moved: list[str] = []
    try:
        for child in sorted(staging.iterdir(), key=lambda p: (p.name == MANIFEST, p.name)):
            child.rename(final / child.name)
            moved.append(child.name)
            _step(f"moved {child.name}")
    except BaseException:
        if MANIFEST not in moved:
            for name in moved:
                (final / name).rename(staging / name)
        raise
    staging.rmdir()
    _step("done")


# -- the next run -----------------------------------------------------------------------------------


def recover(final: Path) -> str | None:
    """Undo what a killed install left: a missing ``final`` beside a dead writer's aside copy gets the
    new bundle that writer had staged (when complete) or else the old one back; an empty-directory
    install cut short is finished.  Returns what was done (None: nothing to do)."""
    final = Path(final)
    leftovers = [item for item in _leftovers(final) if not _writer_alive(*item)]
    if not leftovers:
        return None
    if not final.exists() and not final.is_symlink():
        for kind, pid, old in reversed(leftovers):
            if kind != "old" or not is_complete(old):
                continue
            staged = [p for k, q, p in leftovers if k == "partial" and q == pid and is_complete(p)]
            source = staged[-1] if staged else old
            try:
                source.rename(final)
            except OSError:
                return None  # another run got there first, or the parent is not writable
            return "finished the interrupted install" if staged else "restored the bundle the install had moved aside"
        return None
    if final.is_dir() and not is_bundle(final):
        return _finish_move(final, [p for k, _, p in leftovers if k == "partial"])
    return None


def _finish_move(final: Path, partials: list[Path]) -> str | None:
    """Finish moving a dead writer's staged entries into ``final`` when ``final`` holds only entries of
    that bundle (moved before the writer died: it had decided to install) and the staging directory the
    rest, its manifest included."""
    present = {p.name for p in final.iterdir()}
    if not present:  # the move had not begun: the staged bundle may not have passed its checks
        return None
    for partial in reversed(partials):
        if not (partial / MANIFEST).is_file():
            continue
        staged = {p.name for p in partial.iterdir()}
        if present & staged or not present <= _top_level_names(partial):
            continue
        for name in sorted(staged, key=lambda n: (n == MANIFEST, n)):
            (partial / name).rename(final / name)
        partial.rmdir()
        if is_complete(final):
            return "finished the interrupted install"
        return None
    return None


def _top_level_names(bundle: Path) -> set[str]:
    """The first path component of every file the bundle's manifest records."""
    try:
        manifest = json.loads((bundle / MANIFEST).read_text())
    except (OSError, ValueError):
        return set()
    names: set[str] = set()

    def walk(value) -> None:
        if isinstance(value, dict):
            if isinstance(value.get("path"), str) and "bytes" in value:
                names.add(value["path"].split("/", 1)[0])
            for item in value.values():
                walk(item)
        elif isinstance(value, list):
            for item in value:
                walk(item)

    walk(manifest)
    return names


def clean_stale(final: Path) -> list[Path]:
    """Remove the staging directories of dead writers beside ``final``; aside copies and complete bundles
    only while ``final`` holds a valid bundle (until then one of them may be the only copy).  Returns
    what was removed."""
    final = Path(final)
    leftovers = [item for item in _leftovers(final) if not _writer_alive(*item)]
    unsafe = not is_complete(final)
    removed = []
    for kind, _, path in leftovers:
        if unsafe and (kind == "old" or is_complete(path)):
            continue
        shutil.rmtree(path, ignore_errors=True)
        if not path.exists():
            removed.append(path)
    return removed


def prepare(final: Path, progress: Callable[[str], None] | None = None) -> None:
    """Before writing a bundle at ``final``, and before a command opens one (info, generate, chat, serve,
    bench): recover from a killed install, then remove dead writers' staging directories (said through
    ``progress``)."""
    final = Path(final).expanduser().resolve()  # where writers put their staging directories
    if not final.name:
        return
    done = recover(final)
    if done and progress is not None:
        progress(f"{final}: {done} (a previous run was killed)")
    removed = clean_stale(final)
    if removed and progress is not None:
        progress(
            f"removed {len(removed)} staging director{'y' if len(removed) == 1 else 'ies'} "
            f"left by killed runs beside {final}"
        )
