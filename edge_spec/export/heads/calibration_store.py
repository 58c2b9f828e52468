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


def stored_key(path: Path) -> str | None:
    """The key a calibration file records; None for a file written before keys, or not a calibration file."""
    try:
        with np.load(path) as data:
            return str(data["key"]) if "key" in data.files else None
    except (OSError, ValueError, zipfile.BadZipFile):
        return None


def find_shipped(key: str, directory: Path | None = None) -> Path | None:
    """The shipped calibration file made with ``key``, if any."""
    directory = shipped_dir() if directory is None else directory
    for path in sorted(directory.glob("*.npz")) if directory.is_dir() else ():
        if stored_key(path) == key:
            return path
    return None
