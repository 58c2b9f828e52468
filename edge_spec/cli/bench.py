"""``bench``: decoding modes compared on one bundle, prompt by prompt, against target-only decoding."""

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
)
MODE_KINDS = tuple(kind for kinds, _ in MODE_GROUPS for kind in kinds)
DEFAULT_MODES = ("ar", "ar-exact", "spec")


def _mode_kinds(text: str) -> set[str]:
    """The kinds ``--modes`` names."""
    kinds = {kind.strip() for kind in text.split(",") if kind.strip()}
    unknown = sorted(kinds - set(MODE_KINDS))
    if unknown:
        raise EdgeSpecError(f"--modes: unknown mode {unknown[0]!r}; choose from {', '.join(MODE_KINDS)}")
    return kinds


def bench(
    bundle: Optional[Path] = BundleArg,
    modes: str = typer.Option(
        ",".join(DEFAULT_MODES),
        "--modes",
        help="Modes to compare (comma list): "
        + "; ".join(f"{', '.join(kinds)}: {what}" for kinds, what in MODE_GROUPS)
        + ".",
    ),
    max_tokens: int = max_tokens_option(64),
    temperature: list[float] = typer.Option(
        [0.0, 0.7], "--temperature", help=f"{TEMPERATURE}; repeatable: every mode runs at each."
    ),
    sampler: str = SamplerOpt,
    gamma: Optional[int] = GammaOpt,
    schedule: Optional[str] = ScheduleOpt,
    draft_head: list[str] = typer.Option(
        [], "--draft-head", help=f"{DRAFT_HEAD}; repeatable: the heads compared (default: all)."
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
    category: list[str] = typer.Option([], help="Only these categories (repeatable)."),
    per_category: Optional[int] = typer.Option(None, help="At most this many prompts per category."),
    repeat: int = typer.Option(
        1,
        "--repeat",
        help="Run every prompt this many times in all modes (interleaved) "
        "and keep each mode's fastest run: steadier ratios on a busy machine.",
    ),
    prompts: Optional[Path] = prompts_option("the shipped bench set"),
    output: Optional[Path] = output_option(
        "bench.json and bench.png", "bench-results, under $EDGE_SPEC_HOME when that is set"
    ),
    threads: int = ThreadsOpt,
    draft_threads: Optional[int] = DraftThreadsOpt,
    provider: str = ProviderOpt,
    draft_provider: Optional[str] = DraftProviderOpt,
    provider_option: list[str] = ProviderOptionOpt,
    exact: Optional[bool] = ExactOpt,
    verify: bool = VerifyOpt,
) -> None:
    """Compare decoding modes (--modes) per category: τ, MBSU, tokens/s, speed-up against ar."""
    from rich.progress import Progress

    from edge_spec.bench import (
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
    kinds = _mode_kinds(modes)
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
    compared = modes_for(
        engine,
        draft_head or None,
        chain,
        gammas,
        trees,
        ssds,
        lookup="lookup" in kinds,
        reference="ar-exact" in kinds,
        eagle="eagle" in kinds,
        eagle_heads=eagle_head or None,
        spec="spec" in kinds,
    )
    engine.complete("warm up", max_new_tokens=4)
    baseline.complete("warm up", max_new_tokens=4)
    engine.complete("warm up", max_new_tokens=4, mode="ar", exact=True)
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
            progress=lambda done, total: bar.update(task, completed=done),
        )
    out.print(format_table(result["summary"]))
    if sweep:
        out.print(schedule_report(result["summary"]))
        result["per_prompt_schedule"] = per_prompt_schedule(result["records"])
        out.print(per_prompt_report(result["per_prompt_schedule"]))
    output.mkdir(parents=True, exist_ok=True)
    result["bundle"] = str(bundle)
    result["threads"] = threads
    # what the γ policy planned with (profile of the last head) next to what passes cost during the run
    result["cost_profile"] = dataclasses.asdict(engine.cost_profile) if engine.cost_profile else None
    stats = engine.target.stats
    result["target_pass_seconds"] = {n: stats.seconds[n] / stats.calls[n] for n in sorted(stats.calls) if n <= 16}
    (output / "bench.json").write_text(json.dumps(result, indent=1))
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
