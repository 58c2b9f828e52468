"""Making bundles: ``export`` (a bundle from a target and a drafter) and ``add-heads`` (more drafter and
EAGLE LM heads on an existing bundle)."""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import typer

from edge_spec import extras
from edge_spec.cli.groups import option, takes_groups
from edge_spec.cli.options import (
    DRAFT_SOURCE,
    DRAFT_VOCAB,
    EAGLE_SOURCE,
    EXPORT_DEFAULTS,
    HeadFlags,
    int_list,
    output_option,
)
from edge_spec.cli.output import console, progress_lines
from edge_spec.errors import EdgeSpecError
from edge_spec.export.bundle.options import ExportOptions


@dataclass(frozen=True)
class GraphFlags:
    """How the models' graphs are built: quantization, context, what GGUF sources keep."""

    quant: str = option(
        typer.Option(EXPORT_DEFAULTS.quant, help="Weight quantization: int4 (MatMulNBits), int8 or fp32.")
    )
    block_size: int = option(
        typer.Option(EXPORT_DEFAULTS.block_size, help="Quantization block size (the target's re-quantized matrices).")
    )
    draft_block_size: int = option(
        typer.Option(
            EXPORT_DEFAULTS.draft_block_size,
            help="The drafter's quantization block size: its rounding moves "
            "acceptance only, and larger blocks make a draft step faster.",
        )
    )
    accuracy_level: int = option(
        typer.Option(
            EXPORT_DEFAULTS.accuracy_level, help="MatMulNBits accuracy level (4 = int8 activations, 0 = fp32)."
        )
    )
    context_length: int = option(
        typer.Option(EXPORT_DEFAULTS.context_length, help="Maximum context (KV cache capacity, rotary table size).")
    )
    gguf_blocks: str = option(
        typer.Option(
            EXPORT_DEFAULTS.gguf_blocks,
            help="Which GGUF sources keep their quantized blocks in "
            "MatMulNBits (rounded once, by llama.cpp) instead of being re-quantized to "
            "--block-size blocks: target (default), both or none.",
        )
    )
    gguf_layout: str = option(
        typer.Option(
            EXPORT_DEFAULTS.gguf_layout,
            help="Carried GGUF blocks: auto (default: compact where edge-spec's native op runs on this machine, "
            "else lean), native (Q4_K and Q6_K blocks as GGUF's own bytes "
            "under edge-spec's native op, the rest as lean; where that op cannot run, no C++ compiler or no AVX2, "
            "the bundle is loaded in lean's form, converted at each load; the faithful choice there), compact (as "
            "native, with the layers' Q6_K blocks rounded to Q4_K: 5% fewer bytes a step, faster, top-1 agreement "
            "0.962 against native's 0.987), lean (as fast, with the LM head at 4 "
            "bits and each position's 64 best rows scored again at 8 bits), fast (Q6_K's 16-blocks "
            "merged into 32-blocks, the zero-point correction folded into the matmul, rounding "
            "far below GGUF's step; the faithful layout), exact (as GGUF has them; slower) or small (as fast, "
            "with every 8-bit block, Q6_K's, rounded to 4 bits: faster, less faithful).",
        )
    )
    prompt_reader: bool = option(
        typer.Option(
            EXPORT_DEFAULTS.prompt_reader,
            "--prompt-reader/--no-prompt-reader",
            help="The int8 prompt reader: add a second graph of the target and of the drafter that reads "
            "prompts through int8 matmuls (several times faster on long prompts, most on CPUs with AMX; for the "
            "default pair 1.6 GB more on disk and 2 GB more memory). Decoded tokens stay the decode graph's, "
            "but an answer may then differ from the decode graph's own at near-ties "
            "(docs/methods/prompt-reader.md).",
        )
    )


@takes_groups
def export(
    target: Optional[str] = typer.Option(None, help="Target source: registry name, GGUF file, HF directory or hub id."),
    draft: Optional[str] = typer.Option(
        None, help=f"{DRAFT_SOURCE}: the same kinds as --target; it must share the target's tokenizer."
    ),
    output: Optional[Path] = output_option(
        "the bundle's", "bundles/<target>-<quant> in the models directory, see edge-spec models"
    ),
    graph: GraphFlags = ...,
    draft_vocab: str = typer.Option(
        EXPORT_DEFAULTS.draft_vocab,
        help=f"{DRAFT_VOCAB}: comma list of full, trim "
        "(VocabTrim), specvocab, trim+specvocab; the first non-full one is the default "
        "head.",
    ),
    heads: HeadFlags = ...,
    eagle: Optional[str] = typer.Option(
        None,
        "--eagle",
        help=f"{EAGLE_SOURCE}: a SpecForge checkpoint "
        "(directory or hub id), a head saved from a bundle, or 'shipped' (the head "
        "the registry ships for this target). Default: none; the shipped head "
        "drafts slower than the drafter model (docs/methods/eagle3.md).",
    ),
    measure: bool = typer.Option(
        True,
        help="Afterwards, time the bundle on this machine with the default settings and cache the result, so "
        "that the first answer does not wait for it (--no-measure: when exporting for another machine).",
    ),
) -> None:
    """Export a target and a drafter into one quantized ONNX bundle."""
    extras.require("export", "export")
    from edge_spec.paths import bundle_dir, default_pair

    default_target, default_draft = default_pair()
    target = target or default_target
    draft = draft or default_draft
    output = output or bundle_dir(target, graph.quant)
    options = heads.export_options(draft_vocab, **dataclasses.asdict(graph))
    job = ExportJob(target, draft, output, options, eagle, measure)
    try:
        with _Screen("exporting") as screen:
            if _watched():
                _run_watched(job, screen)
            else:
                run_export(job, screen.show)
    except KeyboardInterrupt:  # said as one line by the command (typer would end it without a word)
        raise typer.Abort() from None


def _run_watched(job: ExportJob, screen: _Screen) -> None:
    """Check what the command can before the work starts, then run it in a child process it watches."""
    from edge_spec.export.bundle.build import check_before_build

    # here, not in the child: a refusal then takes the command's start, not a second interpreter's
    output = job.output
    job.output = check_before_build(
        job.target, job.draft, output, job.options, lambda line: screen.show(("progress", line))
    )
    job.checked = True
    from edge_spec.export.bundle import install, watchdog

    def cleanup() -> None:  # what a killed child left (a later export would remove it too)
        install.prepare(Path(output).expanduser().resolve())

    watchdog.run("edge_spec.cli.export:run_export", job, screen.show, kept=_kept_at(output), cleanup=cleanup)


@dataclass
class ExportJob:
    """What ``edge-spec export`` was asked for, its defaults filled in: handed to the process that does
    the work (see :func:`_watched`)."""

    target: str
    draft: str
    output: Path
    options: ExportOptions
    eagle: Optional[str]
    measure: bool
    checked: bool = False  # check_before_build has passed: the work starts building at once


def _watched() -> bool:
    """Whether the export runs in a child process that this one watches (:mod:`edge_spec.export.bundle.watchdog`:
    a kill by the out-of-memory killer is then said in one line instead of ``Killed``): where this
    process is the edge-spec command itself (its console script, ``python -m edge_spec.cli``) on a POSIX
    system.  A program that calls :func:`edge_spec.cli.main` itself (a test, an app) keeps the work in
    its own process, with its patches and in-memory models, and so does a frozen app (its executable
    runs no ``python -m``)."""
    from edge_spec import cli

    if os.name != "posix" or getattr(sys, "frozen", False):
        return False
    return getattr(sys.modules.get("__main__"), "main", None) is cli.main


def _kept_at(output: Path) -> str:
    """What is at ``output`` should the export stop before it installs the new bundle."""
    from edge_spec.export.bundle.install import is_bundle

    path = Path(output).expanduser().resolve()
    return f"the existing bundle at {path} was kept" if is_bundle(path) else f"nothing was written to {path}"


class _Screen:
    """The command's display of an export: a spinner, one line per step (``- ...``) and the lines said as
    they are.  What the work says (:meth:`show`'s payloads) comes from this process or from the watched
    child: ("progress", text), ("print", rich markup) or ("status", the spinner's text)."""

    def __init__(self, label: str) -> None:
        self._status = console.status(label)

    def __enter__(self) -> "_Screen":
        self._status.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._status.__exit__(*exc)

    def show(self, payload: tuple[str, str]) -> None:
        kind, text = payload
        if kind == "progress":
            console.print(f"[dim]-[/dim] {text}")
        if kind in ("progress", "status"):
            self._status.update(text)
        elif kind == "print":
            console.print(text)


def run_export(job: ExportJob, say: Callable[[tuple[str, str]], None]) -> None:
    """The export's work: the bundle, its EAGLE-3 head if asked, the measurement on this machine;
    everything it says goes to ``say`` (see :class:`_Screen`)."""
    from edge_spec.export.bundle import activity
    from edge_spec.export.bundle.build import export_bundle
    from edge_spec.export.bundle.install import explained_os_errors
    from edge_spec.export.eagle.attach import attach_eagle_source, shipped_eagle_head

    def progress(message: str) -> None:
        say(("progress", message))

    output, eagle = job.output, job.eagle
    if eagle == "shipped":
        eagle = shipped_eagle_head(job.target)
        if eagle is None:
            raise EdgeSpecError(f"the registry ships no EAGLE-3 head for {job.target}")
    elif eagle == "none":
        eagle = None
    manifest = export_bundle(job.target, job.draft, output, job.options, progress, checked=job.checked)
    activity.kept(f"the bundle at {output} was written")
    if eagle:
        without_head = (
            f"the bundle at {output} was exported without its EAGLE-3 head "
            f"(attach it later: edge-spec add-heads {output} --eagle {eagle})"
        )
        activity.step("attaching the EAGLE-3 head")
        activity.kept(without_head)
        with explained_os_errors(output, without_head):
            manifest = attach_eagle_source(output, eagle, progress)
    activity.kept(f"the bundle at {output} was written")
    mib = 1 << 20
    say(
        (
            "print",
            f"[green]bundle[/green] {output}: target {manifest['target']['bytes'] / mib:.0f} MiB, "
            f"drafter {manifest['draft']['bytes'] / mib:.0f} MiB, {manifest['export_seconds']} s",
        )
    )
    if job.measure:
        activity.step("measuring this machine for the bundle")
        activity.kept(f"the bundle at {output} was written (its first answer measures this machine instead)")
        _measure_machine(output, say)


LEARNING_PROMPTS = 3  # answers export gives after its measurement, so the schedule starts from this pair's rates
LEARNING_TOKENS = 96


def _measure_machine(bundle: Path, say: Callable[[tuple[str, str]], None]) -> None:
    """Time the new bundle on this machine, run its exactness checks and answer a few of the shipped
    calibration prompts, with the default settings: the first answer after an export then starts from
    cached verdicts, live-corrected costs and this pair's acceptance rates, as every later one does (the
    first load otherwise spends seconds on the first two, and the first answer plans from priors).  A
    failure here leaves a good bundle: it is said, not raised."""
    import time

    from edge_spec.export.heads.vocabtrim import load_prompts
    from edge_spec.runtime.engine import Engine

    started = time.perf_counter()
    say(("status", "measuring this machine's speed for the bundle (once)"))
    try:
        with Engine.from_bundle(bundle) as engine:
            engine.bundle.check_device()
            for prompt in load_prompts(None)[:LEARNING_PROMPTS]:
                messages = [{"role": "user", "content": prompt}]
                room = engine.bundle.target.capacity - len(engine.prompt_ids(messages, check_length=False))
                if room > LEARNING_TOKENS // 4:  # a context too short for it learns at the first answers
                    engine.complete(messages, max_new_tokens=min(LEARNING_TOKENS, room - 1))
    except EdgeSpecError as error:
        say(("print", f"[yellow]note[/yellow] the bundle was not measured on this machine: {error}"))
        return
    say(("print", f"[dim]-[/dim] measured this machine for the bundle in {time.perf_counter() - started:.1f} s"))


def _kept(bundle: Path, added: list[str]) -> str:
    """What a failed add-heads step leaves: the bundle as it was, or with what the steps before added."""
    return f"the bundle at {bundle} was kept " + (f"with {' and '.join(added)}" if added else "as it was")


@takes_groups
def add_heads(
    bundle: Path = typer.Argument(..., help="Bundle directory made by `edge-spec export`."),
    draft: Optional[str] = typer.Option(None, help=f"{DRAFT_SOURCE} (default: the one recorded in the bundle)."),
    draft_vocab: Optional[str] = typer.Option(
        None,
        help=f"{DRAFT_VOCAB} (to add): comma list of trim, specvocab, "
        "trim+specvocab (default specvocab, none with --eagle alone).",
    ),
    eagle: Optional[str] = typer.Option(
        None,
        "--eagle",
        help=f"{EAGLE_SOURCE} (as well as the drafter heads): a "
        "SpecForge checkpoint (directory or hub id) or a head saved from a bundle.",
    ),
    heads: HeadFlags = ...,
    eagle_trim: Optional[str] = typer.Option(
        None,
        "--eagle-trim",
        help="EAGLE head: VocabTrim LM heads keeping "
        "this many of its draft-vocabulary rows (comma list: one head per "
        "value), ranked by the calibration text.",
    ),
    eagle_specvocab: list[str] = typer.Option(
        [],
        "--eagle-specvocab",
        help="EAGLE head: a SpecVocab LM head, "
        "RANK:CANDIDATES (repeatable or comma list), its scorer fitted on "
        "the head's own hidden states (--scorer svd: data-free).",
    ),
) -> None:
    """Add drafter heads (VocabTrim, SpecVocab, an EAGLE-3 head, LM heads of the EAGLE head) to an existing
    bundle without re-exporting the models."""
    extras.require("add-heads", "export")
    from edge_spec.export.bundle.build import add_draft_heads
    from edge_spec.export.bundle.install import explained_os_errors, prepare
    from edge_spec.export.eagle.attach import attach_eagle_source
    from edge_spec.export.eagle.lm_heads import EagleHeadOptions, add_eagle_heads, parse_specvocab

    eagle_options = EagleHeadOptions(
        trim=int_list(eagle_trim, "--eagle-trim") if eagle_trim else (),
        specvocab=parse_specvocab(eagle_specvocab),
        scorer=heads.scorer,
        train_steps=heads.train_steps,
        calibration=heads.calibration,
    )
    eagle_variants = bool(eagle_options.trim or eagle_options.specvocab)
    if heads.calibration is not None and not heads.calibration.is_file():
        raise EdgeSpecError(f"calibration file not found: {heads.calibration}")
    with progress_lines("adding heads") as progress:
        prepare(bundle, progress)  # what a killed export or add-heads left at or beside the bundle
        added: list[str] = []  # what this run put in the bundle before a later step failed
        if draft_vocab or not (eagle or eagle_variants):
            manifest = add_draft_heads(bundle, heads.export_options(draft_vocab or "specvocab"), draft, progress)
            added.append("its new drafter heads")
        if eagle:
            with explained_os_errors(bundle, _kept(bundle, added)):
                manifest = attach_eagle_source(bundle, eagle, progress)
            added.append("the EAGLE-3 head")
        if eagle_variants:
            with explained_os_errors(bundle, _kept(bundle, added)):
                manifest = add_eagle_heads(bundle, eagle_options, progress)
    line = f"[green]heads[/green] {', '.join(manifest['draft']['heads'])}; default {manifest['draft']['default_head']}"
    if manifest.get("eagle"):
        line += (
            f"; EAGLE-3 head {manifest['eagle']['source']}: {', '.join(manifest['eagle'].get('heads', ['full']))}"
            f", default {manifest['eagle'].get('default_head', 'full')}"
        )
    console.print(line)
