"""``bench``: decoding modes compared on one bundle, prompt by prompt (or session by session, turn by turn:
``--sessions``), against target-only decoding.  The flags are declared here; the work is
:mod:`edge_spec.bench.command`'s."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import typer

from edge_spec.bench.modes import DEFAULT_MODES, SESSION_MODES, mode_groups
from edge_spec.cli.groups import option, takes_groups
from edge_spec.cli.options import (
    DRAFT_HEAD,
    EAGLE_HEAD,
    TEMPERATURE,
    BundleArg,
    DraftThreadsOpt,
    ExactOpt,
    GammaOpt,
    LoadFlags,
    SamplerOpt,
    ScheduleOpt,
    max_tokens_option,
    output_option,
    prompts_option,
)
from edge_spec.runtime.loops.config import TreeConfig
from edge_spec.runtime.verify.tree import VERIFIERS


@dataclass(frozen=True)
class BenchFlags:
    """What ``bench`` compares, on what, and where it writes."""

    modes: Optional[str] = option(
        typer.Option(
            None,
            "--modes",
            help=f"Modes to compare (comma list; default {','.join(DEFAULT_MODES)}, with --sessions "
            f"{','.join(SESSION_MODES)}): "
            + "; ".join(f"{', '.join(kinds)}: {what}" for kinds, what in mode_groups())
            + ".",
            show_default=False,
        )
    )
    max_tokens: int = option(
        max_tokens_option(
            64, "; with --sessions, when given, at most this many per turn (default: each session's max_tokens)"
        )
    )
    temperature: list[float] = option(
        typer.Option([0.0, 0.7], "--temperature", help=f"{TEMPERATURE}; repeatable: every mode runs at each.")
    )
    sampler: str = option(SamplerOpt)
    gamma: Optional[int] = option(GammaOpt)
    schedule: Optional[str] = option(ScheduleOpt)
    draft_head: list[str] = option(
        typer.Option(
            [],
            "--draft-head",
            help=f"{DRAFT_HEAD}; repeatable: the heads compared (default: all; with --sessions the bundle's "
            "default head).",
        )
    )
    eagle_head: list[str] = option(
        typer.Option(
            [],
            "--eagle-head",
            help=f"{EAGLE_HEAD}; repeatable: the heads compared "
            "in --modes eagle, as eagle (full) and eagle+NAME (default: the bundle's "
            "default EAGLE LM head).",
        )
    )
    sweep: Optional[str] = option(
        typer.Option(None, help="Also run these fixed γ values per head (comma list), next to the --schedule mode.")
    )
    drafts: Optional[int] = option(
        typer.Option(
            None,
            "--drafts",
            help=f"Drafts per step (the multi-draft modes {', '.join(VERIFIERS)}; default {TreeConfig.drafts}).",
        )
    )
    category: list[str] = option(
        typer.Option(
            [], help="Only these categories (repeatable); `long` (code files of ~2,000 tokens) runs only when named."
        )
    )
    per_category: Optional[int] = option(typer.Option(None, help="At most this many prompts per category."))
    repeat: int = option(
        typer.Option(
            1,
            "--repeat",
            help="Run every prompt this many times in all modes (interleaved) "
            "and keep each mode's fastest run: steadier ratios on a busy machine.",
        )
    )
    prompts: Optional[Path] = option(prompts_option("the shipped bench set"))
    sessions: bool = option(
        typer.Option(
            False,
            "--sessions",
            help="Replay session workloads instead of prompts: each mode answers every session turn by turn, "
            "its answers feeding its own later turns, on a suffix cache emptied before each session "
            "(--session-file; default: the shipped sessions). Writes sessions.json.",
        )
    )
    session_file: Optional[Path] = option(
        typer.Option(
            None,
            "--session-file",
            help="Session file (.jsonl, one session a line; see benchmarks/README.md); implies --sessions.",
            show_default=False,
        )
    )
    warm: bool = option(
        typer.Option(
            False,
            "--warm",
            help="Keep what the suffix cache learnt: with --sessions, across sessions (emptied once per mode); "
            "with prompts, each answer starts with the earlier prompts' ar answers in it (default: empty).",
        )
    )
    seed: Optional[int] = option(
        typer.Option(
            None,
            "--seed",
            help="Random seed (bench: the i-th prompt, or the i-th turn of the session file, samples with "
            "seed + i; default 0).",
        )
    )
    output: Optional[Path] = option(
        output_option(
            "bench.json and bench.png (with --sessions: sessions.json)",
            "bench-results, under $EDGE_SPEC_HOME when that is set",
        )
    )
    draft_threads: Optional[int] = option(DraftThreadsOpt)
    exact: Optional[bool] = option(ExactOpt)


@takes_groups
def bench(
    ctx: typer.Context,
    bundle: Optional[Path] = BundleArg,
    flags: BenchFlags = ...,
    load: LoadFlags = ...,
) -> None:
    """Compare decoding modes (--modes) per category: τ, MBSU, tokens/s, speed-up against ar.

    τ = tokens emitted per target pass.  MBSU = memory-bound speed-up, τ / (c·γ + 1), with c the drafter's
    parameters per target parameter and γ the mean draft length: the speed-up if every pass cost only the
    reading of its weights (a CPU whose passes are compute-bound falls short of it; tok/s and the speed-up
    against ar are measured)."""
    from edge_spec.bench.command import bench as run

    # by name: recent typer runs on a copy of click of its own, whose enum is not click's
    given = getattr(ctx.get_parameter_source("max_tokens"), "name", None) == "COMMANDLINE"
    run(bundle, flags, load, max_tokens_given=given)
