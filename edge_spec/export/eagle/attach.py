"""Attach an EAGLE-3 head to an existing bundle: from a trained torch head, a SpecForge checkpoint or a
head saved from another bundle (how the repository ships one), without re-exporting the target.

Sits above :mod:`export.bundle.build` (the bundle's export) and :mod:`export.eagle.lm_heads` (the head's LM heads)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from edge_spec.errors import EdgeSpecError
from edge_spec.export.bundle.build import _say
from edge_spec.export.eagle import lm_heads as eagle_heads
from edge_spec.export.graph.builder import BuildOptions, save_model
from edge_spec.manifest import file_record, rerecord_file

LEGACY_EAGLE_FILES = ("head.onnx", "head.onnx.data", "fc.onnx", "fc.onnx.data", "d2t.npy", "t2d.npy")


def attach_eagle_head(
    bundle_dir: Path,
    config,
    head,
    options: BuildOptions | None = None,
    *,
    source: str | None = None,
    progress=None,
    variants=None,
) -> dict:
    """Add (or replace) an EAGLE-3 head in an existing bundle, without re-exporting the target.

    Writes the layer graph ``eagle/layer.onnx(.data)`` (ending at the final-normed hidden state), its
    ``full`` LM head ``eagle/head_full.onnx(.data)`` over the draft vocabulary (``eagle/vocab_full.npy``:
    target ids of its rows), ``eagle/fc.onnx(.data)``, ``eagle/d2t.npy`` and ``eagle/t2d.npy``, gives the
    target graph the ``features`` output the head reads (in place, graph file only: see
    :func:`edge_spec.export.eagle.model.add_feature_output`) and records both in the manifest
    (``manifest["eagle"]`` with ``heads`` and ``default_head``, ``manifest["target"]["feature_layers"]``).
    ``options`` default to the target's quantization and the bundle's context length.  The head is built
    in ``eagle.partial`` and renamed into place, and the target graph is restored if a later step fails,
    so a failure leaves the bundle as it was.

    ``variants`` (:class:`edge_spec.export.eagle.lm_heads.EagleHeadOptions`): VocabTrim / SpecVocab heads
    built next (:func:`~edge_spec.export.eagle.lm_heads.add_eagle_heads`); None: the default ones when the
    bundle has calibration text already (cheap), none otherwise.
    """
    from edge_spec.export.eagle import model as eagle
    from edge_spec.manifest import read_manifest

    bundle_dir = Path(bundle_dir)
    manifest = read_manifest(bundle_dir)
    quant = manifest["target"]["quantization"]
    if options is None:
        options = BuildOptions(
            quant["weights"], quant["block_size"], quant["accuracy_level"], manifest["context_length"]
        )
    _check_eagle_target(manifest, config)
    root = eagle_heads.eagle_staging(bundle_dir)
    weights = eagle.eagle_head_weights(head)
    _say(progress, f"building EAGLE-3 head ({options.quant}, {config.draft_vocab_size}-token draft vocabulary)")
    try:
        save_model(eagle.build_eagle_head(weights, options), root / eagle_heads.LAYER)
        save_model(eagle.build_eagle_fc(weights.fc, options), root / "eagle" / "fc.onnx")
        np.save(root / "eagle" / "d2t.npy", weights.d2t.astype(np.int64))
        np.save(root / "eagle" / "t2d.npy", weights.t2d.astype(bool))
        draft_ids = np.arange(len(weights.d2t)) + weights.d2t.astype(np.int64)
        heads = {"full": eagle_heads.full_head(root, weights.lm_head, draft_ids, options)}
    except BaseException:
        shutil.rmtree(root, ignore_errors=True)
        raise
    record = {
        "parameters": int(sum(p.numel() for p in head.parameters())),
        "quantization": {
            "weights": options.quant,
            "block_size": options.block_size,
            "accuracy_level": options.accuracy_level,
        },
        "onnx": eagle_heads.LAYER,
        "heads": heads,
        "default_head": "full",
    }
    manifest = _install_eagle(bundle_dir, manifest, root, config, record, source, progress)
    return _add_variants(bundle_dir, manifest, config, variants, progress)


def save_eagle_files(bundle_dir: Path, directory: Path, heads: tuple[str, ...] | None = None) -> Path:
    """Copy a bundle's built EAGLE head (its graphs, LM heads, vocabulary maps and manifest record) into
    ``directory``, from where :func:`install_eagle_files` attaches it to another bundle of the same
    target model without torch or training: how a trained head is shipped with the repository.

    ``heads``: the LM heads to keep (None: all).  Shipping only ``full`` keeps the repository small; the
    install builds the VocabTrim and SpecVocab heads from it on the user's machine."""
    from edge_spec.manifest import read_manifest

    manifest = read_manifest(bundle_dir)
    if not manifest.get("eagle"):
        raise EdgeSpecError(f"{bundle_dir} has no EAGLE head")
    entry = manifest["eagle"]
    kept_heads = {n: h for n, h in entry.get("heads", {}).items() if heads is None or n in heads}
    if heads is not None and set(heads) - set(kept_heads):
        raise EdgeSpecError(f"{bundle_dir}'s EAGLE head has no LM head {sorted(set(heads) - set(kept_heads))}")
    paths = lambda head: {v for v in head.values() if isinstance(v, str) and v.startswith("eagle/")}
    needed = set().union(*map(paths, kept_heads.values()))
    unneeded = set().union(*(paths(h) for n, h in entry.get("heads", {}).items() if n not in kept_heads)) - needed
    unneeded |= {path + ".data" for path in unneeded}  # a graph's weights go with it
    if heads is not None:
        unneeded.add("eagle/calibration.npz")  # the dropped heads' calibration text
    names = [f["path"].removeprefix("eagle/") for f in entry["files"] if f["path"] not in unneeded]
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for name in names:
        (directory / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(Path(bundle_dir) / "eagle" / name, directory / name)
    record = {
        k: v
        for k, v in entry.items()
        if k in ("config", "parameters", "quantization", "source", "onnx", "default_head")
    }
    record["heads"] = kept_heads
    if record.get("default_head") not in kept_heads:
        record["default_head"] = "full"
    record["files"] = names
    record["target_model"] = manifest["target"]["name"]
    record["target_sha256"] = _target_weights(manifest)
    np.save(directory / PROBE, _probe_rows(Path(bundle_dir), manifest))
    record["files"].append(PROBE)
    (directory / "eagle.json").write_text(json.dumps(record, indent=2) + "\n")
    return directory


PROBE = "target_probe.npy"  # a few dequantized embedding rows of the target the head was trained on
PROBE_IDS = np.arange(0, 4096, 97)
SAME_MODEL = 0.25  # relative difference of those rows below which two exports hold the same model


def _target_weights(manifest: dict) -> list[str]:
    return sorted(f["sha256"] for f in manifest["target"]["files"] if f["path"].endswith(".data"))


def _probe_rows(bundle_dir: Path, manifest: dict) -> np.ndarray:
    from edge_spec.runtime.model.embedding import TargetEmbedding

    embedding = TargetEmbedding.from_onnx(bundle_dir / manifest["target"]["onnx"])
    return embedding.rows(PROBE_IDS[PROBE_IDS < manifest["target"]["config"]["vocab_size"]]).astype(np.float32)


def _same_model(directory: Path, bundle_dir: Path, manifest: dict) -> bool:
    """Whether a saved head's target and this bundle's are exports of one model: the same weights
    quantized another way (GGUF blocks carried or re-quantized) give embedding rows within quantization
    noise of each other; another model's rows are as far apart as random vectors."""
    if not (directory / PROBE).is_file():
        return False
    theirs, ours = np.load(directory / PROBE), _probe_rows(bundle_dir, manifest)
    if theirs.shape != ours.shape:
        return False
    return float(np.linalg.norm(theirs - ours) / max(np.linalg.norm(ours), 1e-12)) < SAME_MODEL


def install_eagle_files(bundle_dir: Path, directory: Path, progress=None) -> dict:
    """Attach a head saved by :func:`save_eagle_files` (checked: its files are complete and it was
    built for this bundle's target weights).  A head saved before the LM heads were split off (one
    graph, ``head.onnx``) is upgraded on the way (:func:`edge_spec.export.eagle.lm_heads.add_eagle_heads`)."""
    from edge_spec.export.eagle import model as eagle
    from edge_spec.manifest import read_manifest

    bundle_dir, directory = Path(bundle_dir), Path(directory)
    record = json.loads((directory / "eagle.json").read_text()) if (directory / "eagle.json").is_file() else {}
    names = [n for n in record.get("files") or LEGACY_EAGLE_FILES if n != PROBE]  # the probe stays here
    missing = [name for name in names + ["eagle.json"] if not (directory / name).is_file()]
    if missing:
        raise EdgeSpecError(f"EAGLE head {directory} is incomplete: {', '.join(missing)} missing")
    manifest = read_manifest(bundle_dir)
    if record.get("target_sha256") != _target_weights(manifest):
        # another export of the same model (e.g. GGUF blocks carried or re-quantized): its features differ
        # by quantization noise only; drafts stay exact (the verifier decides), acceptance may move a little
        if not _same_model(directory, bundle_dir, manifest):
            raise EdgeSpecError(f"EAGLE head {directory} was trained for other target weights than {bundle_dir}'s")
        _say(progress, f"the EAGLE head {directory} was trained on another export of the same target model")
    config = eagle.Eagle3Config.from_hf_config(record["config"])
    _check_eagle_target(manifest, config)
    root = eagle_heads.eagle_staging(bundle_dir)
    try:
        for name in names:
            (root / "eagle" / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(directory / name, root / "eagle" / name)
    except BaseException:
        shutil.rmtree(root, ignore_errors=True)
        raise
    _say(progress, f"attaching the EAGLE-3 head from {directory}")
    kept = {k: record[k] for k in ("parameters", "quantization", "onnx", "heads", "default_head") if k in record}
    manifest = _install_eagle(
        bundle_dir, manifest, root, config, kept, record.get("source") or str(directory), progress
    )
    shipped_full_only = set(manifest["eagle"].get("heads", {"full": None})) == {"full"}
    return _add_variants(
        bundle_dir, manifest, config, None if shipped_full_only else eagle_heads.EagleHeadOptions(), progress
    )


def _add_variants(bundle_dir: Path, manifest: dict, config, variants, progress) -> dict:
    """Build ``variants`` (None: the default VocabTrim and SpecVocab heads when the bundle has calibration
    text, which makes them cheap; none otherwise) beside a just-installed head, splitting a single-graph
    head on the way, in one staged pass."""
    if variants is None:
        has_text = (bundle_dir / "draft" / "calibration.npz").is_file()
        variants = eagle_heads.default_options(config) if has_text else eagle_heads.EagleHeadOptions()
    if variants.trim or variants.specvocab or "heads" not in manifest["eagle"]:
        manifest = eagle_heads.add_eagle_heads(bundle_dir, variants, progress)
    return manifest


def attach_eagle_source(bundle_dir: Path, source: str, progress=None) -> dict:
    """Attach the EAGLE head ``source`` names: a head saved by :func:`save_eagle_files` (it holds
    ``eagle.json``), or a SpecForge / EAGLE-3 checkpoint directory or hub id, converted here."""
    from edge_spec.export.eagle import model as eagle
    from edge_spec.export.graph.weights import DecoderConfig
    from edge_spec.manifest import read_manifest

    if (Path(source) / "eagle.json").is_file():
        return install_eagle_files(bundle_dir, Path(source), progress)
    _say(progress, f"loading EAGLE-3 checkpoint {source}")
    target = DecoderConfig(**read_manifest(bundle_dir)["target"]["config"])
    config, head = eagle.load_specforge(source, target)
    return attach_eagle_head(bundle_dir, config, head, source=str(source), progress=progress)


def shipped_eagle_head(target: str) -> Path | None:
    """The head the registry ships for registry model ``target`` (None: none, or not a registry name),
    its files checked against the registry's sha256."""
    from edge_spec.manifest import sha256_file
    from edge_spec.paths import PACKAGE_DATA, load_registry

    entry = load_registry()["models"].get(target, {}).get("eagle_head")
    if not entry:
        return None
    directory = PACKAGE_DATA / entry["dir"]  # shipped with the package (an absolute path: anywhere)
    for name, digest in entry["sha256"].items():
        path = directory / name
        if not path.is_file() or sha256_file(path) != digest:
            raise EdgeSpecError(
                f"the shipped EAGLE head {path} is missing or damaged (sha256 differs from "
                f"the registry); reinstall edge-spec or pass --eagle none"
            )
    return directory


def _check_eagle_target(manifest: dict, config) -> None:
    from edge_spec.export.graph.weights import DecoderConfig

    config.check_target(DecoderConfig(**manifest["target"]["config"]))


def _install_eagle(
    bundle_dir: Path, manifest: dict, root: Path, config, record: dict, source: str | None, progress
) -> dict:
    """Move a staged head (``root/eagle``) into ``eagle/``, give the target its feature output, record
    both; on any failure the bundle is left as it was."""
    from edge_spec.export.eagle import model as eagle

    target = manifest["target"]
    for head in record.get("heads", {}).values():
        head.pop("files", None)
    names = sorted(p.relative_to(root).as_posix() for p in (root / "eagle").rglob("*") if p.is_file())
    files = [file_record(root, name) for name in names]
    target_onnx = bundle_dir / target["onnx"]
    backup = target_onnx.read_bytes()
    try:
        if eagle.feature_layers_of(target_onnx) != tuple(config.feature_layers):
            _say(progress, f"adding feature output (layers {list(config.feature_layers)}) to the target graph")
            eagle.add_feature_output(target_onnx, config.feature_layers)
        rerecord_file(bundle_dir, target, target["onnx"])
        target["feature_layers"] = list(config.feature_layers)
        manifest["eagle"] = {
            "kind": "eagle3",
            "source": source,
            "config": config.to_hf_config(),
            "feature_layers": list(config.feature_layers),
            "draft_vocab_size": config.draft_vocab_size,
            "onnx": "eagle/head.onnx",
            **record,
            "fc_onnx": "eagle/fc.onnx",
            "d2t": "eagle/d2t.npy",
            "t2d": "eagle/t2d.npy",
            "files": files,
            "bytes": sum(f["bytes"] for f in files),
        }
        eagle_heads.swap_eagle(bundle_dir, manifest, root)
    except BaseException:
        target_onnx.write_bytes(backup)
        shutil.rmtree(root, ignore_errors=True)
        raise
    return manifest
