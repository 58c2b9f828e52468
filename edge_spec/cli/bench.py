"""``bench``: decoding modes compared on one bundle, prompt by prompt (or session by session, turn by turn:
``--sessions``), against target-only decoding."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Optional

import typer

from edge_spec import extras
from edge_spec.cli.loading import (
    check_gamma,
    check_sampler,
    check_threads,
    find_bundle,
    loading_status,
    provider_options,
)
from edge_spec.cli.options import (
    DRAFT_HEAD,
    EAGLE_HEAD,
    TEMPERATURE,
    BundleArg,
    DraftProviderOpt,
    DraftThreadsOpt,
    ExactOpt,
    GammaOpt,
    ProviderOpt,
    ProviderOptionOpt,
    SamplerOpt,
    ScheduleOpt,
    ThreadsOpt,
    VerifyOpt,
    int_list,
    max_tokens_option,
    output_option,
    prompts_option,
)
from edge_spec.cli.output import console, out
from edge_spec.errors import EdgeSpecError
from edge_spec.runtime.loops.config import SsdConfig, TreeConfig
from edge_spec.runtime.verify.tree import VERIFIERS

# the words of --modes: the kinds of mode bench compares (each run per drafter head and γ as it says)
MODE_GROUPS = (
    (("ar",), "target only, the baseline of every speed-up (always run)"),
    (("ar-exact",), "greedy: target only in batch-invariant passes, the answer the exact modes must equal"),
    (("spec",), "the drafter model at the --schedule and at each --sweep γ, per --draft-head"),
    (("lookup",), "spec (and eagle) drafting by prompt lookup too, as modes +lookup"),
    (("suffix",), "spec drafting from the suffix cache too (the default chain's source), as modes +suffix"),
    (("ssd",), "speculative speculative decoding per --draft-head at each --sweep γ (else --gamma)"),
    (
        VERIFIERS,
        "multi-draft verified by that verifier, --drafts branches per step, per --draft-head at each "
        "--sweep γ (else --gamma)",
    ),
    (
        ("eagle",),
        "the bundle's EAGLE head (edge-spec train-head) at the --schedule and each --sweep γ, per --eagle-head",
    ),
    (("nocache",), "with --sessions: spec drafting from the request alone, without the suffix cache (spec-nocache)"),
)
MODE_KINDS = tuple(kind for kinds, _ in MODE_GROUPS for kind in kinds)
DEFAULT_MODES = ("ar", "ar-exact", "spec")
SESSION_MODES = ("ar", "ar-exact", "spec", "nocache")  # the kinds --sessions runs (and its default)


def _mode_kinds(text: str) -> set[str]:
    """The kinds ``--modes`` names."""
    kinds = {kind.strip() for kind in text.split(",") if kind.strip()}
    unknown = sorted(kinds - set(MODE_KINDS))
    if unknown:
        raise EdgeSpecError(f"--modes: unknown mode {unknown[0]!r}; choose from {', '.join(MODE_KINDS)}")
    return kinds


def _check_session_flags(kinds: set[str], given: dict[str, bool]) -> None:
    """Refuse, in one line, a --modes kind or a flag that --sessions cannot honour."""
    other = sorted(kinds - set(SESSION_MODES))
    if other:
        raise EdgeSpecError(f"--sessions compares {', '.join(SESSION_MODES)}; --modes {other[0]} applies to prompts")
    for flag, used in given.items():
        if used:
            raise EdgeSpecError(f"{flag} applies to prompt benchmarks, not --sessions")


def bench(
    ctx: typer.Context,
    bundle: Optional[Path] = BundleArg,
    modes: Optional[str] = typer.Option(
        None,
        "--modes",
        help=f"Modes to compare (comma list; default {','.join(DEFAULT_MODES)}, with --sessions "
        f"{','.join(SESSION_MODES)}): " + "; ".join(f"{', '.join(kinds)}: {what}" for kinds, what in MODE_GROUPS) + ".",
        show_default=False,
    ),
    max_tokens: int = max_tokens_option(
        64, "; with --sessions, when given, at most this many per turn (default: each session's max_tokens)"
    ),
    temperature: list[float] = typer.Option(
        [0.0, 0.7], "--temperature", help=f"{TEMPERATURE}; repeatable: every mode runs at each."
    ),
    sampler: str = SamplerOpt,
    gamma: Optional[int] = GammaOpt,
    schedule: Optional[str] = ScheduleOpt,
    draft_head: list[str] = typer.Option(
        [],
        "--draft-head",
        help=f"{DRAFT_HEAD}; repeatable: the heads compared (default: all; with --sessions the bundle's default head).",
    ),
    eagle_head: list[str] = typer.Option(
        [],
        "--eagle-head",
        help=f"{EAGLE_HEAD}; repeatable: the heads compared "
        "in --modes eagle, as eagle (full) and eagle+NAME (default: the bundle's "
        "default EAGLE LM head).",
    ),
    sweep: Optional[str] = typer.Option(
        None, help="Also run these fixed γ values per head (comma list), next to the --schedule mode."
    ),
    drafts: Optional[int] = typer.Option(
        None,
        "--drafts",
        help=f"Drafts per step (the multi-draft modes {', '.join(VERIFIERS)}; default {TreeConfig.drafts}).",
    ),
    category: list[str] = typer.Option(
        [], help="Only these categories (repeatable); `long` (code files of ~2,000 tokens) runs only when named."
    ),
    per_category: Optional[int] = typer.Option(None, help="At most this many prompts per category."),
    repeat: int = typer.Option(
        1,
        "--repeat",
        help="Run every prompt this many times in all modes (interleaved) "
        "and keep each mode's fastest run: steadier ratios on a busy machine.",
    ),
    prompts: Optional[Path] = prompts_option("the shipped bench set"),
    sessions: bool = typer.Option(
        False,
        "--sessions",
        help="Replay session workloads instead of prompts: each mode answers every session turn by turn, "
        "its answers feeding its own later turns, on a suffix cache emptied before each session "
        "(--session-file; default: the shipped sessions). Writes sessions.json.",
    ),
    session_file: Optional[Path] = typer.Option(
        None,
        "--session-file",
        help="Session file (.jsonl, one session a line; see benchmarks/README.md); implies --sessions.",
        show_default=False,
    ),
    warm: bool = typer.Option(
        False,
        "--warm",
        help="Keep what the suffix cache learnt: with --sessions, across sessions (emptied once per mode); with "
        "prompts, each answer starts with the earlier prompts' ar answers in it (default: empty).",
    ),
    seed: Optional[int] = typer.Option(
        None,
        "--seed",
        help="Random seed (bench: the i-th prompt, or the i-th turn of the session file, samples with "
        "seed + i; default 0).",
    ),
    output: Optional[Path] = output_option(
        "bench.json and bench.png (with --sessions: sessions.json)",
        "bench-results, under $EDGE_SPEC_HOME when that is set",
    ),
    threads: int = ThreadsOpt,
    draft_threads: Optional[int] = DraftThreadsOpt,
    provider: str = ProviderOpt,
    draft_provider: Optional[str] = DraftProviderOpt,
    provider_option: list[str] = ProviderOptionOpt,
    exact: Optional[bool] = ExactOpt,
    verify: bool = VerifyOpt,
) -> None:
    """Compare decoding modes (--modes) per category: τ, MBSU, tokens/s, speed-up against ar.

    τ = tokens emitted per target pass.  MBSU = memory-bound speed-up, τ / (c·γ + 1), with c the drafter's
    parameters per target parameter and γ the mean draft length: the speed-up if every pass cost only the
    reading of its weights (a CPU whose passes are compute-bound falls short of it; tok/s and the speed-up
    against ar are measured)."""
    from rich.progress import Progress

    from edge_spec.bench.runs import (
        format_table,
        load_bench_prompts,
        modes_for,
        per_prompt_report,
        per_prompt_schedule,
        plot,
        run_bench,
        schedule_report,
    )
    from edge_spec.paths import bench_results_dir
    from edge_spec.runtime.engine import Engine
    from edge_spec.runtime.loops.config import loop_config
    from edge_spec.runtime.verify.sampling import SamplingParams

    # every flag is checked before the (slow) engine load
    sessions = sessions or session_file is not None
    kinds = _mode_kinds(modes or ",".join(SESSION_MODES if sessions else DEFAULT_MODES))
    if sessions:
        given = {"--prompts": prompts, "--sweep": sweep, "--drafts": drafts, "--eagle-head": eagle_head or None}
        _check_session_flags(kinds, {flag: value is not None for flag, value in given.items()})
    elif "nocache" in kinds:
        raise EdgeSpecError("--modes nocache applies to --sessions")
    bundle = find_bundle(bundle)
    output = output or bench_results_dir()
    check_threads(threads, draft_threads)
    options = provider_options(provider_option)
    if repeat < 1:
        raise EdgeSpecError("--repeat must be at least 1")
    if max_tokens < 1:
        raise EdgeSpecError("--max-tokens must be at least 1")
    if per_category is not None and per_category < 1:
        raise EdgeSpecError("--per-category must be at least 1")
    if eagle_head and "eagle" not in kinds:
        raise EdgeSpecError("--eagle-head applies to --modes eagle")
    for t in temperature:
        SamplingParams(temperature=t)  # raises on a bad value
    chain = loop_config("spec", gamma=gamma, schedule=schedule, lookup=False)  # the run's schedule
    check_gamma(bundle, chain)
    if output.exists() and not output.is_dir():
        raise EdgeSpecError(f"--output {output} is not a directory")
    if sessions:
        from edge_spec.bench.sessions import load_sessions, select_sessions

        items = select_sessions(load_sessions(session_file), category or None, per_category)
    else:
        items = load_bench_prompts(prompts, category or None, per_category)
    gammas = list(int_list(sweep, "--sweep")) if sweep else None
    if gammas and min(gammas) < 1:
        raise EdgeSpecError("--sweep values must be at least 1")
    trees = [
        TreeConfig(gamma=g, drafts=drafts or TreeConfig.drafts, verifier=v)
        for v in VERIFIERS
        if v in kinds
        for g in (gammas or [gamma or TreeConfig.gamma])
    ]
    ssds = [SsdConfig(gamma=g) for g in (gammas or [gamma or SsdConfig.gamma])] if "ssd" in kinds else []
    check_sampler(sampler, list(temperature), [chain, *trees, *ssds])
    with loading_status():
        engine = Engine.from_bundle(
            bundle,
            provider=provider,
            threads=threads,
            config=chain,
            draft_threads=draft_threads,
            exact=exact,
            verify=verify,
            draft_provider=draft_provider,
            provider_options=options,
        )
        # the ar baseline is our fastest target-only decoding: an engine loaded for it alone
        baseline = Engine.from_bundle(bundle, provider=provider, threads=threads, mode="ar", provider_options=options)
    engine.complete("warm up", max_new_tokens=4)
    baseline.complete("warm up", max_new_tokens=4)
    engine.complete("warm up", max_new_tokens=4, mode="ar", exact=True)
    if sessions:
        from edge_spec.bench.session_runs import session_modes

        with_tools = next((s for s in items if s["tools"]), None)
        if with_tools is not None and not engine.tokenizer.takes_tools:
            raise EdgeSpecError(
                f"session {with_tools['id']!r} passes tools, but this model's chat template takes no tools "
                f"(leave its category out: --category)"
            )
        compared = session_modes(
            engine,
            draft_head or None,
            gamma=gamma,
            schedule=schedule,
            reference="ar-exact" in kinds,
            spec="spec" in kinds,
            nocache="nocache" in kinds,
        )
        # by name: recent typer runs on a copy of click of its own, whose enum is not click's
        given = getattr(ctx.get_parameter_source("max_tokens"), "name", None) == "COMMANDLINE"
        _bench_sessions(
            engine,
            baseline,
            items,
            compared,
            temperatures=list(temperature),
            max_new_tokens=max_tokens if given else None,
            seed=seed or 0,
            repeats=repeat,
            warm=warm,
            sampler=sampler,
            output=output,
            bundle=bundle,
            threads=threads,
        )
        return
    compared = modes_for(
        engine,
        draft_head or None,
        chain,
        gammas,
        trees,
        ssds,
        lookup="lookup" in kinds,
        suffix="suffix" in kinds,
        reference="ar-exact" in kinds,
        eagle="eagle" in kinds,
        eagle_heads=eagle_head or None,
        spec="spec" in kinds,
    )
    with Progress(console=console, transient=True) as bar:
        task = bar.add_task("bench", total=len(items) * len(temperature))
        result = run_bench(
            engine,
            items,
            compared,
            temperatures=list(temperature),
            max_new_tokens=max_tokens,
            repeats=repeat,
            baseline=baseline,
            sampler=sampler,
            seed=seed or 0,
            progress=lambda done, total: bar.update(task, completed=done),
            warm=warm,
        )
    out.print(format_table(result["summary"]))
    if sweep:
        out.print(schedule_report(result["summary"]))
        result["per_prompt_schedule"] = per_prompt_schedule(result["records"])
        out.print(per_prompt_report(result["per_prompt_schedule"]))
    _write_result(result, engine, output / "bench.json", bundle, threads)
    if plot(result["summary"], output / "bench.png"):
        console.print(f"[dim]wrote {output / 'bench.json'} and {output / 'bench.png'}[/dim]")
    else:
        console.print(f"[dim]wrote {output / 'bench.json'}[/dim]")
        console.print(
            f"plot skipped: matplotlib is not installed (the bench extra: {extras.install_line('bench')}, "
            "or pip install matplotlib)",
            markup=False,
            highlight=False,
        )


def _bench_sessions(
    engine,
    baseline,
    chosen: list[dict],
    compared: list,
    *,
    temperatures: list[float],
    max_new_tokens: Optional[int],
    seed: int,
    repeats: int,
    warm: bool,
    sampler: str,
    output: Path,
    bundle: Path,
    threads: int,
) -> None:
    """``bench --sessions``: replay ``chosen`` in the ``compared`` modes, print the tables, write
    sessions.json, and fail loudly where a greedy answer differs from ar-exact's."""
    from rich.progress import Progress

    from edge_spec.bench.runs import format_table
    from edge_spec.bench.session_runs import cache_report, run_sessions

    with Progress(console=console, transient=True) as bar:
        task = bar.add_task("sessions", total=sum(len(s["turns"]) for s in chosen) * len(temperatures))
        result = run_sessions(
            engine,
            chosen,
            compared,
            temperatures=temperatures,
            max_new_tokens=max_new_tokens,
            seed=seed,
            repeats=repeats,
            warm=warm,
            baseline=baseline,
            sampler=sampler,
            progress=lambda done, total: bar.update(task, completed=done),
        )
    out.print(format_table(result["summary"]))
    report = cache_report(result["summary"])
    if report:
        out.print("\nsuffix cache (decode tokens/s; first token: mean time to the first token):\n" + report)
    result["sessions"] = [s["id"] for s in chosen]
    _write_result(result, engine, output / "sessions.json", bundle, threads)
    console.print(f"[dim]wrote {output / 'sessions.json'}[/dim]")
    if result["mismatches"]:
        for line in result["mismatches"]:
            console.print(f"[bold red]NOT LOSSLESS[/bold red] {line}", highlight=False)
        raise typer.Exit(1)


def _write_result(result: dict, engine, path: Path, bundle: Path, threads: int) -> None:
    """Write a bench result to ``path`` with the run's setting: bundle, threads, the cost profile the γ
    policy planned with (of the last head) and what target passes cost during the run."""
    path.parent.mkdir(parents=True, exist_ok=True)
    result["bundle"] = str(bundle)
    result["threads"] = threads
    result["cost_profile"] = dataclasses.asdict(engine.cost_profile) if engine.cost_profile else None
    stats = engine.target.stats
    result["target_pass_seconds"] = {n: stats.seconds[n] / stats.calls[n] for n in sorted(stats.calls) if n <= 16}
    path.write_text(json.dumps(result, indent=1))
