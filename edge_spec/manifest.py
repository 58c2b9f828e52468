"""The bundle manifest: what an exported bundle holds, shared by the exporter and the runtime.

A bundle is one directory::

    manifest.json            this file's schema (``FORMAT``)
    tokenizer.json           Hugging Face fast tokenizer
    tokenizer_config.json    chat template, special tokens, eos ids (both recorded under ``tokenizer``;
                             bundles exported before that have no such record and are not checked)
    target/model.onnx(.data) target decoder
    draft/model.onnx(.data)  drafter decoder (possibly with a trimmed LM head)
    draft/*.npy              drafter side tables (vocab map, scorer matrices)
    eagle/layer.onnx(.data)  optional EAGLE-3 head: its decoder layer (+ fc.onnx, d2t.npy, t2d.npy) and
    eagle/head_*.onnx ...    its LM heads over the draft vocabulary (``eagle.heads``, ``eagle.default_head``:
                             full, trim-N, specvocab-rR-kC-ofK, as the drafter's); the target then also
                             outputs ``features`` (see edge_spec.export.eagle.model, eagle_heads).  Bundles made
                             before the split have one graph, eagle/head.onnx, with the LM head inside
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

from edge_spec.errors import EdgeSpecError

FORMAT = 1
MANIFEST = "manifest.json"


def sha256_file(path: Path, chunk: int = 1 << 22, on_block: Callable[[int], None] | None = None) -> str:
    """The file's SHA-256; ``on_block(size)`` after each block read (progress, and a place to stop by raising)."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
            if on_block is not None:
                on_block(len(block))
    return digest.hexdigest()


def file_record(bundle_dir: Path, relative: str) -> dict:
    path = bundle_dir / relative
    return {"path": relative, "bytes": path.stat().st_size, "sha256": sha256_file(path)}


def rerecord_file(bundle_dir: Path, entry: dict, relative: str) -> None:
    """After ``relative`` was rewritten in place: its record in ``entry["files"]`` and the entry's byte
    total follow it."""
    entry["files"] = [file_record(bundle_dir, f["path"]) if f["path"] == relative else f for f in entry["files"]]
    entry["bytes"] = sum(f["bytes"] for f in entry["files"])


def write_manifest(bundle_dir: Path, manifest: dict) -> None:
    (bundle_dir / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=False) + "\n")


def tokenizer_record(bundle_dir: Path) -> dict:
    """The manifest's ``tokenizer`` entry: size and sha256 of the tokenizer files."""
    return {"files": [file_record(bundle_dir, name) for name in TOKENIZER_FILES]}


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
#: the ``gguf_layout`` values whose graphs multiply GGUF's Q4_K (and Q6_K) blocks under the native ``MatMulGGUF`` op
NATIVE_LAYOUTS = ("native", "compact")
ROLES = ("tokenizer", "target", "draft", "eagle")  # entries with file records (eagle, tokenizer: optional)
_HEAD_FILES = ("onnx", "vocab_ids", "rows", "scales", "always_ids", "universe")


def role_bytes(manifest: dict, role: str | None) -> int:
    """The bytes of a manifest role's files (0 for None or a role the bundle lacks): what reading it costs."""
    return sum(record["bytes"] for record in (manifest.get(role) or {}).get("files", [])) if role else 0


def bundle_bytes(manifest: dict) -> int:
    """The bytes of all of a bundle's recorded files: what verifying it hashes."""
    return sum(role_bytes(manifest, role) for role in ROLES)


def read_manifest(bundle_dir: Path) -> dict:
    bundle_dir = Path(bundle_dir)
    if not bundle_dir.exists():
        raise EdgeSpecError(f"bundle not found: {bundle_dir}")
    path = bundle_dir / MANIFEST
    if not path.is_file():
        raise EdgeSpecError(
            f"{bundle_dir} is not an edge-spec bundle (no {MANIFEST}); create one with `edge-spec export`"
        )
    try:
        manifest = json.loads(path.read_bytes().decode("utf-8"))
    except json.JSONDecodeError as exc:
        raise EdgeSpecError(f"{path}: invalid JSON ({exc.msg} at line {exc.lineno})") from exc
    except (UnicodeDecodeError, RecursionError, OSError) as exc:
        raise EdgeSpecError(
            f"{path}: not a readable JSON text ({type(exc).__name__}); the bundle is damaged, export it again"
        ) from None
    if not isinstance(manifest, dict):
        raise EdgeSpecError(
            f"{path}: not a JSON object (got {type(manifest).__name__}); the bundle is damaged, export it again"
        )
    if manifest.get("format") != FORMAT:
        raise EdgeSpecError(f"{path}: bundle format {manifest.get('format')!r} is not supported (expected {FORMAT})")
    check_manifest(manifest, path)
    return manifest


class _Damaged(Exception):
    pass


def _field(entry: dict, key: str, kind, where: str, *, optional: bool = False):
    value = entry.get(key) if isinstance(entry, dict) else None
    if value is None and optional:
        return None
    ok = isinstance(value, kind) and not (isinstance(value, bool) and kind in (int, (int, float)))
    if not ok:
        problem = "missing" if not isinstance(entry, dict) or key not in entry else f"malformed ({value!r:.40})"
        raise _Damaged(f"{where}{key} is {problem}")
    return value


def _relative(value: str, label: str) -> str:
    if not value or Path(value).is_absolute() or ".." in Path(value).parts:
        raise _Damaged(f"{label} {value!r} is not a path inside the bundle")
    return value


def _check_files(entry: dict, where: str) -> None:
    for index, record in enumerate(_field(entry, "files", list, where)):
        at = f"{where}files[{index}]."
        if not isinstance(record, dict):
            raise _Damaged(f"{at[:-1]} is malformed")
        _relative(_field(record, "path", str, at), at + "path")
        if _field(record, "bytes", int, at) < 0:
            raise _Damaged(f"{at}bytes is negative")
        _field(record, "sha256", str, at)


def _check_heads(entry: dict, where: str) -> None:
    """A drafter's (or the EAGLE head's) ``heads`` and ``default_head``."""
    heads = _field(entry, "heads", dict, where)
    if not heads:
        raise _Damaged(f"{where}heads is empty")
    for name, head in heads.items():
        at = f"{where}heads.{name}."
        if not isinstance(head, dict):
            raise _Damaged(f"{at[:-1]} is malformed")
        _field(head, "size", int, at)
        if _field(head, "parameters", (int, float), at) < 0:
            raise _Damaged(f"{at}parameters is malformed ({head['parameters']!r})")
        required = ("onnx", "rows", "scales") if head.get("kind") == "specvocab" else ("onnx",)
        if head.get("kind") == "specvocab":
            _field(head, "candidates", int, at)
        for key in _HEAD_FILES:
            if key in required or head.get(key) is not None:
                _relative(_field(head, key, str, at), at + key)
    default = _field(entry, "default_head", str, where)
    if default not in heads:
        raise _Damaged(f"{where}default_head {default!r} is not one of its heads ({', '.join(heads)})")


def eagle_heads(manifest: dict) -> dict:
    """The EAGLE head's LM heads by name; a bundle made before they were split off has one, ``full``,
    inside its layer graph (kind ``builtin``)."""
    entry = manifest.get("eagle") or {}
    if not entry:
        return {}
    return entry.get("heads") or {
        "full": {"kind": "builtin", "onnx": entry["onnx"], "size": int(entry.get("draft_vocab_size", 0))}
    }


def check_manifest(manifest: dict, path: Path | str = MANIFEST) -> None:
    """Refuse, in one line, a manifest that lacks what the runtime reads (a damaged or hand-edited file)."""
    try:
        context = _field(manifest, "context_length", int, "")
        if context < 1:
            raise _Damaged(f"context_length is malformed ({context})")
        for role in ("target", "draft"):
            entry = _field(manifest, role, dict, "")
            at = f"{role}."
            onnx = _relative(_field(entry, "onnx", str, at), at + "onnx")
            _check_files(entry, at)
            recorded = {record["path"] for record in entry["files"]}
            needs = [onnx, onnx + ".data"]  # the graph and its weights are always recorded
            if entry.get("prompt_reader") is not None:  # and a prompt graph's, where there is one
                reader = _field(entry, "prompt_reader", dict, at)
                prompt = _relative(_field(reader, "onnx", str, at + "prompt_reader."), at + "prompt_reader.onnx")
                needs += [prompt, prompt + ".data"]
            for needed in needs:
                if needed not in recorded:
                    raise _Damaged(f"{at}files has no record of {needed}")
            if _field(entry, "parameters", (int, float), at) <= 0:
                raise _Damaged(f"{at}parameters is malformed ({entry['parameters']!r})")
            _field(entry, "bytes", (int, float), at)
            _field(entry, "name", str, at)
            _field(_field(entry, "quantization", dict, at), "weights", str, at + "quantization.")
            config = _field(entry, "config", dict, at)
            for key in ("num_layers", "hidden_size", "vocab_size"):
                _field(config, key, int, at + "config.")
        _check_heads(manifest["draft"], "draft.")
        for role in ("tokenizer", "eagle"):
            if manifest.get(role) is not None:
                _check_files(_field(manifest, role, dict, ""), f"{role}.")
        if manifest.get("eagle") is not None:
            for key in ("onnx", "fc_onnx", "d2t"):
                _relative(_field(manifest["eagle"], key, str, "eagle."), "eagle." + key)
            if manifest["eagle"].get("heads") is not None:  # bundles before the split have one graph, no heads
                _check_heads(manifest["eagle"], "eagle.")
    except _Damaged as exc:
        raise EdgeSpecError(f"{path}: {exc}; the bundle is damaged, export it again") from None


def verify_files(
    bundle_dir: Path, manifest: dict, *, full_hash: bool = False, on_block: Callable[[int], None] | None = None
) -> None:
    """Check every recorded file exists with its size (and sha256 when ``full_hash``, calling ``on_block``
    as :func:`sha256_file` does).  The tokenizer files are checked when the manifest records them
    (bundles exported before that do not)."""
    for role in ROLES:
        for record in (manifest.get(role) or {}).get("files", []):
            path = Path(bundle_dir) / record["path"]
            if not path.is_file():
                raise EdgeSpecError(f"bundle file missing: {path}")
            if path.stat().st_size != record["bytes"]:
                raise EdgeSpecError(
                    f"bundle file corrupted (size differs from manifest): {path}; export the bundle again"
                )
            if full_hash and sha256_file(path, on_block=on_block) != record["sha256"]:
                raise EdgeSpecError(
                    f"bundle file corrupted (sha256 differs from manifest): {path}; export the bundle again"
                )
