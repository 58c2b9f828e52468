"""The bundle manifest: what an exported bundle holds, shared by the exporter and the runtime.

A bundle is one directory::

    manifest.json            this file's schema (``FORMAT``)
    tokenizer.json           Hugging Face fast tokenizer
    tokenizer_config.json    chat template, special tokens, eos ids
    target/model.onnx(.data) target decoder
    draft/model.onnx(.data)  drafter decoder (possibly with a trimmed LM head)
    draft/*.npy              drafter side tables (vocab map, scorer matrices)
    eagle/head.onnx(.data)   optional EAGLE-3 head (+ fc.onnx, d2t.npy, t2d.npy); the target then
                             also outputs ``features`` (see edge_spec.export.eagle)
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from edge_spec.errors import EdgeSpecError

FORMAT = 1
MANIFEST = "manifest.json"


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def file_record(bundle_dir: Path, relative: str) -> dict:
    path = bundle_dir / relative
    return {"path": relative, "bytes": path.stat().st_size, "sha256": sha256_file(path)}


def write_manifest(bundle_dir: Path, manifest: dict) -> None:
    (bundle_dir / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=False) + "\n")


def read_manifest(bundle_dir: Path) -> dict:
    bundle_dir = Path(bundle_dir)
    if not bundle_dir.exists():
        raise EdgeSpecError(f"bundle not found: {bundle_dir}")
    path = bundle_dir / MANIFEST
    if not path.is_file():
        raise EdgeSpecError(f"{bundle_dir} is not an edge-spec bundle (no {MANIFEST}); create one with `edge-spec export`")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise EdgeSpecError(f"{path}: invalid JSON ({exc.msg} at line {exc.lineno})") from exc
    if manifest.get("format") != FORMAT:
        raise EdgeSpecError(f"{path}: bundle format {manifest.get('format')!r} is not supported (expected {FORMAT})")
    return manifest


def verify_files(bundle_dir: Path, manifest: dict, *, full_hash: bool = False) -> None:
    """Check every recorded file exists with its size (and sha256 when ``full_hash``)."""
    for role in ("target", "draft", "eagle"):  # eagle: only bundles with an EAGLE-3 head
        for record in manifest.get(role, {}).get("files", []):
            path = Path(bundle_dir) / record["path"]
            if not path.is_file():
                raise EdgeSpecError(f"bundle file missing: {path}")
            if path.stat().st_size != record["bytes"]:
                raise EdgeSpecError(f"bundle file corrupted (size differs from manifest): {path}")
            if full_hash and sha256_file(path) != record["sha256"]:
                raise EdgeSpecError(f"bundle file corrupted (sha256 differs from manifest): {path}")
