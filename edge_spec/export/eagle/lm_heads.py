"""The EAGLE head's LM heads: full, VocabTrim and SpecVocab over its draft vocabulary.

The EAGLE layer graph (``eagle/layer.onnx``) ends at the final-normed hidden state; what turns that
state into logits is a head of the same kinds the drafter model has (``runtime.propose.heads``):

* ``full``: all K rows of the draft vocabulary (int4 graph ``eagle/head_full.onnx``, target ids
  ``eagle/vocab_full.npy``);
* ``trim-N``: VocabTrim, the N draft-vocabulary tokens the target generated most often on the
  bundle's calibration text (``draft/calibration.npz``; generated with the target when the bundle has
  none), end-of-turn tokens always kept - the draft vocabulary's own order (``d2t``) is token-id order,
  not frequency order, so it cannot rank them;
* ``specvocab-rR-kC-ofK``: SpecVocab, a rank-R scorer over the head's normed hidden state ranks the K
  rows, the C best plus the end-of-turn tokens get exact logits from an int8 copy of the K rows
  (``eagle/head_rows_int8.npy``, indexed by draft row: ``rows_by: universe``).  The scorer is
  data-aware: fitted on the head's own normed hidden states, teacher-forced over the calibration text
  (target -> features -> fc -> layer), so :func:`specvocab.fit_scorer` weights the directions the head
  actually uses; with no calibration states it falls back to the data-free SVD.

Heads are added to an installed head (the data-aware fit needs the target's ``features`` output) in a
copy of ``eagle/`` that replaces it only once complete.  A head from before the split (one graph with
``logits``, ``eagle/head.onnx``) is upgraded on the way: :func:`edge_spec.export.eagle.model.split_lm_head`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edge_spec.errors import EdgeSpecError
from edge_spec.export.bundle import build as bundle_export
from edge_spec.export.graph.builder import BuildOptions
from edge_spec.manifest import file_record, read_manifest, verify_files

EAGLE_DIR = "eagle"
LAYER = "eagle/layer.onnx"
LEGACY_HEAD = "eagle/head.onnx"  # the single graph (layer + LM head) of bundles made before the split


@dataclass
class EagleHeadOptions:
    trim: tuple[int, ...] = ()  # VocabTrim: draft-vocabulary rows kept, one head per value
    specvocab: tuple[tuple[int, int], ...] = ()  # SpecVocab: (rank, candidates) per head
    scorer: str = "data"  # "data" (the head's calibration states) or "svd"
    train_steps: int = 0
    calibration: Path | None = None
    calibration_tokens: int = 96

    def check(self, draft_vocab: int, hidden: int) -> None:
        for keep in self.trim:
            if not 0 < keep < draft_vocab:
                raise EdgeSpecError(
                    f"--eagle-trim must be between 1 and the EAGLE head's draft vocabulary "
                    f"{draft_vocab} (exclusive; the full head keeps all), got {keep}"
                )
        for rank, candidates in self.specvocab:
            if not 0 < rank <= hidden:
                raise EdgeSpecError(
                    f"--eagle-specvocab rank must be between 1 and the hidden size {hidden}, got {rank}"
                )
            if not 0 < candidates < draft_vocab:
                raise EdgeSpecError(
                    f"--eagle-specvocab candidates must be between 1 and the draft vocabulary "
                    f"{draft_vocab} (exclusive), got {candidates}"
                )
        if self.scorer not in ("data", "svd"):
            raise EdgeSpecError(f"--scorer must be 'data' or 'svd', not {self.scorer!r}")


def default_options(config) -> EagleHeadOptions:
    """The variant built beside ``full`` when a head is attached: a quarter of the draft vocabulary.
    No SpecVocab head by default: over a draft vocabulary this small its scorer costs more than the rows
    it saves (the README's EAGLE table: the slowest head, no better τ), and fitting it runs the target over
    the calibration text, most of a minute of every export; ``add-heads --eagle-specvocab R:C`` builds one."""
    return EagleHeadOptions(trim=(max(config.draft_vocab_size // 4, 1),))


def parse_specvocab(values: list[str]) -> tuple[tuple[int, int], ...]:
    """``R:C`` flag values (also comma lists) as (rank, candidates) pairs."""
    pairs = []
    for value in (v for item in values for v in item.split(",") if v.strip()):
        rank, sep, candidates = value.partition(":")
        try:
            pairs.append((int(rank), int(candidates)))
        except ValueError:
            sep = ""
        if not sep:
            raise EdgeSpecError(f"--eagle-specvocab takes RANK:CANDIDATES (e.g. 224:1024), not {value!r}")
    return tuple(pairs)


def full_head(root: Path, lm_head: np.ndarray, draft_ids: np.ndarray, build: BuildOptions) -> dict:
    """``eagle/head_full.onnx``: every row of the draft vocabulary (entry with its ``files``)."""
    entry = bundle_export._export_head(
        root, "full", lm_head, draft_ids, build, folder=EAGLE_DIR, rows=np.arange(len(draft_ids))
    )
    entry["vocab_mode"] = "full"
    return entry


def eagle_hidden_states(
    bundle_dir: Path, manifest: dict, root: Path, entry: dict, sequences: list[tuple[list[int], list[int]]]
) -> tuple[np.ndarray, np.ndarray]:
    """The head's final-normed hidden state before each calibration token the target generated, teacher
    forced (pair t: embedding of token t+1 with the target's fused features of position t, predicting
    token t+2), and those tokens: ``hidden`` [N, H], ``wanted`` [N] (target ids)."""
    from edge_spec.runtime.model.decoder import Decoder
    from edge_spec.runtime.model.embedding import TargetEmbedding
    from edge_spec.runtime.model.session import small_session

    capacity = manifest["context_length"]
    target_onnx = bundle_dir / manifest["target"]["onnx"]
    target = Decoder(target_onnx, capacity=capacity, takes_turns=True)
    layer = Decoder(root / entry["onnx"], capacity=capacity, takes_turns=True)
    fc = small_session(root / entry["fc_onnx"], "cpu", 0, what="EAGLE feature projection")
    embed = TargetEmbedding.from_onnx(target_onnx)
    hidden, wanted = [], []
    for prompt, generated in sequences:
        seq = (prompt + generated)[:capacity]
        count = len(seq) - len(prompt)
        if count < 1 or len(prompt) < 2:
            continue
        target.reset()
        features = target.forward(seq, 1)["features"]
        fused = fc.run(None, {"features": features[None].astype(np.float32)})[0][0]
        layer.reset()
        out = layer.forward(
            seq[1:],
            count + 1,
            inputs={
                "inputs_embeds": embed.rows(seq[1:]).astype(np.float32),
                "hidden": np.ascontiguousarray(fused[:-1]),
            },
        )
        hidden.append(out["hidden_states"][:-1])  # the last pair predicts past the text
        wanted.extend(seq[len(prompt) :])
    if not hidden:
        return None, None
    return np.concatenate(hidden).astype(np.float32), np.asarray(wanted, np.int64)


def build_variants(
    bundle_dir: Path,
    manifest: dict,
    root: Path,
    entry: dict,
    lm_head: np.ndarray,
    draft_ids: np.ndarray,
    options: EagleHeadOptions,
    build: BuildOptions,
    progress=None,
) -> tuple[dict, list]:
    """The VocabTrim and SpecVocab heads ``options`` asks for, written under ``root/eagle``; returns the
    heads (entries with their ``files``) and further file records (scorers, int8 rows)."""
    from edge_spec.export.heads import vocabtrim
    from edge_spec.runtime.propose.heads import rows_of

    if not (options.trim or options.specvocab):
        return {}, []
    if np.any(np.diff(draft_ids) <= 0):
        raise EdgeSpecError(
            "the EAGLE head's draft vocabulary is not in token-id order; its VocabTrim and "
            "SpecVocab heads cannot be built"
        )
    export_options = bundle_export.ExportOptions(
        calibration=options.calibration,
        calibration_tokens=options.calibration_tokens,
        context_length=manifest["context_length"],
    )
    own = root / EAGLE_DIR / "calibration.npz"  # text generated for the EAGLE heads when the bundle had none
    if own.is_file() and options.calibration is None:
        sequences = vocabtrim.load_calibration(own)
    else:
        own.unlink(missing_ok=True)
        sequences = bundle_export._calibration_sequences(
            bundle_dir, export_options, progress, own, target_source=manifest["target"].get("source")
        )
    files: list[dict] = [file_record(root, "eagle/calibration.npz")] if own.is_file() else []
    eos = json.loads((bundle_dir / "tokenizer_config.json").read_text()).get("eos_token_ids") or []
    always = np.intersect1d(np.asarray(eos, np.int64), draft_ids)  # end-of-turn tokens the head can propose
    counts = vocabtrim.count_tokens(sequences, manifest["target"]["config"]["vocab_size"])[draft_ids]
    heads: dict[str, dict] = {}
    for keep in options.trim:
        rows = vocabtrim.select_vocabulary(counts, keep, rows_of(always, draft_ids).tolist())
        coverage = float(counts[rows].sum() / max(counts.sum(), 1))
        name = f"trim-{keep}"
        bundle_export._say(
            progress,
            f"EAGLE VocabTrim head {name}: covers {coverage:.1%} of calibration tokens the draft vocabulary holds",
        )
        heads[name] = bundle_export._export_head(
            root, name, lm_head, draft_ids[rows], build, folder=EAGLE_DIR, rows=rows
        )
        heads[name].update(calibration_coverage=coverage, vocab_mode="trim")
    if options.specvocab:
        made, more = _specvocab_variants(
            bundle_dir,
            manifest,
            root,
            entry,
            lm_head,
            draft_ids,
            options,
            build,
            export_options,
            sequences,
            always,
            progress,
        )
        heads.update(made)
        files += [f for f in more if f["path"] not in {g["path"] for g in files}]
    return heads, files


def _specvocab_variants(
    bundle_dir: Path,
    manifest: dict,
    root: Path,
    entry: dict,
    lm_head: np.ndarray,
    draft_ids: np.ndarray,
    options: EagleHeadOptions,
    build: BuildOptions,
    export_options,
    sequences: list,
    always: np.ndarray,
    progress,
) -> tuple[dict, list]:
    """The EAGLE head's SpecVocab heads, one per (rank, candidates) of ``options``, over its draft
    vocabulary: (heads, the file records of their scorers and int8 rows)."""
    heads: dict[str, dict] = {}
    files: list[dict] = []
    hidden = wanted = None
    if options.scorer == "data":
        bundle_export._say(progress, "EAGLE SpecVocab: the head's hidden states on the calibration text")
        hidden, wanted = eagle_hidden_states(bundle_dir, manifest, root, entry, sequences)
    files += bundle_export._export_head_rows(root, lm_head, EAGLE_DIR)
    suffix = f"-of{len(draft_ids)}"
    for rank, candidates in options.specvocab:
        specvocab_options = dataclasses.replace(
            export_options,
            rank=(rank,),
            candidates=(candidates,),
            scorer=options.scorer,
            train_steps=options.train_steps,
        )
        made, scorer_files = bundle_export.specvocab_heads_for(
            root,
            lm_head,
            hidden,
            wanted,
            {"specvocab": ("", always)},
            specvocab_options,
            build,
            universe=draft_ids,
            suffix=suffix,
            universe_path="eagle/vocab_full.npy",
            folder=EAGLE_DIR,
            progress=progress,
        )
        for head in made.values():
            head["rows_by"] = "universe"  # the int8 rows are the K draft rows, not the target's V
        heads.update(made)
        files += [f for f in scorer_files if f["path"] not in {g["path"] for g in files}]
    return heads, files


def _build_options(manifest: dict) -> BuildOptions:
    quant = manifest["eagle"].get("quantization") or manifest["target"]["quantization"]
    return BuildOptions(quant["weights"], quant["block_size"], quant["accuracy_level"], manifest["context_length"])


def _stage(bundle_dir: Path, manifest: dict, legacy: bool) -> Path:
    """``eagle.partial/eagle``: the head's files, hard links for those add-heads never rewrites (layer, fc,
    vocabulary maps), copies of the rest; a legacy single graph is left out (it is split instead)."""
    entry = manifest["eagle"]
    keep = {entry["fc_onnx"], entry["fc_onnx"] + ".data", entry["d2t"], entry.get("t2d")}
    if not legacy:
        keep |= {entry["onnx"], entry["onnx"] + ".data"}
    root = eagle_staging(bundle_dir)
    for record in entry["files"]:
        source, dest = bundle_dir / record["path"], root / record["path"]
        if legacy and record["path"] in (entry["onnx"], entry["onnx"] + ".data"):
            continue
        dest.parent.mkdir(parents=True, exist_ok=True)
        if record["path"] in keep:
            try:
                os.link(source, dest)
                continue
            except OSError:
                pass
        shutil.copy2(source, dest)
    return root


def upgrade_legacy(root: Path, bundle_dir: Path, entry: dict, build: BuildOptions, progress=None) -> np.ndarray:
    """Split a single-graph head into ``eagle/layer.onnx`` + ``eagle/head_full.onnx`` inside ``root``;
    updates ``entry`` (``onnx``, ``heads``, ``default_head``) and returns the LM head rows."""
    from edge_spec.export.eagle.model import split_lm_head

    bundle_export._say(
        progress,
        "upgrading the bundle's EAGLE head to switchable LM heads "
        "(eagle/head.onnx -> eagle/layer.onnx + eagle/head_full.onnx)",
    )
    (root / EAGLE_DIR).mkdir(parents=True, exist_ok=True)
    lm_head = split_lm_head(bundle_dir / entry["onnx"], root / LAYER)
    d2t = np.load(bundle_dir / entry["d2t"])
    entry["onnx"] = LAYER
    entry["heads"] = {"full": full_head(root, lm_head, np.arange(len(d2t)) + d2t, build)}
    entry["default_head"] = "full"
    return lm_head


def finish_record(root: Path, entry: dict, heads: dict, files: list[dict]) -> None:
    """Move the heads' file records into ``entry["files"]`` (paths relative to the bundle) and recount."""
    entry["heads"].update(heads)
    for head in entry["heads"].values():
        files += head.pop("files", [])
    written = {f["path"] for f in files}
    others = [f for f in entry["files"] if f["path"] not in written]
    if entry["onnx"] == LAYER:  # a legacy graph is gone, its records too
        others = [f for f in others if f["path"] not in (LEGACY_HEAD, LEGACY_HEAD + ".data")]
    layer = [
        file_record(root, p)
        for p in (LAYER, LAYER + ".data")
        if p not in written and (root / p).is_file() and p not in {f["path"] for f in others}
    ]
    entry["files"] = others + layer + files
    entry["bytes"] = sum(f["bytes"] for f in entry["files"])


def add_eagle_heads(bundle_dir: Path, options: EagleHeadOptions, progress=None) -> dict:
    """Add (or rebuild) VocabTrim / SpecVocab heads of the bundle's EAGLE head, upgrading a single-graph
    head first; the bundle changes only once everything is built (``eagle.partial`` swapped in)."""
    from edge_spec.export.eagle.model import Eagle3Config

    bundle_dir = Path(bundle_dir).expanduser().resolve()
    manifest = read_manifest(bundle_dir)
    verify_files(bundle_dir, manifest)
    entry = manifest.get("eagle")
    if not entry:
        raise EdgeSpecError(
            f"{bundle_dir} has no EAGLE head: attach one first (edge-spec add-heads --eagle "
            "SOURCE, or edge-spec train-head)"
        )
    config = Eagle3Config.from_hf_config(entry["config"])
    options.check(config.draft_vocab_size, config.hidden_size)
    build = _build_options(manifest)
    legacy = "heads" not in entry
    root = _stage(bundle_dir, manifest, legacy)
    try:
        if legacy:
            lm_head = upgrade_legacy(root, bundle_dir, entry, build, progress)
        else:
            from edge_spec.runtime.model.embedding import TargetLMHead

            lm_head = TargetLMHead.from_onnx(root / entry["heads"]["full"]["onnx"]).table()
        d2t = np.load(root / entry["d2t"])
        draft_ids = np.arange(len(d2t)) + d2t
        if "features" not in _output_names(bundle_dir / manifest["target"]["onnx"]):
            raise EdgeSpecError("the bundle's target graph has no features output; attach the EAGLE head again")
        heads, files = build_variants(bundle_dir, manifest, root, entry, lm_head, draft_ids, options, build, progress)
        finish_record(root, entry, heads, files)
        swap_eagle(bundle_dir, manifest, root)
    except BaseException:
        shutil.rmtree(root, ignore_errors=True)
        raise
    return manifest


def _output_names(onnx_path: Path) -> list[str]:
    import onnx

    return [o.name for o in onnx.load(str(onnx_path), load_external_data=False).graph.output]


def eagle_staging(bundle_dir: Path) -> Path:
    """``eagle.partial``: a fresh root whose ``eagle/`` is built and then swapped in (:func:`swap_eagle`)."""
    root = bundle_dir / "eagle.partial"
    shutil.rmtree(root, ignore_errors=True)
    (root / "eagle").mkdir(parents=True)
    return root


def swap_eagle(bundle_dir: Path, manifest: dict, root: Path) -> None:
    """Put ``root/eagle`` in place of the bundle's ``eagle/`` and write ``manifest``; on failure the old
    directory is put back (the caller removes ``root``)."""
    import os

    from edge_spec.manifest import MANIFEST

    old = bundle_dir / "eagle.old"
    shutil.rmtree(old, ignore_errors=True)
    try:
        if (bundle_dir / "eagle").exists():
            (bundle_dir / "eagle").rename(old)
        (root / "eagle").rename(bundle_dir / "eagle")
        tmp = bundle_dir / (MANIFEST + ".tmp")
        tmp.write_text(json.dumps(manifest, indent=2) + "\n")
        os.replace(tmp, bundle_dir / MANIFEST)
    except BaseException:
        if old.exists():
            shutil.rmtree(bundle_dir / "eagle", ignore_errors=True)
            old.rename(bundle_dir / "eagle")
        raise
    shutil.rmtree(old, ignore_errors=True)
    shutil.rmtree(root, ignore_errors=True)
