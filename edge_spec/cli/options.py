"""The options several commands share, each declared once: the engine's (how a bundle is loaded and decoded),
sampling's, and the drafter-head options of ``export`` and ``add-heads``.

Every help text begins with what the option is (the test of the command line's names reads that lead:
one concept, one flag); defaults shown in help come from the configuration objects that hold them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import typer

from edge_spec.cli.groups import option
from edge_spec.defaults import DEFAULT_MODE, DEFAULT_PROVIDER, DEFAULT_THREADS
from edge_spec.errors import EdgeSpecError
from edge_spec.export.bundle.options import ExportOptions
from edge_spec.runtime.loops.config import ADAPTIVE_GAMMA_MAX, FIXED_GAMMA, SsdConfig, TreeConfig
from edge_spec.runtime.propose.drafters import DEFAULT_DRAFTER, DRAFTERS
from edge_spec.runtime.verify.sampling import SAMPLERS, SamplingParams
from edge_spec.runtime.verify.tree import VERIFIERS

EXPORT_DEFAULTS = ExportOptions()
SAMPLING_DEFAULTS = SamplingParams()


def listed(values: tuple[int, ...]) -> str:
    """Integers as the comma list an option takes."""
    return ",".join(str(v) for v in values)


def int_list(value: str, flag: str) -> tuple[int, ...]:
    """A comma list of integers given to ``flag``."""
    try:
        return tuple(int(v) for v in value.split(","))
    except ValueError:
        raise EdgeSpecError(f"{flag} must be integers separated by commas, got {value!r}") from None


# -- what several commands name alike --------------------------------------------------------------

BundleArg = typer.Argument(
    None,
    help="Bundle directory (default: the default bundle, the one `edge-spec export` "
    "makes with no arguments; `edge-spec models` lists the bundles).",
    show_default=False,
)
DRAFT_HEAD = "Drafter head (full, trim-K, specvocab-rR-kK; edge-spec info lists a bundle's heads)"
EAGLE_HEAD = (
    "EAGLE LM head (the LM head of the EAGLE head: full, trim-N, specvocab-rR-kC-ofK; edge-spec info lists a bundle's)"
)
ProviderOpt = typer.Option(
    DEFAULT_PROVIDER, "--provider", help="Execution provider: cpu, cuda, coreml, directml, openvino, qnn, webgpu."
)
ThreadsOpt = typer.Option(DEFAULT_THREADS, "--threads", help="Intra-op threads per session (0 = all cores).")
DraftThreadsOpt = typer.Option(
    None,
    "--draft-threads",
    help="Drafter intra-op threads (default: --threads); "
    "with --mode ssd e.g. --threads 1 --draft-threads 1 on two cores.",
)
DraftProviderOpt = typer.Option(
    None,
    "--draft-provider",
    help="Drafter execution provider (default: --provider); e.g. --provider cuda --draft-provider cpu.",
)
ProviderOptionOpt = typer.Option(
    [],
    "--provider-option",
    help="Provider option KEY=VALUE for the --provider's "
    "sessions, passed to ONNX Runtime as is (repeatable), e.g. --provider-option "
    "device_id=1.",
)
GammaOpt = typer.Option(
    None,
    "--gamma",
    help="Draft tokens per target pass (the most per round when the schedule "
    f"is adaptive). Default: spec adaptive {ADAPTIVE_GAMMA_MAX}, fixed {FIXED_GAMMA}; multi-draft "
    f"{TreeConfig.gamma}; ssd {SsdConfig.gamma}.",
)
ScheduleOpt = typer.Option(
    None,
    "--schedule",
    help="Draft length schedule (spec): adaptive (γ per round from "
    "measured costs and acceptance; the default) or fixed (--gamma every round).",
)
ExactOpt = typer.Option(
    None,
    "--exact/--no-exact",
    help="Batch-invariant target passes (one-token passes get a "
    "throw-away second row), so greedy output is bit-identical in every mode. Default: on "
    "for greedy spec/ssd, off for ar and for sampling (one-row passes are 15-25% faster but "
    "round differently; a sampled answer depends on the draft lengths anyway).",
)
PromptReaderOpt = typer.Option(
    True,
    "--prompt-reader/--no-prompt-reader",
    help="The int8 prompt reader: read prompts through the bundle's where it has one (edge-spec export "
    "--prompt-reader; CPU). --no-prompt-reader reads them with the decode graph: slower on long prompts, and "
    "every answer is then the decode graph's own.",
)
VerifyOpt = typer.Option(
    False, "--verify", help="Check every bundle file's sha256, not only its size (reads the whole bundle: slower)."
)
SamplerOpt = typer.Option(
    SAMPLING_DEFAULTS.sampler,
    "--sampler",
    help="How sampled tokens are drawn: "
    f"{SAMPLERS[0]} (drafts pass by rejection sampling) or {SAMPLERS[1]} (each position's "
    "noise fixed by the seed: the same answer in every mode, equal to target-only decoding "
    "with that seed; drafts may pass a little less often).",
)
TEMPERATURE = "Sampling temperature (0 = greedy)"
# export and add-heads: the same options with each command's default
DRAFT_SOURCE = "Drafter source"
DRAFT_VOCAB = "Drafter LM heads"
EAGLE_SOURCE = "EAGLE-3 head to attach"


def max_tokens_option(default: int, more: str = "") -> typer.models.OptionInfo:
    """``--max-tokens`` with this command's default (``more``: what the answers are, said after the lead)."""
    return typer.Option(default, "--max-tokens", help=f"Maximum new tokens per answer{more}.")


def prompts_option(default: str) -> typer.models.OptionInfo:
    """``--prompts``, saying which prompt set is used without one."""
    return typer.Option(
        None, "--prompts", help=f"Prompt file (.jsonl lines of {{category, prompt}}); default: {default}."
    )


def output_option(what: str, default: str) -> typer.models.OptionInfo:
    """``--output``: the directory a command writes ``what`` to."""
    return typer.Option(None, "--output", help=f"Output directory: {what} (default: {default}).", show_default=False)


@dataclass(frozen=True)
class LoadFlags:
    """Where a bundle's sessions run and how its files are checked: the engine options ``bench`` and
    ``info`` take (``generate``, ``chat`` and ``serve`` take them within :class:`EngineFlags`)."""

    threads: int = option(ThreadsOpt)
    provider: str = option(ProviderOpt)
    draft_provider: Optional[str] = option(DraftProviderOpt)
    provider_option: list[str] = option(ProviderOptionOpt)
    verify: bool = option(VerifyOpt)


# -- the engine: generate, chat, serve ---------------------------------------------------------------

CACHE_DIR_HELP = "Directory of the suffix cache kept on disk (one private file per bundle)."


def default_suffix_cache_dir() -> Path:
    """Where ``--persist-cache`` keeps the suffix cache: the user's edge-spec cache."""
    from edge_spec.paths import cache_root

    return cache_root() / "suffix"


@dataclass(frozen=True)
class EngineFlags:
    """How a bundle is loaded and decoded, as given on the command line (None: not given, the default)."""

    provider: str = option(ProviderOpt)
    threads: int = option(ThreadsOpt)
    mode: str = option(
        typer.Option(
            DEFAULT_MODE,
            "--mode",
            help="Decoding mode: spec (speculative, lossless), ssd "
            "(speculative speculative: drafts the next round while the target verifies) "
            "or ar (target only).",
        )
    )
    gamma: Optional[int] = option(GammaOpt)
    schedule: Optional[str] = option(ScheduleOpt)
    drafts: Optional[int] = option(
        typer.Option(
            None,
            "--drafts",
            help="Drafts per step (spec, default 1): > 1 "
            "verifies a tree of that many branches, each --gamma long, in one "
            "target pass (multi-draft; fixed γ).",
        )
    )
    verifier: Optional[str] = option(
        typer.Option(
            None,
            "--verifier",
            help="Multi-draft sampling verifier: "
            f"{', '.join(VERIFIERS)} (default {TreeConfig.verifier}; SpecHub: "
            "2 drafts). Greedy decoding branches on the drafter's top tokens.",
        )
    )
    lookup: Optional[bool] = option(
        typer.Option(
            None,
            "--lookup/--no-lookup",
            help="Prompt lookup drafting (spec, "
            "default on): also draft by continuing an earlier occurrence of the "
            "last tokens, in rounds where that beats the drafter.",
        )
    )
    suffix_cache: Optional[bool] = option(
        typer.Option(
            None,
            "--suffix-cache/--no-suffix-cache",
            help="Draft from the suffix cache (spec, default on): the longest earlier occurrence of the last "
            "tokens in this request and in earlier answers; off: in this request only (prompt lookup).",
        )
    )
    persist_cache: bool = option(
        typer.Option(
            False,
            "--persist-cache",
            help="Keep the suffix cache of earlier answers on disk between runs, privately, in the user's "
            "cache directory (off: in memory; edge-spec cache clear forgets it).",
        )
    )
    cache_dir: Optional[Path] = option(
        typer.Option(
            None, "--cache-dir", envvar="EDGE_SPEC_SUFFIX_CACHE_DIR", help=f"{CACHE_DIR_HELP} Implies --persist-cache."
        )
    )
    corpus: Optional[Path] = option(
        typer.Option(
            None,
            "--corpus",
            help="A directory (your repository) whose text files the suffix cache reads, so drafts can copy "
            "from them; re-read only where a file changed when the cache is kept on disk.",
        )
    )
    drafter: Optional[str] = option(
        typer.Option(
            None,
            "--drafter",
            help="Drafter kind (spec): "
            + "; ".join(
                f"{name}: {spec.summary}{' (default)' if name == DEFAULT_DRAFTER else ''}"
                for name, spec in DRAFTERS.items()
            )
            + ".",
        )
    )
    draft_head: Optional[str] = option(
        typer.Option(None, "--draft-head", help=f"{DRAFT_HEAD}. Default: the bundle's default head.")
    )
    eagle_head: Optional[str] = option(
        typer.Option(
            None,
            "--eagle-head",
            help=f"{EAGLE_HEAD}. With --drafter eagle; default: the bundle's default EAGLE LM head.",
        )
    )
    draft_threads: Optional[int] = option(DraftThreadsOpt)
    draft_provider: Optional[str] = option(DraftProviderOpt)
    provider_option: list[str] = option(ProviderOptionOpt)
    exact: Optional[bool] = option(ExactOpt)
    prompt_reader: bool = option(PromptReaderOpt)
    verify: bool = option(VerifyOpt)

    def loop_settings(self) -> dict:
        """The loop settings given (``loops.config.loop_config``'s keywords)."""
        return dict(
            gamma=self.gamma,
            schedule=self.schedule,
            drafts=self.drafts,
            verifier=self.verifier,
            lookup=self.lookup,
            suffix=self.suffix_cache,
            drafter=self.drafter,
        )

    def suffix_cache_dir(self) -> Path | None:
        """Where the suffix cache is kept (None: in memory only)."""
        if self.cache_dir is not None:
            return self.cache_dir
        return default_suffix_cache_dir() if self.persist_cache else None

    def load_settings(self) -> dict:
        """The load settings given (``runtime.loaded.LoadOptions``' fields, the provider options as the
        ``--provider-option`` flags give them: ``cli.loading.load_options``)."""
        return dict(
            provider=self.provider,
            threads=self.threads,
            draft_head=self.draft_head,
            draft_provider=self.draft_provider,
            draft_threads=self.draft_threads,
            exact=self.exact,
            prompt_reader=self.prompt_reader,
            verify=self.verify,
            provider_option=self.provider_option,
            eagle_head=self.eagle_head,
            cache_dir=self.suffix_cache_dir(),
            corpus=self.corpus,
        )


@dataclass(frozen=True)
class SamplingFlags:
    """How answer tokens are chosen: ``Engine.generate``'s sampling keywords."""

    temperature: float = option(typer.Option(SAMPLING_DEFAULTS.temperature, "--temperature", help=f"{TEMPERATURE}."))
    top_k: int = option(
        typer.Option(SAMPLING_DEFAULTS.top_k, "--top-k", help="Keep the k most likely tokens (0 = off).")
    )
    top_p: float = option(typer.Option(SAMPLING_DEFAULTS.top_p, "--top-p", help="Nucleus sampling mass (1 = off)."))
    seed: Optional[int] = option(
        typer.Option(None, "--seed", help="Random seed (fixes a sampled answer; default: none).")
    )
    sampler: str = option(SamplerOpt)


# -- drafter heads: export, add-heads ------------------------------------------------------------------


@dataclass(frozen=True)
class HeadFlags:
    """How VocabTrim and SpecVocab drafter heads are built."""

    keep: str = option(
        typer.Option(
            listed(EXPORT_DEFAULTS.keep),
            "--keep",
            help="VocabTrim rows kept: vocabulary "
            "rows in the drafter's head; a comma list exports one head per value (the first "
            "is the default).",
        )
    )
    calibration: Optional[Path] = option(
        typer.Option(
            None, "--calibration", help="Calibration prompt file (VocabTrim, SpecVocab; default: the shipped set)."
        )
    )
    rank: str = option(
        typer.Option(
            listed(EXPORT_DEFAULTS.rank), "--rank", help="SpecVocab scorer rank R (comma list: one scorer per value)."
        )
    )
    candidates: str = option(
        typer.Option(
            listed(EXPORT_DEFAULTS.candidates),
            "--candidates",
            help="SpecVocab candidates with exact logits per draft step (comma list).",
        )
    )
    scorer: str = option(
        typer.Option(
            EXPORT_DEFAULTS.scorer, "--scorer", help="SpecVocab scorer fit: data (hidden-state weighted SVD) or svd."
        )
    )
    train_steps: int = option(
        typer.Option(
            EXPORT_DEFAULTS.train_steps,
            "--train-steps",
            help="SpecVocab distillation steps on calibration states after the fit (CPU).",
        )
    )
    union_keep: int = option(
        typer.Option(
            EXPORT_DEFAULTS.union_keep,
            "--union-keep",
            help="Static VocabTrim rows always among the candidates (trim+specvocab).",
        )
    )
    scorer_vocab: str = option(
        typer.Option(
            listed(EXPORT_DEFAULTS.scorer_vocab),
            "--scorer-vocab",
            help="SpecVocab scorer rows: the top-K calibration tokens it ranks (0 = the whole vocabulary; comma list).",
        )
    )

    def export_options(self, draft_vocab: str, **more) -> ExportOptions:
        """The exporter's options for heads ``draft_vocab`` (``more``: the other export settings), checked."""
        if self.calibration is not None and not self.calibration.is_file():
            raise EdgeSpecError(f"calibration file not found: {self.calibration}")
        options = ExportOptions(
            draft_vocab=draft_vocab,
            keep=int_list(self.keep, "--keep"),
            calibration=self.calibration,
            rank=int_list(self.rank, "--rank"),
            candidates=int_list(self.candidates, "--candidates"),
            scorer=self.scorer,
            train_steps=self.train_steps,
            union_keep=self.union_keep,
            scorer_vocab=int_list(self.scorer_vocab, "--scorer-vocab"),
            **more,
        )
        options.check()
        return options
