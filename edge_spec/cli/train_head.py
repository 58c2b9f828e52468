"""``train-head``: an EAGLE-3 drafter head trained for a bundle's target on this machine's CPU."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import typer

from edge_spec import extras
from edge_spec.cli.groups import option, takes_groups
from edge_spec.cli.loading import check_threads
from edge_spec.cli.options import ThreadsOpt, int_list, max_tokens_option, prompts_option
from edge_spec.cli.output import console, progress_lines
from edge_spec.errors import EdgeSpecError
from edge_spec.train.settings import CHECKPOINT_SECONDS, CollectOptions, TrainOptions

COLLECT_DEFAULTS = CollectOptions()
TRAIN_DEFAULTS = TrainOptions()


def _collect_reporter(stack: contextlib.ExitStack):
    """Per-item progress of feature collection: a rich bar on a terminal, one line per item otherwise
    (logs of background runs)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    if console.is_terminal:
        bar = stack.enter_context(
            Progress(
                TextColumn("collect"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[info]}"),
                TimeElapsedColumn(),
                TextColumn("ETA {task.fields[eta]}"),
                console=console,
            )
        )
        task = bar.add_task("collect", total=None, info="", eta="?")

        def report(r: dict) -> None:
            bar.update(
                task,
                completed=r["done"],
                total=r["total"],
                eta=_clock(r["eta"]),
                info=f"{r['tokens']['train']} train / {r['tokens']['held_out']} held-out tokens, {r['rate']:.0f} tok/s",
            )

        return report

    def report(r: dict) -> None:
        console.print(
            f"collect {r['done']}/{r['total']} {r['kind']} +{r['labelled']}: "
            f"{r['tokens']['train']} train / {r['tokens']['held_out']} held-out tokens, "
            f"{r['rate']:.1f} tok/s, elapsed {_clock(r['elapsed'])}, ETA {_clock(r['eta'])}",
            highlight=False,
            markup=False,
        )

    return report


def _clock(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


@dataclass(frozen=True)
class CollectFlags:
    """What the head learns from: the target's features over its answers to prompts and over text files."""

    text: list[Path] = option(
        typer.Option(None, "--text", help="Directory of code / prose files to read (repeatable).")
    )
    prompts: Optional[Path] = option(prompts_option("the shipped set, edge_spec/data/train/prompts.jsonl"))
    no_prompts: bool = option(typer.Option(False, "--no-prompts", help="Collect from --text only."))
    max_items: Optional[int] = option(
        typer.Option(COLLECT_DEFAULTS.max_items, help="Collect at most this many items (prompts + text windows).")
    )
    max_tokens: int = option(max_tokens_option(COLLECT_DEFAULTS.answer_tokens, ": the target's, to each prompt"))
    held_out_every: int = option(
        typer.Option(COLLECT_DEFAULTS.held_out_every, help="Hold out every n-th prompt and every n-th text file.")
    )

    def check(self) -> None:
        if self.no_prompts and self.prompts is not None:
            raise EdgeSpecError("--no-prompts and --prompts exclude each other")


@dataclass(frozen=True)
class TrainFlags:
    """The head and how it is trained."""

    vocab_size: int = option(
        typer.Option(
            TRAIN_DEFAULTS.draft_vocab,
            "--vocab-size",
            help="Vocabulary size K of the head's drafts (the K most frequent target labels).",
        )
    )
    intermediate: int = option(typer.Option(TRAIN_DEFAULTS.intermediate, help="Head MLP width."))
    epochs: float = option(
        typer.Option(TRAIN_DEFAULTS.epochs, help="Passes over the training data (when --steps is not given).")
    )
    steps: Optional[int] = option(
        typer.Option(
            TRAIN_DEFAULTS.steps,
            help="Optimizer steps (one training sequence each); with --resume: "
            "continue to this many steps, the schedule stretched (a warm restart).",
        )
    )
    ttt: int = option(typer.Option(TRAIN_DEFAULTS.ttt, help="Training-time-test steps unrolled (1 = off)."))
    lr: float = option(typer.Option(TRAIN_DEFAULTS.lr, help="Peak learning rate (AdamW, warm-up then cosine)."))
    hard_labels: bool = option(
        typer.Option(
            not TRAIN_DEFAULTS.soft,
            "--hard-labels",
            help="Cross-entropy on the greedy label instead of the target's distribution over the draft vocabulary.",
        )
    )
    seed: int = option(
        typer.Option(TRAIN_DEFAULTS.seed, help="Random seed (fixes the head's initialisation and the data order).")
    )
    init: Optional[str] = option(
        typer.Option(
            TRAIN_DEFAULTS.init,
            "--init",
            help="Start from this head instead of a fresh one: a saved "
            "head (e.g. edge_spec/data/heads/NAME, or a bundle's eagle/ directory), a "
            "SpecForge checkpoint or a hub id; its draft vocabulary and width are kept.",
        )
    )

    def options(self) -> TrainOptions:
        return TrainOptions(
            draft_vocab=self.vocab_size,
            intermediate=self.intermediate,
            epochs=self.epochs,
            steps=self.steps,
            ttt=self.ttt,
            lr=self.lr,
            soft=not self.hard_labels,
            seed=self.seed,
            init=str(self.init) if self.init else None,
        )


@dataclass(frozen=True)
class RunFlags:
    """Where the run keeps its work, which stages it runs and for how long."""

    work: Optional[Path] = option(
        typer.Option(None, help="Working directory (default: eagle-work in the models directory).")
    )
    resume: bool = option(typer.Option(False, "--resume", help="Continue the training run checkpointed in WORK."))
    collect_only: bool = option(typer.Option(False, "--collect-only", help="Collect features, do not train."))
    train_only: bool = option(typer.Option(False, "--train-only", help="Train on the features already collected."))
    collect_minutes: Optional[float] = option(typer.Option(None, help="Start no new collection item after this long."))
    train_minutes: Optional[float] = option(
        typer.Option(None, help="Stop training after this long (checkpointed; --resume continues).")
    )
    checkpoint_minutes: float = option(
        typer.Option(CHECKPOINT_SECONDS / 60, help="Minutes between training checkpoints.")
    )
    feature_layers: Optional[str] = option(
        typer.Option(
            None,
            help="Target layers whose outputs the head fuses "
            "(three, comma-separated; default SpecForge's (1, L/2-1, L-4)).",
        )
    )
    threads: int = option(ThreadsOpt)
    attach: bool = option(typer.Option(True, "--attach/--no-attach", help="Attach the trained head (int4) to BUNDLE."))

    def check(self) -> None:
        if self.collect_only and self.train_only:
            raise EdgeSpecError("--collect-only and --train-only exclude each other")

    def layers(self) -> tuple[int, ...] | None:
        """The --feature-layers given (None: the default three)."""
        layers = int_list(self.feature_layers, "--feature-layers") if self.feature_layers else None
        if layers is not None and len(layers) != 3:
            raise EdgeSpecError("--feature-layers takes three layer indices")
        return layers


@takes_groups
def train_head(
    bundle: Path = typer.Argument(..., help="Bundle directory whose target the head drafts for."),
    collect: CollectFlags = ...,
    train: TrainFlags = ...,
    run: RunFlags = ...,
) -> None:
    """Train an EAGLE-3 drafter head for BUNDLE's target on this machine's CPU.

    Collects the target's features over its own answers to a prompt set and over --text files
    (resumable: WORK/progress.json, WORK/shards/), trains the head (resumable: WORK/train/,
    --resume), writes it in SpecForge format to WORK/specforge/ and attaches it to the bundle."""
    extras.require("train-head", "export")
    work, layers = _checked(bundle, collect, run)
    if not run.train_only:
        _collect(bundle, work, layers, collect, train.seed, run)
    if run.collect_only:
        return
    trainer, specforge = _train(bundle, work, train, run)
    if run.attach:
        _attach(bundle, trainer, specforge)


def _checked(bundle: Path, collect: CollectFlags, run: RunFlags) -> tuple[Path, tuple[int, ...] | None]:
    """Every flag and the bundle checked before any work: the working directory and the feature layers."""
    from edge_spec.export.bundle.install import prepare
    from edge_spec.manifest import read_manifest
    from edge_spec.paths import models_dir
    from edge_spec.train import trainer as head_training

    run.check()
    collect.check()
    check_threads(run.threads)
    for minutes, flag in ((run.collect_minutes, "--collect-minutes"), (run.train_minutes, "--train-minutes")):
        if minutes is not None and minutes < 0:
            raise EdgeSpecError(f"{flag} must not be negative")
    prepare(bundle, lambda message: console.print(message, highlight=False, markup=False))  # killed runs' leftovers
    read_manifest(bundle)  # a missing bundle is a one-line error before any work
    layers = run.layers()
    work = run.work or models_dir() / "eagle-work"
    checkpoint = work / "train" / head_training.CHECKPOINT
    if not run.collect_only and not run.resume and checkpoint.is_file():
        raise EdgeSpecError(
            f"{checkpoint} exists: pass --resume to continue that run, or delete {checkpoint.parent} to train afresh"
        )
    work.mkdir(parents=True, exist_ok=True)
    return work, layers


def _collect(bundle: Path, work: Path, layers, collect: CollectFlags, seed: int, run: RunFlags) -> None:
    """Collect the target's features into ``work`` (resumable), with a progress bar or lines."""
    from edge_spec.train import features as head_data

    options = CollectOptions(
        answer_tokens=collect.max_tokens,
        max_items=collect.max_items,
        threads=run.threads,
        held_out_every=collect.held_out_every,
        seed=seed,
        time_budget=None if run.collect_minutes is None else run.collect_minutes * 60,
    )
    options.check()
    with contextlib.ExitStack() as stack:
        report = _collect_reporter(stack)
        result = head_data.collect(
            bundle,
            work,
            prompts=False if collect.no_prompts else collect.prompts,
            text_dirs=collect.text or (),
            options=options,
            report=report,
            layers=layers,
        )
    totals = result["totals"]
    console.print(
        f"collected {totals['items']} items: {totals['train']} training / {totals['held_out']} "
        f"held-out tokens in {_clock(result['seconds'])}"
        + (f"; {result['pending']} items not collected yet (run again to continue)" if result["pending"] else ""),
        highlight=False,
    )


def _train(bundle: Path, work: Path, train: TrainFlags, run: RunFlags):
    """Train the head on the collected features and write it in SpecForge format: (trainer, its path)."""
    from edge_spec.export.eagle.model import save_specforge
    from edge_spec.train import trainer as head_training

    target = head_training.Target.from_work(bundle, work)
    trainer = head_training.train(
        work,
        target,
        train.options(),
        resume=run.resume,
        threads=run.threads,
        extend_steps=train.steps if run.resume else None,
        time_budget=None if run.train_minutes is None else run.train_minutes * 60,
        checkpoint_seconds=run.checkpoint_minutes * 60,
        log=lambda message: console.print(message, highlight=False, markup=False),
    )
    final = trainer.curve[-1] if trainer.curve else {}
    if trainer.step < trainer.total_steps:
        console.print(
            f"training stopped at step {trainer.step}/{trainer.total_steps}; "
            "run again with --train-only --resume to continue",
            highlight=False,
        )
    specforge = save_specforge(work / "specforge", trainer.config, trainer.head)
    console.print(
        f"wrote {specforge} (SpecForge format); held-out acceptance step 1 "
        f"{final.get('acceptance_1', 0):.1%}, step 2 {final.get('acceptance_2', 0):.1%}; "
        f"curve: {trainer.dir / head_training.CURVE}",
        highlight=False,
    )
    return trainer, specforge


def _attach(bundle: Path, trainer, specforge: Path) -> None:
    """Attach the trained head (int4) to the bundle; on failure the bundle is kept as it was."""
    from edge_spec.export.bundle.install import explained_os_errors
    from edge_spec.export.eagle.attach import attach_eagle_head

    kept = (
        f"the bundle at {bundle} was kept as it was; the trained head is in {specforge} (attach it "
        f"with edge-spec add-heads {bundle} --eagle {specforge})"
    )
    with progress_lines("attaching the EAGLE-3 head") as progress, explained_os_errors(bundle, kept):
        attach_eagle_head(bundle, trainer.config, trainer.head.eval(), source=str(specforge), progress=progress)
    console.print(f"attached the EAGLE-3 head to {bundle}", highlight=False)
