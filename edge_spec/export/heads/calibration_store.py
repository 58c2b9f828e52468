"""Calibration text shipped with the package, so that an export of a known target skips generating it.

VocabTrim and SpecVocab calibrate on text the exported target generates greedily.  On a laptop that is
minutes of target-only decoding, and the same minutes for everyone who exports the same target graph:
the exporter is deterministic, so the same GGUF file and options give the same graph bytes.  Each
bundle's ``draft/calibration.npz`` records what made it (:func:`calibration_key`: the target's graph
files by sha256, the prompts, the tokens per prompt, the context); a file under
``edge_spec/data/calibration/shipped/`` whose key matches is used instead of generating.  Shipping one is
a copy of a bundle's file.  Text made on another CPU can differ from what this one would generate at a
near-tie, which the heads, fitted on token statistics, do not notice; the lossless guarantee never
depends on them.

For the same reason the text need not change with the target's rounding: a file also records the GGUF file
its target was exported from (:func:`source_key`: the file's sha256, the prompts, the tokens, the context), and
an export of the same file in another layout (``--gguf-layout compact``, ``lean``) takes a shipped text made
from it when none matches its own graph, instead of minutes of generating.  Its heads then learn from what the
faithful target answers, which served the compact target's drafter better than its own answers did
(docs/methods/gguf.md, fidelity).
"""

from __future__ import annotations

import hashlib
import json
import zipfile
from pathlib import Path

import numpy as np

from edge_spec.manifest import sha256_file
from edge_spec.paths import PACKAGE_DATA

TARGET_GRAPH = ("target/model.onnx", "target/model.onnx.data")


def shipped_dir() -> Path:
    """In the package, as the shipped EAGLE head is (``$EDGE_SPEC_MODELS`` moves downloads, not this)."""
    return PACKAGE_DATA / "calibration" / "shipped"


def calibration_key(bundle_dir: Path, prompts: list[str], new_tokens: int, context_length: int) -> str:
    """What determines the generated text: the target graph as exported (before anything is attached to
    it), the prompts and how much is generated for each within the context."""
    digest = hashlib.sha256()
    for relative in TARGET_GRAPH:
        path = bundle_dir / relative
        digest.update((sha256_file(path) if path.is_file() else "-").encode())
    digest.update(json.dumps([prompts, new_tokens, context_length], ensure_ascii=False).encode())
    return digest.hexdigest()


def source_digest(source: str | None) -> str | None:
    """The sha256 of the GGUF file a target ``source`` names: a registry name's as the registry records it (no
    file is read or fetched), a local file's or a folder's single one as hashed; None for a checkpoint, a hub
    id, or a source not found."""
    from edge_spec import fetch
    from edge_spec.errors import EdgeSpecError
    from edge_spec.export.sources.resolve import locate_source

    if not source:
        return None
    name = source.removeprefix("registry:")
    try:
        entry = fetch.resolve_model(name)  # a registry entry, or a local path that exists
    except EdgeSpecError:  # a hub id, or nothing: never fetched for this
        return None
    if isinstance(entry, dict):
        gguf = entry.get("gguf")
        return gguf.get("sha256") if isinstance(gguf, dict) else None
    try:
        kind, location, gguf_file = locate_source(name)
    except (EdgeSpecError, OSError):
        return None
    return sha256_file(Path(location) / gguf_file) if kind == "gguf" else None


def source_key(digest: str, prompts: list[str], new_tokens: int, context_length: int) -> str:
    """What the text of any export of one GGUF file shares, whatever its layout: the file (``digest``:
    :func:`source_digest`), the prompts, the tokens per prompt, the context."""
    payload = json.dumps(["gguf", digest, prompts, new_tokens, context_length], ensure_ascii=False)
    return hashlib.sha256(payload.encode()).hexdigest()


def stored_key(path: Path, field: str = "key") -> str | None:
    """The key a calibration file records (``field``: "key", or "source" for :func:`source_key`); None for a
    file written without one, or not a calibration file."""
    try:
        with np.load(path) as data:
            return str(data[field]) if field in data.files else None
    except (OSError, ValueError, zipfile.BadZipFile):
        return None


def find_shipped(key: str, source: str | None = None, directory: Path | None = None) -> tuple[Path, bool] | None:
    """The shipped calibration file made with ``key`` (``(path, True)``), else one made from the same GGUF
    file and prompts in another layout (``source``: :func:`source_key`; ``(path, False)``), else None."""
    directory = shipped_dir() if directory is None else directory
    files = sorted(directory.glob("*.npz")) if directory.is_dir() else []
    for path in files:
        if stored_key(path) == key:
            return path, True
    for path in files if source else ():
        if stored_key(path, "source") == source:
            return path, False
    return None
