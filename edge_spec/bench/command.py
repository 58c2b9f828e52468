"""``edge-spec bench``'s work: the flags checked before the (slow) engine load, the two engines loaded, the
modes run prompt by prompt (``runs``) or session by session (``session_runs``), the tables printed and the
result written.  The command line declares the flags (``edge_spec.cli.bench``) and hands them here."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING

from edge_spec import extras
from edge_spec.bench.modes import (
    DEFAULT_MODES,
    SESSION_MODES,
    benched_drafters,
    check_session_flags,
    mode_kinds,
    other_drafters,
)
from edge_spec.cli.loading import (
    check_sampler,
    check_threads,
    find_bundle,
    loading_status,
    provider_options,
)
from edge_spec.cli.options import int_list
from edge_spec.cli.output import console, out
from edge_spec.errors import EdgeSpecError
from edge_spec.runtime.loops.config import SsdConfig, TreeConfig
from edge_spec.runtime.propose.drafters import DRAFTERS
from edge_spec.runtime.verify.tree import VERIFIERS

if TYPE_CHECKING:
    from edge_spec.cli.bench import BenchFlags
    from edge_spec.cli.options import LoadFlags


@dataclasses.dataclass(frozen=True)
class Plan:
    """What the flags ask for, checked: the kinds of mode, the items (prompts or sessions), the loops, and
    the run's setting a result records (bundle, threads)."""

    bundle: Path
    threads: int
    sessions: bool
    kinds: set[str]
    output: Path
    items: list[dict]
    chain: object
    gammas: list[int] | None
    trees: list[TreeConfig]
    ssds: list[SsdConfig]
    provider_options: dict


def bench(bundle: Path | None, flags: BenchFlags, load: LoadFlags, *, max_tokens_given: bool) -> None:
    """Run ``edge-spec bench`` on ``bundle`` (None: the default bundle); ``max_tokens_given``: whether --max-tokens
    was on the command line (with --sessions each session's own limit holds otherwise)."""
    plan = check(bundle, flags, load)
    engine, baseline = load_engines(plan, flags, load)
    if plan.sessions:
        bench_sessions(engine, baseline, plan, flags, max_tokens_given=max_tokens_given)
    else:
        bench_prompts(engine, baseline, plan, flags)


def check(bundle: Path | None, flags: BenchFlags, load: LoadFlags) -> Plan:
    """Every flag checked before the (slow) engine load, each mistake refused in one line."""
    from edge_spec.bench.runs import load_bench_prompts
    from edge_spec.paths import bench_results_dir
    from edge_spec.runtime.loops.config import loop_config
    from edge_spec.runtime.verify.sampling import SamplingParams

    sessions = flags.sessions or flags.session_file is not None
    kinds = mode_kinds(flags.modes or ",".join(SESSION_MODES if sessions else DEFAULT_MODES))
    if sessions:
        given = {"--prompts": flags.prompts, "--sweep": flags.sweep, "--drafts": flags.drafts}
        given["--eagle-head"] = flags.eagle_head or None
        check_session_flags(kinds, {flag: value is not None for flag, value in given.items()})
    elif "nocache" in kinds:
        raise EdgeSpecError("--modes nocache applies to --sessions")
    bundle = find_bundle(bundle)
    output = flags.output or bench_results_dir()
    check_threads(load.threads, flags.draft_threads)
    options = provider_options(load.provider_option)
    for value, flag in ((flags.repeat, "--repeat"), (flags.max_tokens, "--max-tokens")):
        if value < 1:
            raise EdgeSpecError(f"{flag} must be at least 1")
    if flags.per_category is not None and flags.per_category < 1:
        raise EdgeSpecError("--per-category must be at least 1")
    headed = [name for name in other_drafters() if DRAFTERS[name].head_option == "eagle_head"]
    if flags.eagle_head and not kinds & set(headed):
        raise EdgeSpecError(f"--eagle-head applies to --modes {' or '.join(headed)}")
    for t in flags.temperature:
        SamplingParams(temperature=t)  # raises on a bad value
    chain = loop_config("spec", gamma=flags.gamma, schedule=flags.schedule, lookup=False)  # the run's schedule
    if output.exists() and not output.is_dir():
        raise EdgeSpecError(f"--output {output} is not a directory")
    if sessions:
        from edge_spec.bench.sessions import load_sessions, select_sessions

        items = select_sessions(load_sessions(flags.session_file), flags.category or None, flags.per_category)
    else:
        items = load_bench_prompts(flags.prompts, flags.category or None, flags.per_category)
    gammas = list(int_list(flags.sweep, "--sweep")) if flags.sweep else None
    if gammas and min(gammas) < 1:
        raise EdgeSpecError("--sweep values must be at least 1")
    trees = [
        TreeConfig(gamma=g, drafts=flags.drafts or TreeConfig.drafts, verifier=v)
        for v in VERIFIERS
        if v in kinds
        for g in (gammas or [flags.gamma or TreeConfig.gamma])
    ]
    ssds = [SsdConfig(gamma=g) for g in (gammas or [flags.gamma or SsdConfig.gamma])] if "ssd" in kinds else []
    check_sampler(flags.sampler, list(flags.temperature), [chain, *trees, *ssds])
    return Plan(bundle, load.threads, sessions, kinds, output, items, chain, gammas, trees, ssds, options)


def load_engines(plan: Plan, flags: BenchFlags, load: LoadFlags):
    """The engine of the compared modes and the ar baseline's, each warmed up."""
    from edge_spec.runtime.engine import Engine

    options = plan.provider_options
    with loading_status():
        engine = Engine.from_bundle(
            plan.bundle,
            provider=load.provider,
            threads=load.threads,
            config=plan.chain,
            draft_threads=flags.draft_threads,
            exact=flags.exact,
            verify=load.verify,
            draft_provider=load.draft_provider,
            provider_options=options,
        )
        # the ar baseline is our fastest target-only decoding: an engine loaded for it alone
        baseline = Engine.from_bundle(
            plan.bundle, provider=load.provider, threads=load.threads, mode="ar", provider_options=options
        )
    engine.complete("warm up", max_new_tokens=4)
    baseline.complete("warm up", max_new_tokens=4)
    engine.complete("warm up", max_new_tokens=4, mode="ar", exact=True)
    return engine, baseline


def bench_prompts(engine, baseline, plan: Plan, flags: BenchFlags) -> None:
    """Run the compared modes prompt by prompt, print the tables, write bench.json (and bench.png)."""
    from rich.progress import Progress

    from edge_spec.bench.runs import (
        format_table,
        modes_for,
        per_prompt_report,
        per_prompt_schedule,
        plot,
        run_bench,
        schedule_report,
    )

    kinds = plan.kinds
    compared = modes_for(
        engine,
        flags.draft_head or None,
        plan.chain,
        plan.gammas,
        plan.trees,
        plan.ssds,
        lookup="lookup" in kinds,
        suffix="suffix" in kinds,
        reference="ar-exact" in kinds,
        drafters=benched_drafters(kinds, flags.eagle_head),
        spec="spec" in kinds,
    )
    with Progress(console=console, transient=True) as bar:
        task = bar.add_task("bench", total=len(plan.items) * len(flags.temperature))
        result = run_bench(
            engine,
            plan.items,
            compared,
            temperatures=list(flags.temperature),
            max_new_tokens=flags.max_tokens,
            repeats=flags.repeat,
            baseline=baseline,
            sampler=flags.sampler,
            seed=flags.seed or 0,
            progress=lambda done, total: bar.update(task, completed=done),
            warm=flags.warm,
        )
    out.print(format_table(result["summary"]))
    if flags.sweep:
        out.print(schedule_report(result["summary"]))
        result["per_prompt_schedule"] = per_prompt_schedule(result["records"])
        out.print(per_prompt_report(result["per_prompt_schedule"]))
    output = plan.output
    write_result(result, engine, output / "bench.json", plan)
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


def bench_sessions(engine, baseline, plan: Plan, flags: BenchFlags, *, max_tokens_given: bool) -> None:
    """``bench --sessions``: replay the sessions in the compared modes, print the tables, write
    sessions.json, and fail loudly where a greedy answer differs from ar-exact's."""
    from rich.progress import Progress

    from edge_spec.bench.runs import format_table
    from edge_spec.bench.session_runs import cache_report, run_sessions, session_modes

    chosen = plan.items
    with_tools = next((s for s in chosen if s["tools"]), None)
    if with_tools is not None and not engine.bundle.tokenizer.takes_tools:
        raise EdgeSpecError(
            f"session {with_tools['id']!r} passes tools, but this model's chat template takes no tools "
            f"(leave its category out: --category)"
        )
    compared = session_modes(
        engine,
        flags.draft_head or None,
        gamma=flags.gamma,
        schedule=flags.schedule,
        reference="ar-exact" in plan.kinds,
        spec="spec" in plan.kinds,
        nocache="nocache" in plan.kinds,
    )
    temperatures = list(flags.temperature)
    with Progress(console=console, transient=True) as bar:
        task = bar.add_task("sessions", total=sum(len(s["turns"]) for s in chosen) * len(temperatures))
        result = run_sessions(
            engine,
            chosen,
            compared,
            temperatures=temperatures,
            max_new_tokens=flags.max_tokens if max_tokens_given else None,
            seed=flags.seed or 0,
            repeats=flags.repeat,
            warm=flags.warm,
            baseline=baseline,
            sampler=flags.sampler,
            progress=lambda done, total: bar.update(task, completed=done),
        )
    out.print(format_table(result["summary"]))
    report = cache_report(result["summary"])
    if report:
        out.print("\nsuffix cache (decode tokens/s; first token: mean time to the first token):\n" + report)
    result["sessions"] = [s["id"] for s in chosen]
    write_result(result, engine, plan.output / "sessions.json", plan)
    console.print(f"[dim]wrote {plan.output / 'sessions.json'}[/dim]")
    if result["mismatches"]:
        import typer

        for line in result["mismatches"]:
            console.print(f"[bold red]NOT LOSSLESS[/bold red] {line}", highlight=False)
        raise typer.Exit(1)


def write_result(result: dict, engine, path: Path, plan: Plan) -> None:
    """Write a bench result to ``path`` with the run's setting: bundle, threads, the cost profile the γ
    policy planned with (of the last head) and what target passes cost during the run."""
    path.parent.mkdir(parents=True, exist_ok=True)
    result["bundle"] = str(plan.bundle)
    result["threads"] = plan.threads
    result["cost_profile"] = dataclasses.asdict(engine.bundle.cost_profile) if engine.bundle.cost_profile else None
    stats = engine.bundle.target.stats
    result["target_pass_seconds"] = {n: stats.seconds[n] / stats.calls[n] for n in sorted(stats.calls) if n <= 16}
    path.write_text(json.dumps(result, indent=1))
