"""``info``: what a bundle holds, the execution providers, and this machine's costs."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from edge_spec.cli.groups import takes_groups
from edge_spec.cli.loading import find_bundle, load_options, loop_config, open_engine, provider_options
from edge_spec.cli.options import (
    DRAFT_HEAD,
    GammaOpt,
    LoadFlags,
)
from edge_spec.cli.output import out
from edge_spec.errors import EdgeSpecError


@takes_groups
def info(
    bundle: Optional[Path] = typer.Argument(
        None, help="Bundle directory (default: the default bundle; with --providers alone: none)."
    ),
    costs: bool = typer.Option(
        False,
        "--costs",
        help="Also show this machine's cost profile (measured "
        "once and cached): target pass by rows, drafter step, and the draft "
        "length the schedule plans at each acceptance (up to --gamma); when, by which command and why it "
        "was measured.",
    ),
    remeasure: bool = typer.Option(
        False,
        "--remeasure",
        help="With --costs: measure the cost profile again now, replacing the cached one (after a change of "
        "load, power mode or hardware; run it with the settings you use: --threads, --draft-head, --gamma, "
        "the providers).",
    ),
    gamma: Optional[int] = GammaOpt,
    draft_head: Optional[str] = typer.Option(
        None, "--draft-head", help=f"{DRAFT_HEAD}. With --costs: the head profiled; default: the bundle's default head."
    ),
    providers: bool = typer.Option(
        False,
        "--providers",
        help="List the execution providers: present in this onnxruntime build, and whether a session on each one runs.",
    ),
    load: LoadFlags = ...,
) -> None:
    """Show what a bundle holds (after checking its files as `generate` does), the execution providers,
    or this machine's costs."""
    from edge_spec.manifest import read_manifest, verify_files

    if remeasure and not costs:
        raise EdgeSpecError("--remeasure measures the cost profile again: give it with --costs")
    if providers:
        from edge_spec.runtime.model.providers import provider_report

        for name, line in provider_report(provider_options(load.provider_option)):
            out.print(f"{name:9s} {line}")
        if bundle is None:
            return
    bundle = find_bundle(bundle)
    manifest = read_manifest(bundle)
    verify_files(bundle, manifest, full_hash=load.verify)
    for role in ("target", "draft"):
        m = manifest[role]
        c = m["config"]
        heads = ", ".join(f"{name} ({h['size']} rows)" for name, h in m.get("heads", {}).items())
        out.print(
            f"{role:6s} {m['name']}: {m['parameters'] / 1e6:.0f}M params, {c['num_layers']} layers, "
            f"hidden {c['hidden_size']}, vocab {c['vocab_size']}, {m['quantization']['weights']}"
            f"{_layout_note(m['quantization'])}, {m['bytes'] / (1 << 20):.0f} MiB"
            + (_prompt_reader_note(m) if m.get("prompt_reader") else "")
            + (f"; heads: {heads}, default {m['default_head']}" if heads else "")
        )
    if manifest.get("eagle"):
        from edge_spec.manifest import eagle_heads

        e = manifest["eagle"]
        heads = ", ".join(f"{name} ({h['size']} rows)" for name, h in eagle_heads(manifest).items())
        layout = "" if "heads" in e else " (single graph: add-heads --eagle-trim/--eagle-specvocab splits it)"
        out.print(
            f"eagle  {e.get('source') or 'EAGLE-3 head'}: {e['parameters'] / 1e6:.0f}M params, draft vocab "
            f"{e.get('draft_vocab_size')}, {e['bytes'] / (1 << 20):.0f} MiB; heads: {heads}, default "
            f"{e.get('default_head', 'full')}{layout}"
        )
    if manifest.get("native_kernels"):
        from edge_spec.runtime.loaded import remembered_kernels
        from edge_spec.runtime.model.kernel_choice import describe
        from edge_spec.runtime.model.native_attention import native_matmul_here

        library = native_matmul_here()[0]
        remembered = remembered_kernels(manifest, library) if library is not None else None
        out.print("kernels " + describe(manifest["native_kernels"], library, remembered))
    if costs:
        _print_costs(bundle, load, gamma, draft_head, remeasure)


def _layout_note(quantization: dict) -> str:
    """The ``--gguf-layout`` a model's carried GGUF blocks are in, so that a user can tell a compact bundle from a
    native one (they differ in speed and fidelity); nothing for a model whose weights were all re-quantized."""
    if isinstance(quantization.get("gguf_blocks"), dict) and quantization.get("gguf_layout"):
        return f" in the {quantization['gguf_layout']} layout"
    return ""


def _prompt_reader_note(entry: dict) -> str:
    """The model's int8 prompt reader, and whether the runtime loads it on this machine (the CPU's)."""
    from edge_spec.runtime.loaded import prompt_reader_pays

    if prompt_reader_pays(entry, "cpu"):
        return "; int8 prompt reader"
    return "; int8 prompt reader (left unloaded here: without AMX the native op reads prompts about as fast)"


def _print_costs(bundle: Path, load: LoadFlags, gamma: int | None, draft_head: str | None, remeasure: bool) -> None:
    """The row-cost curve the schedule plans with, and what it makes of it, on the placement given (a GPU's
    curve has its own steps: the plan follows them); ``remeasure``: measured again, not read from the cache."""
    import contextlib

    from edge_spec.runtime.schedule import cost_profile
    from edge_spec.runtime.schedule.policy import REACH_ACCEPTANCE, REACH_FLOOR, CostModel, plan_round, reach

    config = loop_config("spec", gamma=gamma)
    gamma = config.gamma
    provider, draft_provider, threads = load.provider, load.draft_provider, load.threads
    options = load_options(
        provider=provider,
        threads=threads,
        draft_head=draft_head,
        draft_provider=draft_provider,
        provider_option=load.provider_option,
    )
    with cost_profile.remeasuring() if remeasure else contextlib.nullcontext():
        engine = open_engine(bundle, config, options)
    profile = engine.bundle.cost_profile
    placement = provider if (draft_provider or provider) == provider else f"{provider}, drafter on {draft_provider}"
    out.print(
        f"costs  {placement}, {threads or 'all'} threads, head {engine.bundle.draft_head} ({_origin(profile)}; "
        f"kept in {cost_profile.cache_dir()}):",
        highlight=False,
    )
    base = profile.verify[1]
    for n, seconds in sorted(profile.verify.items()):
        out.print(
            f"  target pass, {n} new token{'s' if n > 1 else ' '}: {1e3 * seconds:7.1f} ms  "
            f"({seconds / base:4.2f}x one row)"
        )
    out.print(
        f"  drafter step: {1e3 * profile.draft_step:.1f} ms (body {1e3 * profile.draft_body:.1f}, "
        f"head {1e3 * profile.draft_head:.2f}); a second token read in one step: "
        f"+{1e3 * profile.draft_catch_up:.1f} ms"
    )
    rows = engine.bundle.exact_rows()
    why = (
        "one-row passes equal multi-row ones bit for bit on this device"
        if rows == 1
        else "this device's one-row kernels round differently"
        if engine.bundle.target.one_row_attention_exact
        else "the target graph predates the attention pad: re-export, or "
        "edge_spec.export.graph.attention_pad.pad_bundle_target(BUNDLE)"
    )
    if engine.bundle.exact_available():
        out.print(f"  exact greedy passes: {rows} row{'s' if rows > 1 else ''} at least ({why})")
    else:
        out.print(
            "  exact greedy passes: none here (a token's logits depend on the pass that carries it, whatever "
            "the pad): greedy spec runs unpadded, --exact is refused"
        )
    model = CostModel(profile.draft_step, profile.verify, profile.draft_catch_up)
    plans = ", ".join(
        f"{alpha:.2f}: γ {plan_round(alpha, alpha, model, gamma).gamma}"
        for alpha in (0.3, 0.5, 0.7, 0.8, 0.9, 0.95, 0.98)
    )
    out.print(
        f"  planned drafts by acceptance: {plans}; a round reaches at most {reach(model, gamma)} "
        f"(the plan at {REACH_ACCEPTANCE}, at least {REACH_FLOOR})"
    )
    learned = engine.bundle.schedule_memory(engine.config).calibration("greedy")
    if learned.first.trials:
        out.print(
            f"  learned greedy first-draft acceptance: {learned.first_draft():.2f} "
            f"(over ~{learned.first.trials:.0f} recent rounds)"
        )
    if any(rate.trials for rate in learned.guess):
        rates = ", ".join(f"{learned.guess_rate(m):.2f}" for m in range(len(learned.guess)))
        out.print(f"  learned greedy free-guess (and first lookup draft) acceptance by suffix matched 0..4+: {rates}")


def _origin(profile) -> str:
    """Where the profile came from: measured by this command (and why), or read from the cache (when and by
    which command it was measured); corrected from live passes; marked as measured under load."""
    import time

    if not profile.cached:
        origin = (
            f"measured now in {profile.measured_seconds:.1f} s: {profile.replaced or 'the first for these settings'}"
        )
    elif profile.measured_at:
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(profile.measured_at))
        origin = f"cached: measured {when} by {profile.measured_by or 'an unknown command'}"
        origin += f" in {profile.measured_seconds:.1f} s"
    else:
        origin = "cached: measured by an earlier edge-spec, which did not record when"
    if profile.corrections:
        origin += f", corrected {profile.corrections}x from live passes (it was taken under load)"
    if profile.measured_busy:
        origin += (
            f"; measured while other processes used {profile.busy:.0%} of the CPU: measured again at the next "
            "quiet load (or with --remeasure)"
        )
    return origin
