"""Build the native ops (``attention.cc``, ``gguf_matmul.cc``) once per machine, into edge-spec's user cache.

The library is compiled at first use with the system C++ compiler and kept under
``cache_root()/native/<hash>/``, the hash covering the sources, the compiler's version and the flags, so an
edited source or another compiler builds anew and a cache copied between machines is never stale.  It is
built for generic x86-64 (no ``-march=native``): its AVX2 kernels are chosen at run time, so a cache or a
frozen build moved to an older CPU still loads and runs the scalar kernels.

Without a compiler, or when the build fails, :func:`library_path` says why once (at debug level) and
returns None: the runtime then keeps ORT's own ``GroupQueryAttention``, and loads a native-layout bundle's
``MatMulGGUF`` nodes in the lean layout's form (``runtime/model/native_attention.py``).

Only the current build is kept: a new one removes the others (a library is 60-80 KiB, but every edit of the
source or compiler update adds one).  A process that uses a build holds a shared lock on its folder's
``.in-use`` file for its lifetime (a session opened later registers the library again from its path), and
a folder is removed only under an exclusive lock, so a build another process still uses, or is still
compiling, stays.

    python -m edge_spec.native.build        # build now (CI does, after installing), remove stale builds
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from functools import cache
from pathlib import Path

from edge_spec.paths import cache_root

log = logging.getLogger(__name__)

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "attention.cc"  # registers the library's ops, the others' among them
OTHER_SOURCES = ["gguf_matmul.cc"]  # beside SOURCE
HEADERS = sorted((HERE / "include").glob("*.h"))
FLAGS = ["-O3", "-std=c++17", "-shared", "-fPIC", "-fvisibility=hidden", "-fno-math-errno"]
LIBRARY = "libedge_spec_attention.so"
SWITCH = "EDGE_SPEC_NATIVE_ATTENTION"  # "0": never build nor use the native op
IN_USE = ".in-use"  # in each build's folder: shared-locked by every process that uses that build
_held: dict[Path, int] = {}  # build folder -> the descriptor of this process's lock on it (kept until exit)


class BuildError(RuntimeError):
    """The library could not be built here (no compiler, a compiler error)."""


def compiler() -> str | None:
    """The C++ compiler to use: ``$CXX``, else g++, else clang++ (None: none found)."""
    for name in (os.environ.get("CXX"), "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _compiler_version(cxx: str) -> str:
    try:
        return subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def _sources() -> list[Path]:
    return [SOURCE, *(SOURCE.with_name(name) for name in OTHER_SOURCES)]


def _hashed_sources() -> "hashlib._Hash":
    """A sha256 over the native ops' sources and headers, by name and bytes (a missing file: no bytes)."""
    digest = hashlib.sha256()
    for path in [*_sources(), *HEADERS]:
        digest.update(path.name.encode())
        digest.update(path.read_bytes() if path.is_file() else b"")
    return digest


@cache
def sources_digest() -> str:
    """The native ops' code (sources and headers) as a digest.  What the runtime measures of them (cost
    profiles, checks of their arithmetic) is kept under keys that include it: a new kernel is measured
    anew, not planned with the old one's costs."""
    return _hashed_sources().hexdigest()[:16]


SWITCHES = (SWITCH, "EDGE_SPEC_NATIVE_MATMUL", "EDGE_SPEC_NATIVE_AVX512", "EDGE_SPEC_NATIVE_SCALAR",
            "EDGE_SPEC_NATIVE_AMX", "EDGE_SPEC_NATIVE_AVX_VNNI", "EDGE_SPEC_NATIVE_ONE_ROW_PREFETCH",
            "EDGE_SPEC_NATIVE_FAR_PREFETCH")  # fmt: skip


def kernel_identity() -> list[str]:
    """Which native kernels run here, as far as it decides their costs and rounding: the code, and the
    environment switches that pick among its paths or turn it off."""
    return [sources_digest(), *(f"{name}={os.environ.get(name, '')}" for name in SWITCHES)]


def build_key(cxx: str) -> str:
    """The build's folder name: the sources, the compiler's version and the flags."""
    digest = _hashed_sources()
    digest.update(_compiler_version(cxx).encode())
    digest.update(" ".join(FLAGS).encode())
    return digest.hexdigest()[:16]


def build(force: bool = False) -> Path:
    """The built library's path, compiling it first unless this source and compiler built it already.

    Built beside its final place under a temporary name and renamed over it, so that a process reading
    the cache never finds half a library; raises :class:`BuildError` with the compiler's first lines.
    A new build removes the builds no process uses (:func:`prune`)."""
    if sys.platform != "linux":
        raise BuildError(f"the native ops are built on Linux only, not {sys.platform}")
    missing = [path for path in _sources() if not path.is_file()]
    if missing:  # a frozen build that left the sources out
        raise BuildError(f"the native ops' source is not installed ({missing[0]})")
    cxx = compiler()
    if cxx is None:
        raise BuildError("no C++ compiler (g++ or clang++, or $CXX) found")
    target = cache_root() / "native" / build_key(cxx) / LIBRARY
    try:
        _hold(target.parent)
    except OSError as exc:
        raise BuildError(f"cannot use the build folder {target.parent}: {exc}") from exc
    if target.is_file() and not force:
        return target
    fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=target.parent)
    os.close(fd)
    command = [cxx, *FLAGS, f"-I{HERE / 'include'}", "-o", tmp, *map(str, _sources())]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            lines = (done.stderr or done.stdout).strip().splitlines()
            raise BuildError(f"{Path(cxx).name} failed: " + " | ".join(lines[:3])[:500])
        os.replace(tmp, target)
    except (OSError, subprocess.SubprocessError) as exc:
        _release(target.parent)
        raise BuildError(f"{Path(cxx).name} could not run: {exc}") from exc
    except BuildError:
        _release(target.parent)
        raise
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    prune(keep=target.parent)
    return target


def _hold(folder: Path) -> None:
    """Create ``folder`` and hold a shared lock on its ``.in-use`` file until this process ends (once per
    folder), so that :func:`prune` in another process leaves it.  A lock taken on a file that a pruner
    removed meanwhile protects nothing: then the folder is made again and locked anew."""
    if folder in _held:
        return
    path = folder / IN_USE
    for _ in range(10):
        folder.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except FileNotFoundError:  # pruned between the mkdir and the open
            continue
        fcntl.flock(fd, fcntl.LOCK_SH)
        try:
            if os.fstat(fd).st_ino == os.stat(path).st_ino:
                _held[folder] = fd
                return
        except FileNotFoundError:
            pass
        os.close(fd)
    raise OSError(f"{folder} keeps being removed")


def _release(folder: Path) -> None:
    """After a failed build: drop this process's lock, and the lock file where no other process holds it,
    so that a failed build leaves no file behind."""
    fd = _held.pop(folder, None)
    if fd is None:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # converts the shared lock: only if no one else holds one
        (folder / IN_USE).unlink(missing_ok=True)
    except OSError:
        pass
    finally:
        os.close(fd)


def prune(keep: Path) -> list[Path]:
    """Remove every build folder beside ``keep`` that no process uses now; returns those removed.

    Each is removed under an exclusive lock on its ``.in-use`` file, which a process using (or building)
    that build holds shared, so a folder in use is left for a later build to remove."""
    removed: list[Path] = []
    try:
        folders = [p for p in keep.parent.iterdir() if p.is_dir() and p != keep]
    except OSError:
        return removed
    for folder in folders:
        try:
            fd = os.open(folder / IN_USE, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError:  # removed meanwhile, or not ours to write
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # in use
            os.close(fd)
            continue
        try:
            shutil.rmtree(folder, ignore_errors=True)
        finally:
            os.close(fd)
        if not folder.exists():
            removed.append(folder)
            log.debug("removed the stale native ops build %s", folder)
    return removed


def enabled() -> bool:
    """Whether the native op may be used: unless ``$EDGE_SPEC_NATIVE_ATTENTION`` is ``0`` (or false, no,
    off), which keeps ORT's op everywhere (to compare the two, or to rule the native op out)."""
    return os.environ.get(SWITCH, "1").strip().lower() not in ("0", "false", "no", "off")


@cache
def _built() -> Path | None:
    try:
        return build()
    except BuildError as exc:
        log.debug("native ops unavailable, using ORT's GroupQueryAttention: %s", exc)
        return None


def library_path() -> Path | None:
    """The native ops' library for attention, built at first use (None: switched off, or it cannot be built here)."""
    return _built() if enabled() else None


def required_library_path() -> Path | None:
    """The library for a graph that holds native ops itself (``MatMulGGUF``), whatever the attention switch
    says (None: it cannot be built here)."""
    return _built()


def main() -> int:
    try:
        path = build()
    except BuildError as exc:
        print(f"edge-spec: native ops not built: {exc}", file=sys.stderr)
        return 1
    prune(keep=path.parent)  # also where it was built before: builds older ones left in use then
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
