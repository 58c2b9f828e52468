"""``edge-spec export``: target + drafter sources -> one bundle directory (see ``edge_spec.manifest``).

The steps run one model at a time so that peak memory is one float32 model plus
its quantized copy, not both models at once.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import shutil
import stat
import time
from pathlib import Path

import numpy as np

from edge_spec import __version__
from edge_spec.errors import EdgeSpecError
from edge_spec.export.bundle import activity, install
from edge_spec.export.bundle.options import AUTO_LAYOUT, AUTO_NATIVE_LAYOUT, ExportOptions, layout_name, layout_settings
from edge_spec.export.bundle.stages import Stages, memory_needed
from edge_spec.export.gguf.blocks import rounding_pads_little
from edge_spec.export.graph.builder import BuildOptions, build_decoder, build_head, build_scorer, write_model
from edge_spec.export.graph.prompt_reader import write_prompt_graph
from edge_spec.export.graph.weights import DecoderConfig
from edge_spec.export.sources.pair import ModelCard, check_pair, probe_pair
from edge_spec.export.sources.resolve import LoadedModel, check_source_exists, load_model
from edge_spec.manifest import FORMAT, file_record, tokenizer_record, verify_files, write_manifest


def _say(progress, message: str) -> None:
    if progress is not None:
        progress(message)


def carries_gguf_blocks(options: ExportOptions, role: str) -> bool:
    """Whether the ``role`` ("target" or "draft") model keeps its GGUF blocks.  By default only the
    target does: its weights decide the output, while the drafter's rounding only moves acceptance, and
    its 5/6-bit GGUF blocks widened to 8 bits cost it more speed than they buy."""
    return options.gguf_blocks == "both" or (options.gguf_blocks == "target" and role == "target")


def rounds_drafter_native(build: BuildOptions, options: ExportOptions, config: DecoderConfig) -> bool:
    """Whether the drafter's body, re-quantized, is rounded to Q4_K under the native op
    (``blocks.add_rounded_native``): in the native layout at int4, for a drafter whose widths pad little
    (``config``'s: ``blocks.rounding_pads_little``), on a CPU where the op's one-row passes ask for their
    records ahead, as the export has just timed them on its target (``measure_native_kernels``; Intel's cores
    by the vendor's rule where there was no timing).  There a drafter step after a target pass took 1.18x less
    time than over ``MatMulNBits``' blocks of 128 on an Intel Xeon, though its rows of 896 are padded to 1024,
    and a short prompt's read 2.9x less, and the bench prompts decoded 1.068x faster on a Zen 5 EPYC
    (docs/measurements.md); where the hardware prefetcher keeps up by itself (a Zen 4 EPYC) ``MatMulNBits``
    reads fewer bytes a step, and the drafter keeps it."""
    if not (build.carry_native and not build.gguf_blocks and options.quant == "int4"):
        return False
    if not all(rounding_pads_little(width) for width in (config.hidden_size, config.intermediate_size)):
        return False
    from edge_spec.runtime.model.native_attention import gguf_matmul_asks_ahead, native_matmul_here

    library, _ = native_matmul_here()
    return library is not None and gguf_matmul_asks_ahead(library)


def _gguf_quant_info(model: LoadedModel, quant_info: dict, build: BuildOptions, progress) -> dict:
    """``quant_info`` plus, for a GGUF source exported quantized, which matrices kept their GGUF blocks and
    which were re-quantized, and in which layout (also said in one line of the export log)."""
    report = model.gguf_carry
    if report is None or quant_info["weights"] == "fp32":
        return quant_info
    if not build.gguf_blocks:  # before the report is asked for: a GGUF source's blocks are checked then
        return dict(quant_info, gguf_blocks="requantized")
    layout = layout_name(
        build.carry_exact, build.carry_narrow, build.head_rescore, build.carry_native, build.carry_compact
    )
    _say(progress, f"{model.name}: {report.summary()} ({layout} layout); embedding table re-quantized to int8")
    return dict(quant_info, gguf_blocks=report.to_dict(), gguf_layout=layout, embedding="GatherBlockQuantized int8")


def _model_record(model: LoadedModel, bundle_dir: Path, role: str, quant_info: dict, stem: str = "model") -> dict:
    files = [file_record(bundle_dir, f"{role}/{stem}.onnx"), file_record(bundle_dir, f"{role}/{stem}.onnx.data")]
    return {
        "name": model.name,
        "source": model.source,
        "config": model.weights.config.to_dict(),
        "parameters": model.weights.num_parameters(),
        "quantization": quant_info,
        "onnx": f"{role}/{stem}.onnx",
        "files": files,
        "bytes": sum(f["bytes"] for f in files),
    }


def _export_head(
    bundle_dir: Path,
    name: str,
    lm_head: np.ndarray,
    vocab_ids: np.ndarray | None,
    build: BuildOptions,
    blocks=None,
    *,
    folder: str = "draft",
    rows: np.ndarray | None = None,
) -> dict:
    """Write <folder>/head_<name>.onnx (+ its vocabulary map) and return its manifest entry; ``blocks``: the
    head's carried GGUF blocks, if any.  ``rows``: the rows of ``lm_head`` the head keeps, when they are
    not the target ids ``vocab_ids`` themselves (a head over a draft vocabulary)."""
    rows = vocab_ids if rows is None else rows
    weight = lm_head if rows is None else lm_head[rows]
    if blocks is not None and rows is not None:
        blocks = blocks.rows(rows)
    stem = f"{folder}/head_{name}.onnx"
    write_model(bundle_dir / stem, lambda data: build_head(weight, build, blocks, data))
    files = [file_record(bundle_dir, stem), file_record(bundle_dir, stem + ".data")]
    entry = {"kind": "static", "onnx": stem, "size": int(weight.shape[0]), "parameters": int(weight.size)}
    if vocab_ids is not None:
        np.save(bundle_dir / folder / f"vocab_{name}.npy", vocab_ids)
        files.append(file_record(bundle_dir, f"{folder}/vocab_{name}.npy"))
        entry["vocab_ids"] = f"{folder}/vocab_{name}.npy"
    entry["files"] = files
    return entry


def _export_scorer(
    bundle_dir: Path, scorer, build: BuildOptions, suffix: str = "", folder: str = "draft"
) -> tuple[str, list[dict]]:
    """Write one SpecVocab scorer graph (shared by every head of its rank and universe)."""
    stem = f"{folder}/scorer_r{scorer.rank}{suffix}.onnx"
    write_model(bundle_dir / stem, lambda data: build_scorer(scorer.w_down, scorer.w_vocab, build, data))
    return stem, [file_record(bundle_dir, stem), file_record(bundle_dir, stem + ".data")]


def _specvocab_head_entry(
    bundle_dir: Path, name: str, scorer, scorer_onnx: str, candidates: int, always: np.ndarray, folder: str = "draft"
) -> dict:
    """Manifest entry of one SpecVocab head (+ its always-kept ids); the int8 head rows it gathers
    from are shared by all SpecVocab heads (see :func:`_export_head_rows`)."""
    hidden = scorer.w_down.shape[1]
    np.save(bundle_dir / folder / f"always_{name}.npy", always)
    return {
        "kind": "specvocab",
        "onnx": scorer_onnx,
        "rank": scorer.rank,
        "candidates": candidates,
        "rows": f"{folder}/head_rows_int8.npy",
        "scales": f"{folder}/head_scales.npy",
        "always_ids": f"{folder}/always_{name}.npy",
        "size": candidates + len(always),
        "parameters": int(scorer.w_down.size + scorer.w_vocab.size + (candidates + len(always)) * hidden),
        "files": [file_record(bundle_dir, f"{folder}/always_{name}.npy")],
    }


def _export_head_rows(bundle_dir: Path, lm_head: np.ndarray, folder: str = "draft") -> list[dict]:
    from edge_spec.export.heads.specvocab import quantize_rows_int8

    codes, scales = quantize_rows_int8(lm_head)
    np.save(bundle_dir / folder / "head_rows_int8.npy", codes)
    np.save(bundle_dir / folder / "head_scales.npy", scales)
    return [
        file_record(bundle_dir, f"{folder}/head_rows_int8.npy"),
        file_record(bundle_dir, f"{folder}/head_scales.npy"),
    ]


def default_head(heads: dict, options: ExportOptions) -> str:
    """The first head built for the first non-full mode the user asked for (the full head is always built)."""
    for mode in options.vocab_modes:
        for name, head in heads.items():
            if mode != "full" and head.get("vocab_mode") == mode:
                return name
    return "full"


def export_draft_heads(
    bundle_dir: Path,
    lm_head: np.ndarray,
    options: ExportOptions,
    build: BuildOptions,
    *,
    always_keep: list[int],
    progress=None,
    lm_head_blocks=None,
    target_source: str | None = None,
) -> tuple[dict, list[dict], dict | None]:
    """Build every drafter head ``options`` asks for (the full head always) into ``bundle_dir/draft``.

    VocabTrim and SpecVocab calibrate on text the exported target generates
    (``bundle_dir/target`` must exist; ``target_source``: where it came from, for a shipped text of the same
    GGUF file); the sequences are kept in the bundle (``draft/calibration.npz``) and reused when heads are
    added later.  Returns (heads, their file records, calibration summary or None).
    """
    from edge_spec.export.heads import specvocab, vocabtrim

    lm_head = np.asarray(lm_head, np.float32)  # read once (a deferred head would be read by every step below)
    options = options.fitted_to(*lm_head.shape)
    modes = options.vocab_modes
    heads = {"full": _export_head(bundle_dir, "full", lm_head, None, build, lm_head_blocks)}
    calibration = counts = None
    files: list[dict] = []
    if any(m != "full" for m in modes):
        activity.detail("the calibration text")
        sequences = _calibration_sequences(bundle_dir, options, progress, target_source=target_source)
        counts = vocabtrim.count_tokens(sequences, lm_head.shape[0])
        np.save(bundle_dir / "draft" / "token_counts.npy", counts)
        files += [file_record(bundle_dir, "draft/token_counts.npy"), file_record(bundle_dir, "draft/calibration.npz")]
        calibration = {
            "prompts": len(sequences),
            "generated_tokens": int(counts.sum()),
            "distinct_tokens": int((counts > 0).sum()),
        }
    if "trim" in modes:
        for keep in options.keep_list:
            vocab_ids = vocabtrim.select_vocabulary(counts, keep, always_keep)
            name = f"trim-{keep}"
            coverage = float(counts[vocab_ids].sum() / max(counts.sum(), 1))
            _say(progress, f"VocabTrim head {name}: covers {coverage:.1%} of calibration tokens")
            heads[name] = _export_head(bundle_dir, name, lm_head, vocab_ids, build, lm_head_blocks)
            heads[name].update(calibration_coverage=coverage, vocab_mode="trim")
    always = _specvocab_always(modes, options, counts, always_keep, lm_head.shape[0])
    if always:
        files += _export_head_rows(bundle_dir, lm_head)
        _say(progress, "SpecVocab: collecting drafter hidden states on the calibration text")
        activity.detail("the drafter's hidden states on the calibration text")
        hidden, next_tokens = specvocab.collect_hidden_states(
            bundle_dir / "draft" / "body.onnx", sequences, options.context_length
        )
    for universe_size in options.scorer_vocab if always else ():
        universe = None if universe_size == 0 else vocabtrim.select_vocabulary(counts, universe_size, always_keep)
        rows = lm_head if universe is None else lm_head[universe]
        suffix = "" if universe is None else f"-of{universe_size}"
        if universe is not None:
            np.save(bundle_dir / "draft" / f"universe{suffix}.npy", universe)
            files.append(file_record(bundle_dir, f"draft/universe{suffix}.npy"))
        specvocab_heads, specvocab_files = specvocab_heads_for(
            bundle_dir,
            rows,
            hidden,
            next_tokens,
            always,
            options,
            build,
            universe=universe,
            suffix=suffix,
            universe_path=f"draft/universe{suffix}.npy",
            progress=progress,
        )
        heads.update(specvocab_heads)
        files += specvocab_files
    files += [f for h in heads.values() for f in h.pop("files")]
    return heads, files, calibration


def _specvocab_always(
    modes, options: ExportOptions, counts: np.ndarray | None, always_keep: list[int], vocab_size: int
) -> dict[str, tuple[str, np.ndarray]]:
    """Per SpecVocab mode: the head-name prefix and the ids always among the candidates (the VocabTrim
    union's, or the end and special tokens alone)."""
    from edge_spec.export.heads import vocabtrim

    always: dict[str, tuple[str, np.ndarray]] = {}
    for mode in (m for m in modes if m.endswith("specvocab")):
        if mode == "trim+specvocab":
            always[mode] = (
                f"trim{options.union_keep}+",
                vocabtrim.select_vocabulary(counts, options.union_keep, always_keep),
            )
        else:
            always[mode] = ("", np.unique(np.asarray([i for i in always_keep if 0 <= i < vocab_size], np.int64)))
    return always


def specvocab_heads_for(
    bundle_dir: Path,
    rows: np.ndarray,
    hidden: np.ndarray | None,
    wanted: np.ndarray,
    always: dict[str, tuple[str, np.ndarray]],
    options: ExportOptions,
    build: BuildOptions,
    *,
    universe: np.ndarray | None,
    suffix: str,
    universe_path: str,
    folder: str = "draft",
    progress=None,
) -> tuple[dict, list[dict]]:
    """SpecVocab heads over the LM-head ``rows`` (target ids ``universe``; None: the whole vocabulary):
    one scorer per ``options.rank``, fitted on the calibration states ``hidden`` (``options.scorer``
    "data"; plain SVD when "svd" or when ``hidden`` is None) and written to ``folder``, then one head per
    ``options.candidates`` and per ``always`` mode (its name prefix and always-kept ids).  Returns the
    heads (each with its ``files``) and the scorers' file records."""
    from edge_spec.export.heads import specvocab

    data = hidden is not None and options.scorer == "data"
    scorer_label = (options.scorer if hidden is not None else "svd") + (
        f"+{options.train_steps} steps" if options.train_steps and hidden is not None else ""
    )
    heads, files = {}, []
    for rank in options.rank:
        activity.detail(f"the SpecVocab scorer of rank {rank}")
        scorer = specvocab.fit_scorer(rows, rank, hidden if data else None)
        if hidden is not None:
            scorer = specvocab.train_scorer(scorer, rows, hidden, options.train_steps, progress=progress)
        scorer_onnx, scorer_files = _export_scorer(bundle_dir, scorer, build, suffix, folder)
        files += scorer_files
        for mode, (prefix, static) in always.items():
            recall = (
                specvocab.recall_at_k(scorer, hidden, wanted, list(options.candidates), static, universe)
                if hidden is not None
                else {}
            )
            for k in options.candidates:
                name = f"{prefix}specvocab-r{rank}-k{k}{suffix}"
                if k in recall:
                    _say(progress, f"SpecVocab head {name}: calibration recall {recall[k]:.1%}")
                heads[name] = _specvocab_head_entry(bundle_dir, name, scorer, scorer_onnx, k, static, folder)
                heads[name].update(scorer=scorer_label, vocab_mode=mode)
                if k in recall:
                    heads[name]["calibration_recall"] = recall[k]
                if universe is not None:
                    heads[name]["universe"] = universe_path
    return heads, files


def _calibration_sequences(
    bundle_dir: Path, options: ExportOptions, progress, path: Path | None = None, target_source: str | None = None
) -> list:
    """The calibration text: the bundle's (``draft/calibration.npz``), else the shipped text this target
    made from these prompts, else one an export of the same GGUF file (``target_source``) in another layout
    made (``calibration_store``), else generated with the exported target; stored at ``path`` (default:
    there) with both keys."""
    from edge_spec.export.heads import calibration_store, vocabtrim

    stored = bundle_dir / "draft" / "calibration.npz"
    if stored.is_file() and options.calibration is None:
        _say(progress, "reusing the bundle's calibration text")
        return vocabtrim.load_calibration(stored)
    prompts = vocabtrim.load_prompts(options.calibration)
    tokens, context = options.calibration_tokens, options.context_length
    key = calibration_store.calibration_key(bundle_dir, prompts, tokens, context)
    digest = calibration_store.source_digest(target_source)
    source = calibration_store.source_key(digest, prompts, tokens, context) if digest else ""
    shipped = calibration_store.find_shipped(key, source or None)
    if shipped is not None:
        found, this_graph = shipped
        made_by = "this target" if this_graph else "this GGUF file's target in another layout"
        _say(progress, f"calibration: the text {made_by} generated from these prompts ships in {found}")
        sequences = vocabtrim.load_calibration(found)
    else:
        _say(progress, f"calibration: generating text with the exported target ({len(prompts)} prompts)")
        sequences = vocabtrim.generate_calibration(bundle_dir, prompts, tokens, context, progress)
    vocabtrim.save_calibration(path or stored, sequences, key, source)
    return sequences


def save_tokenizer(tokenizer, eos_ids: list[int], bundle_dir: Path) -> None:
    """Write tokenizer.json + tokenizer_config.json: all the runtime needs, without transformers."""
    tokenizer.backend_tokenizer.save(str(bundle_dir / "tokenizer.json"))
    template = tokenizer.chat_template
    if isinstance(template, dict):  # named templates: keep the default one
        template = template.get("default") or next(iter(template.values()))
    config = {
        "chat_template": template,
        "bos_token": tokenizer.bos_token,
        "eos_token": tokenizer.eos_token,
        "eos_token_ids": eos_ids,
        "add_bos_token": bool(getattr(tokenizer, "add_bos_token", False)),
    }
    (bundle_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def add_prompt_reader(bundle_dir: Path, record: dict) -> None:
    """Write a model's prompt graph (``graph.prompt_reader``) beside it and add it to its manifest ``record``."""
    path = write_prompt_graph(bundle_dir / record["onnx"])
    relative = path.relative_to(bundle_dir).as_posix()
    record["files"] += [file_record(bundle_dir, relative), file_record(bundle_dir, relative + ".data")]
    record["bytes"] = sum(f["bytes"] for f in record["files"])
    record["prompt_reader"] = {"onnx": relative, "matmuls": "int8 weights per row, int8 inputs per row"}


def export_decoder(model: LoadedModel, bundle_dir: Path, role: str, options: BuildOptions, stem: str = "model") -> None:
    out = bundle_dir / role
    out.mkdir(parents=True, exist_ok=True)
    write_model(out / f"{stem}.onnx", lambda data: build_decoder(model.weights, options, data))


# -- where a bundle is written ---------------------------------------------------------------------


def check_output_dir(out_dir: str | Path) -> Path:
    """The directory a bundle may be written to, resolved (``..``, ``.``, symlinks); refuses, before
    any work, a path that is a file, the filesystem root, or a non-empty directory that is not an
    edge-spec bundle (only a bundle is ever replaced, and only once its replacement is complete)."""
    path = Path(out_dir).expanduser().resolve()
    given = str(out_dir) if str(out_dir) == str(path) else f"{out_dir} ({path})"
    if not path.name:
        raise EdgeSpecError(f"cannot write a bundle to {path}: name a directory inside it")
    if path.exists():
        if not path.is_dir():
            raise EdgeSpecError(f"output {given} is not a directory")
        if any(path.iterdir()) and not install.is_bundle(path):
            raise EdgeSpecError(
                f"output directory {given} is not empty and not an edge-spec bundle; "
                "choose a new or empty directory (nothing was changed)"
            )
    elif path.parent.exists() and not path.parent.is_dir():
        raise EdgeSpecError(f"output {given}: {path.parent} is not a directory")
    return path


def _install(staging: Path, final: Path) -> None:
    """Put the complete bundle ``staging`` at ``final`` (a complete bundle is at the path at every
    instant: :func:`edge_spec.export.bundle.install.install`), then remove what killed runs left beside it."""
    check_output_dir(final)  # still nothing but a bundle (or empty) there
    install.install(staging, final)
    install.clean_stale(final)


def _staged_copy(bundle_dir: Path, manifest: dict) -> Path:
    """A copy of ``bundle_dir`` beside it to change instead of the bundle itself: the files add-heads
    only reads (both models, the EAGLE head) are hard links, everything it may rewrite a real copy.
    Directories keep their modes (a bundle shared 0755 stays shared)."""
    body = manifest["draft"]["onnx"]
    shared = {f["path"] for role in ("target", "eagle") for f in manifest.get(role, {}).get("files", [])}
    shared |= {body, body + ".data"}
    staging = install.staging_dir(bundle_dir, stat.S_IMODE(bundle_dir.stat().st_mode))
    try:
        for source in sorted(bundle_dir.rglob("*")):
            relative = source.relative_to(bundle_dir)
            dest = staging / relative
            if source.is_dir() and not source.is_symlink():
                dest.mkdir(parents=True, exist_ok=True)
                shutil.copymode(source, dest)
                continue
            dest.parent.mkdir(parents=True, exist_ok=True)
            if relative.as_posix() in shared:
                try:
                    os.link(source, dest)
                    continue
                except OSError:
                    pass  # no hard links here: copy
            shutil.copy2(source, dest, follow_symlinks=False)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return staging


def chosen_layout(options: ExportOptions, progress=None) -> str:
    """The ``--gguf-layout`` this export builds: the one asked for, or for ``auto`` the compact layout where the
    native op runs on this machine, else lean (said in one line): a native-op bundle loads there in lean's form,
    converted at each load.  Compact, not native: the fastest layout whose fidelity clears the bar the default
    is held to (top-1 agreement >= 0.95, NLL within 2% of the GGUF's own; docs/methods/gguf.md)."""
    if options.gguf_layout != AUTO_LAYOUT:
        return options.gguf_layout
    from edge_spec.runtime.model.native_attention import native_matmul_here

    _, why = native_matmul_here()
    if why:
        _say(progress, f"GGUF layout: lean, not {AUTO_NATIVE_LAYOUT}, since {why}")
        return "lean"
    return AUTO_NATIVE_LAYOUT


def export_bundle(
    target_source: str,
    draft_source: str,
    out_dir: Path,
    options: ExportOptions,
    progress=None,
    *,
    loader=load_model,
    checked: bool = False,
) -> dict:
    """Export target and drafter into ``out_dir`` and return the manifest.

    ``loader`` maps a source string to a :class:`LoadedModel` (tests pass
    in-memory models).  ``progress`` is called with one line per step.

    What can be refused before anything is built is refused first (:func:`check_before_build`), unless
    ``checked`` says the caller has done so already (the export command, before it starts the process
    that does the work).  The bundle is built in a hidden directory beside ``out_dir``, removed if the
    export fails, and put in place only once complete; a failed write is one line saying what was kept
    (:func:`edge_spec.export.bundle.install.explained_os_errors`).
    """
    if checked:
        out_dir = Path(out_dir).expanduser().resolve()
    else:
        out_dir = check_before_build(target_source, draft_source, out_dir, options, progress, loader=loader)
    kept = (
        f"the existing bundle at {out_dir} was kept"
        if install.is_bundle(out_dir)
        else f"nothing was written to {out_dir}"
    )
    with install.explained_os_errors(out_dir, kept):
        staging = install.staging_dir(out_dir)
        try:
            manifest = _export_into(staging, target_source, draft_source, options, progress, loader)
            _install(staging, out_dir)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    return manifest


def check_before_build(
    target_source: str,
    draft_source: str,
    out_dir: str | Path,
    options: ExportOptions,
    progress=None,
    *,
    loader=load_model,
) -> Path:
    """Refuse in seconds what would otherwise fail minutes into an export, and return the resolved output
    directory: what a killed run left there is recovered (:func:`edge_spec.export.bundle.install.prepare`),
    then the directory (:func:`check_output_dir`), the options, the sources' existence and the pair
    (:func:`edge_spec.export.sources.pair.check_pair`, on what the sources say without their weights)."""
    install.prepare(Path(out_dir).expanduser().resolve(), progress)
    out_dir = check_output_dir(out_dir)
    options.check()
    if loader is load_model:
        for source in (target_source, draft_source):
            check_source_exists(source)
    check_pair(*_cards(target_source, draft_source, loader))
    return out_dir


def _cards(target_source: str, draft_source: str, loader) -> tuple[ModelCard, ModelCard]:
    """What the pair check reads of both sources before the build: their headers, config and tokenizer
    files when the real loader would load them (:func:`edge_spec.export.sources.pair.probe_pair`), else what
    ``loader`` gives (tests: models in memory)."""
    if loader is load_model:
        return probe_pair(target_source, draft_source)
    return ModelCard.of(loader(target_source)), ModelCard.of(loader(draft_source))


SANITY_PROMPT = "def fibonacci(n):\n    return"


def check_target_computes(bundle_dir: Path, manifest: dict, progress=None) -> None:
    """Refuse a bundle whose target computes nothing useful (a source whose tensor bytes are damaged
    converts without complaint): one short prefill of a few tokens must give finite logits that are
    not the same for every token."""
    from edge_spec.runtime.model.decoder import Decoder
    from edge_spec.runtime.text import TextTokenizer

    _say(progress, "checking the exported target on a short prompt")
    vocab = manifest["target"]["config"]["vocab_size"]
    ids = [i for i in TextTokenizer(bundle_dir).encode(SANITY_PROMPT) if 0 <= i < vocab][:8] or list(
        range(min(4, vocab))
    )
    capacity = min(manifest["context_length"], 64)
    decoder = Decoder(bundle_dir / manifest["target"]["onnx"], threads=1, capacity=capacity, takes_turns=True)
    try:
        logits = decoder.forward(ids[: capacity - 1], len(ids))["logits"]
    finally:
        del decoder
    source = manifest["target"]["source"]
    if not np.isfinite(logits).all():
        raise EdgeSpecError(
            f"the exported target produced NaN/inf logits on a test prompt: the weights of "
            f"{source} are damaged (check or fetch the file again); no bundle was written"
        )
    if float(np.min(np.ptp(logits, axis=-1))) <= 1e-6:
        raise EdgeSpecError(
            f"the exported target gives every token the same logit on a test prompt: the "
            f"weights of {source} are damaged or empty; no bundle was written"
        )


def _export_into(
    staging: Path, target_source: str, draft_source: str, options: ExportOptions, progress, loader
) -> dict:
    started = time.perf_counter()
    quant_info = {
        "weights": options.quant,
        "block_size": options.block_size,
        "accuracy_level": options.accuracy_level,
        "symmetric": True,
        "embedding": "GatherBlockQuantized" if options.quant != "fp32" else "Gather",
    }
    build = BuildOptions(
        options.quant,
        options.block_size,
        options.accuracy_level,
        options.context_length,
        gguf_blocks=carries_gguf_blocks(options, "target"),
        **layout_settings(chosen_layout(options, progress)),
    )

    stages = Stages(progress)
    with stages.step("loading the target", f"loading target {target_source}", needs=memory_needed(target_source)):
        target = loader(target_source)
        target_quant = _gguf_quant_info(target, quant_info, build, progress)
    with stages.step("building the target graph", f"building target graph ({options.quant})"):
        target_options = dataclasses.replace(build, tree_attention=True, attention_pad=True)
        export_decoder(target, staging, "target", target_options)
        save_tokenizer(target.tokenizer, target.eos_token_ids, staging)
        target_record = _model_record(target, staging, "target", target_quant)
        target_card = ModelCard.of(target)
        eos_ids = list(target.eos_token_ids)
        special_ids = list(getattr(target.tokenizer, "all_special_ids", []))
        del target  # before the check loads the graph into ONNX Runtime
        gc.collect()
    # before the drafter and the calibration text that the target generates: a target that computes
    # nothing is refused as such, not as an empty calibration later
    with stages.step("checking the target"):
        check_target_computes(staging, {"target": target_record, "context_length": options.context_length}, progress)
    kernels, library = None, native_target_library(staging, target_record)
    if library is not None:
        with stages.step("timing the native op's prefetches"):
            kernels = measure_native_kernels(staging / target_record["onnx"], library, options.context_length, progress)
    if options.prompt_reader and options.quant != "fp32":
        with stages.step("building the prompt reader", "building the int8 prompt graph"):
            add_prompt_reader(staging, target_record)
        from edge_spec.runtime.loaded import prompt_reader_pays

        if not prompt_reader_pays(target_record, "cpu"):
            _say(
                progress,
                "prompt reader: this CPU has no AMX, and the native op reads prompts about as fast here, so the "
                "runtime leaves the target's prompt graph unloaded on it (it pays on CPUs with AMX)",
            )

    with stages.step("loading the drafter", f"loading drafter {draft_source}", needs=memory_needed(draft_source)):
        draft = loader(draft_source)
        check_pair(target_card, ModelCard.of(draft))  # as probed before the build; the loaded models have the last word
        build = dataclasses.replace(
            build, gguf_blocks=carries_gguf_blocks(options, "draft"), block_size=options.draft_block_size
        )
        draft_quant = _gguf_quant_info(draft, dict(quant_info, block_size=options.draft_block_size), build, progress)
        body_build = dataclasses.replace(
            build, build_head=False, round_native=rounds_drafter_native(build, options, draft.weights.config)
        )
        if body_build.round_native:
            draft_quant = dict(draft_quant, gguf_layout="native", body="Q4_K")
            _say(progress, f"{draft.name}: body rounded to Q4_K under the native op (it reads its records ahead here)")
    with stages.step("building the drafter body", f"building drafter body ({options.quant})"):
        export_decoder(draft, staging, "draft", body_build, stem="body")
        draft_record = _model_record(draft, staging, "draft", draft_quant, "body")
        draft_record["parameters"] -= int(draft.weights.lm_head.size)  # body only; each head records its own
    if options.prompt_reader and options.quant != "fp32":  # what drafts is the drafter's: no exactness to keep
        with stages.step("building the drafter's prompt reader", "building the drafter's int8 prompt graph"):
            add_prompt_reader(staging, draft_record)
    with stages.step("building the drafter heads"):
        heads, files, calibration = export_draft_heads(
            staging,
            draft.weights.lm_head,
            options,
            build,
            always_keep=eos_ids + special_ids,
            progress=progress,
            lm_head_blocks=draft.weights.carried.get("lm_head") if build.gguf_blocks else None,
            target_source=target_record["source"],
        )
        del draft
        gc.collect()
    draft_record["heads"] = heads
    draft_record["default_head"] = default_head(heads, options)
    if calibration:
        draft_record["calibration"] = calibration
    draft_record["files"] += files
    draft_record["bytes"] = sum(f["bytes"] for f in draft_record["files"])
    stages.say_summary()

    manifest = _manifest(options, staging, target_record, draft_record, started)
    if kernels is not None:
        manifest["native_kernels"] = kernels
    write_manifest(staging, manifest)
    return manifest


def native_target_library(staging: Path, target: dict) -> Path | None:
    """The native library where the target's graph holds ``MatMulGGUF`` nodes and the op runs here, else None."""
    import onnx

    from edge_spec.runtime.model.native_attention import native_matmul_route

    graph = onnx.load(str(staging / target["onnx"]), load_external_data=False)
    return native_matmul_route(graph, "cpu")[0]


def measure_native_kernels(graph: Path, library: Path, context_length: int, progress=None) -> dict:
    """Which prefetches the target ``graph``'s passes on the native op ask for, each timed both ways on this
    machine (``kernel_choice``): the manifest's ``native_kernels``.  The choices are left set in this process,
    so the drafter's body below is built for them (``rounds_drafter_native``)."""
    from edge_spec.defaults import DEFAULT_THREADS
    from edge_spec.runtime.model.kernel_choice import measure_kernels, record_words

    record = measure_kernels(graph, library, threads=DEFAULT_THREADS, capacity=min(context_length, 128))
    _say(progress, record_words(record, "on this CPU"))
    return record


def _manifest(options: ExportOptions, staging: Path, target: dict, draft: dict, started: float) -> dict:
    """The bundle's manifest: its format, the version and time that made it, and both models' records."""
    return {
        "format": FORMAT,
        "edge_spec_version": __version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "context_length": options.context_length,
        "tokenizer": tokenizer_record(staging),
        "target": target,
        "draft": draft,
        "export_seconds": round(time.perf_counter() - started, 1),
    }


def _recorded_build(manifest: dict, options: ExportOptions) -> tuple[BuildOptions, ExportOptions]:
    """The drafter's build settings as the bundle records them, and ``options`` made to agree with them
    (heads added later are built as the bundle's drafter was)."""
    quant = manifest["target"]["quantization"]
    draft_quant = manifest["draft"].get("quantization", {})
    carried = isinstance(draft_quant.get("gguf_blocks"), dict)
    # a bundle from before the fast layout records none: its carried heads were exact
    block_size = draft_quant.get("block_size", quant["block_size"])  # the drafter's own blocks, where recorded
    build = BuildOptions(
        quant["weights"],
        block_size,
        quant["accuracy_level"],
        manifest["context_length"],
        gguf_blocks=carried,
        **layout_settings(draft_quant.get("gguf_layout")),
    )
    options = dataclasses.replace(
        options,
        quant=quant["weights"],
        block_size=block_size,
        draft_block_size=block_size,
        accuracy_level=quant["accuracy_level"],
        context_length=manifest["context_length"],
    )
    return build, options


def add_draft_heads(
    bundle_dir: Path, options: ExportOptions, draft_source: str | None = None, progress=None, *, loader=load_model
) -> dict:
    """Add (or rebuild) drafter heads in an existing bundle without re-exporting either model.

    The drafter's float LM head is reloaded from ``draft_source`` (default: the source recorded in
    the manifest); calibration text is reused from the bundle when it has some.  The work happens in
    a copy beside the bundle (hard links for the models) that replaces it only once complete, so an
    interrupted run leaves the bundle as it was.
    """
    from edge_spec.manifest import read_manifest

    bundle_dir = Path(bundle_dir).expanduser().resolve()
    install.prepare(bundle_dir, progress)
    manifest = read_manifest(bundle_dir)
    verify_files(bundle_dir, manifest)
    options.check()
    record = manifest["draft"]
    source = draft_source or record["source"].removeprefix("registry:")
    if loader is load_model:
        check_source_exists(source)
    _say(progress, f"loading drafter {source}")
    draft = loader(source)

    # through DecoderConfig: a bundle written before a config field existed has that field's default
    if draft.weights.config.to_dict() != DecoderConfig(**record["config"]).to_dict():
        raise EdgeSpecError(f"drafter {source} does not match the bundle's drafter ({record['name']})")
    build, options = _recorded_build(manifest, options)
    carried = build.gguf_blocks
    always = list(draft.eos_token_ids) + list(getattr(draft.tokenizer, "all_special_ids", []))
    with install.explained_os_errors(bundle_dir, f"the bundle at {bundle_dir} was kept as it was"):
        staging = _staged_copy(bundle_dir, manifest)
        try:
            heads, files, calibration = export_draft_heads(
                staging,
                draft.weights.lm_head,
                options,
                build,
                always_keep=always,
                progress=progress,
                lm_head_blocks=draft.weights.carried.get("lm_head") if carried else None,
                target_source=manifest["target"].get("source"),
            )
            written = {f["path"] for f in files}
            for name, head in list(record["heads"].items()):  # heads whose scorer or universe was just rewritten
                if name not in heads and any(head.get(k) in written for k in ("onnx", "universe", "vocab_ids")):
                    del record["heads"][name]
                    _say(progress, f"removed head {name}: files it uses were rebuilt for other heads")
            record["heads"].update(heads)
            if calibration:
                record["calibration"] = calibration
            record["files"] = [f for f in record["files"] if f["path"] not in written] + files
            record["bytes"] = sum(f["bytes"] for f in record["files"])
            default = default_head(heads, options)
            if default != "full":
                record["default_head"] = default
            write_manifest(staging, manifest)
            _install(staging, bundle_dir)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    return manifest
