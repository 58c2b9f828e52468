"""A loaded bundle: everything loading one produces, and the facts about the device its models run on.

Opening a bundle reads its manifest and checks its files; loading it reads the tokenizer, the suffix
cache and the target, and loads each model drafter (``propose.drafters.DRAFTERS``: the drafter model,
the EAGLE head) and its LM heads on first use.  The
device facts live here because they are keyed by where the models run: the cost profile the schedule
plans with (measured once per device and cached, corrected from live passes) and the exactness checks
(whether one-row or padded target passes are batch-invariant here).  Generating is the engine's job
(:mod:`engine`); it names the loop configuration wherever an answer depends on it (which drafter
drafts, the longest draft).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from edge_spec.defaults import DEFAULT_PROVIDER, DEFAULT_THREADS
from edge_spec.errors import EdgeSpecError
from edge_spec.integrity import WeightCheck
from edge_spec.manifest import NATIVE_LAYOUTS, bundle_bytes, read_manifest, verify_files
from edge_spec.paths import find_bundle
from edge_spec.runtime.loops import proposer_names
from edge_spec.runtime.loops.config import LoopConfig
from edge_spec.runtime.model.decoder import Decoder
from edge_spec.runtime.model.kernel_choice import (
    apply_kernel_choice,
    measured_here,
    switched,
    this_machine,
    time_kernels,
)
from edge_spec.runtime.model.native_attention import native_matmul_here, prompt_path
from edge_spec.runtime.model.providers import exact_min_rows
from edge_spec.runtime.model.row_invariance import one_row_passes_match, padded_passes_match
from edge_spec.runtime.model.session import numpy_on_one_thread
from edge_spec.runtime.propose.drafters import DEFAULT_DRAFTER, DRAFTERS, DrafterLoader, load_array
from edge_spec.runtime.propose.model import ChainDrafter, ModelDrafter
from edge_spec.runtime.propose.suffix_cache import DEFAULT_CAPACITY as DEFAULT_SUFFIX_CAPACITY
from edge_spec.runtime.propose.suffix_cache import SuffixCache
from edge_spec.runtime.schedule import cost_profile
from edge_spec.runtime.schedule.cost_profile import CostProfile
from edge_spec.runtime.schedule.memory import ScheduleMemory
from edge_spec.runtime.schedule.policy import REACH_FLOOR
from edge_spec.runtime.suffix_store import open_suffix_cache
from edge_spec.runtime.text import TextTokenizer

GUESS_ROWS = 2  # a speculative pass's rows at least: the target's own token and the free guess
__all__ = ["BundleFiles", "LoadOptions", "LoadedBundle", "drafter_name", "load_array"]


def drafter_name(config: LoopConfig) -> str:
    """Which model drafter (``propose.drafters.DRAFTERS``) a loop configuration drafts with."""
    return next((n for n in proposer_names(config) if n in DRAFTERS), DEFAULT_DRAFTER)


@dataclass(frozen=True)
class LoadOptions:
    """How a bundle is loaded and where its models run: every setting of ``Engine.from_bundle`` but the
    loop (see there for each), as one value that the CLI builds from its flags and hands through whole."""

    provider: str = DEFAULT_PROVIDER
    threads: int = DEFAULT_THREADS  # 0: ORT picks
    context_length: int | None = None  # None: the bundle's
    draft_head: str | None = None  # None: the bundle's default drafter head
    verify: bool = False  # re-hash every file before the load
    draft_provider: str | None = None  # None: the target's provider
    draft_threads: int | None = None  # None: the target's threads
    exact: bool | None = None  # batch-invariant target passes (None: see ``Engine.exact_for``)
    provider_options: dict[str, str] | None = None  # for every session on the target's provider
    eagle_head: str | None = None  # None: the bundle's default EAGLE LM head
    cache_dir: str | Path | None = None  # where the suffix cache is kept (None: in memory only)
    suffix_capacity: int = DEFAULT_SUFFIX_CAPACITY  # tokens the suffix cache holds
    corpus: str | Path | None = None  # a directory whose text files are read into the suffix cache
    prompt_reader: bool = True  # read prompts through the bundle's int8 prompt graph, where it has one (CPU)

    @property
    def drafter_provider(self) -> str:
        """Where the drafter's sessions run: ``draft_provider``, else the target's provider."""
        return self.draft_provider or self.provider

    @property
    def drafter_threads(self) -> int:
        """The drafter's intra-op threads: ``draft_threads``, else the target's."""
        return self.threads if self.draft_threads is None else self.draft_threads

    def check(self) -> None:
        """Refuse thread counts no session can run with."""
        if self.threads < 0 or (self.draft_threads is not None and self.draft_threads < 0):
            raise EdgeSpecError("threads must be 0 (all cores) or more")


@dataclass(frozen=True)
class BundleFiles:
    """A bundle found and its files checked, before any model loads: a missing or damaged bundle is the
    first thing a load refuses."""

    directory: Path
    manifest: dict
    weight_check: WeightCheck | None  # hashes the files changed since last found whole; None: all were hashed

    @classmethod
    def open(
        cls,
        path: str | Path | None,
        verify: bool = False,
        on_block: Callable[[int], None] | None = None,
        *,
        counter: Callable[[int], Callable[[int], None]] | None = None,
    ) -> BundleFiles:
        """``path``, or the default bundle when None (:func:`edge_spec.paths.default_bundle`): its manifest
        read (once: what the load needs of it is read here) and its files' sizes checked; ``verify``
        re-hashes every file now (``on_block(size)`` after each block read, or the callback ``counter``
        makes given the bytes the manifest records), else the files changed since last found whole are
        hashed while the models load (the first answer waits for the verdict)."""
        directory = find_bundle(path)
        manifest = read_manifest(directory)
        if counter is not None:
            on_block = counter(bundle_bytes(manifest))
        verify_files(directory, manifest, full_hash=verify, on_block=on_block)
        return cls(directory, manifest, None if verify else WeightCheck(directory, manifest))


def prompt_graph(directory: Path, entry: dict, options: LoadOptions, provider: str) -> Path | None:
    """The prompt graph (``export.graph.prompt_reader``) of a bundle's model ``entry`` where the options want
    it, it can run (its int8 matmuls are MLAS's, so on the CPU execution provider only) and it pays here
    (:func:`prompt_reader_pays`)."""
    record = entry.get("prompt_reader")
    if not options.prompt_reader or record is None or provider.lower() != "cpu":
        return None
    return directory / record["onnx"] if prompt_reader_pays(entry, provider) else None


def prompt_reader_pays(entry: dict, provider: str) -> bool:
    """Whether a model's int8 prompt graph is worth loading on this machine.

    Over ``MatMulNBits`` (the lean layouts) it reads a long prompt several times sooner on any CPU.  Where the
    native op multiplies a native-layout graph's GGUF blocks, the int8 graph gains much only from AMX: on an
    AMD EPYC with AVX-512 VNNI it read the long bench prompts 0.96-1.12x sooner, while a process answering one
    of them peaked at twice the memory (4.05 against 2.07 GB) and took 2 s longer to load
    (docs/measurements.md, prompt reader)."""
    if entry.get("quantization", {}).get("gguf_layout") not in NATIVE_LAYOUTS:
        return True
    library, _ = native_matmul_here(provider)
    return library is None or prompt_path(library) == "amx"


def remembered_kernels(manifest: dict, library: Path) -> dict | None:
    """The native op's kernel record a load of this bundle timed on this machine and kept (None: none yet)."""
    return cost_profile.recalled_record(cost_profile.kernels_key(manifest, this_machine(library)))


def kernels_here(manifest: dict, library: Path) -> dict | None:
    """The native op's kernel choice for this machine: the export's record where the export ran here, else
    the one a load timed here before (``kernel_choice``); None where this machine has not timed it yet, or
    what it kept is damaged."""
    for record in (manifest["native_kernels"], remembered_kernels(manifest, library)):
        if measured_here(record, library):
            return record
    return None


def set_bundle_kernels(manifest: dict, provider: str = DEFAULT_PROVIDER) -> Path | None:
    """Set the native op's prefetch choices the bundle holds for this machine (the vendor's rules where it holds
    none), before any session registers the op: each session takes the choice in force, so a tool that builds
    its own ``Decoder`` over a bundle's graph calls this first to time what the runtime runs.  Returns the op's
    library where this machine has not timed the bundle yet (the load times it then), else None."""
    if "native_kernels" not in manifest:
        return None
    library, _ = native_matmul_here(provider)
    if library is None:
        return None
    record = kernels_here(manifest, library)
    apply_kernel_choice(record, library)
    return library if record is None and not switched() else None


class LoadedBundle:
    """One bundle's models, tokenizer and suffix cache, loaded once for the options given, and what was
    measured about the device they run on.  Each model drafter loads on first use, each of its LM heads
    once; switching heads keeps the drafter's body and its KV cache."""

    def __init__(
        self,
        files: BundleFiles,
        tokenizer: TextTokenizer,
        target: Decoder,
        options: LoadOptions,
        *,
        suffix_cache: SuffixCache | None = None,
        kernels_untimed: Path | None = None,
    ) -> None:
        """``kernels_untimed``: the native op's library where this machine has not timed the op's kernels for
        this bundle yet (:meth:`time_kernels`)."""
        self.bundle_dir = files.directory
        self.manifest = files.manifest
        self.weight_check = files.weight_check  # answers wait for its verdict
        self.tokenizer = tokenizer
        self.target = target  # None once closed
        self.options = options
        self._loaders: dict[str, DrafterLoader] = {}  # the model drafters loaded so far, by name
        self._memories: dict[str, ScheduleMemory] = {}
        # earlier answers the ``suffix`` proposer drafts from (``propose.suffix_cache``): in memory unless given
        self.suffix_cache = suffix_cache if suffix_cache is not None else SuffixCache()
        # each model drafter's LM head (None: a drafter the bundle lacks), as the options pick them
        self.heads: dict[str, str | None] = {name: self._chosen_head(name) for name in DRAFTERS}
        self.cost_profile: CostProfile | None = None
        self._one_row_exact: bool | None = None  # see exact_rows
        self._padded_exact: bool | None = None  # see exact_available
        self._profile_key = ""
        self._profile_calls: tuple[dict[int, int], dict[int, int]] = ({}, {})  # passes before the live ones
        self.kernels_untimed = kernels_untimed

    @classmethod
    def load(cls, files: BundleFiles, options: LoadOptions, *, takes_turns: bool) -> LoadedBundle:
        """Load an opened bundle's tokenizer, suffix cache and target (the drafters load on first use).
        ``takes_turns``: the target alternates with a drafter on the same cores (speculative decoding), so
        its threads stop spinning between passes."""
        manifest = files.manifest
        capacity = min(options.context_length or manifest["context_length"], manifest["context_length"])
        tokenizer = TextTokenizer(files.directory)
        suffix_cache = open_suffix_cache(
            manifest,
            tokenizer.encode_literal,
            Path(options.cache_dir) if options.cache_dir is not None else None,
            options.suffix_capacity,
            Path(options.corpus) if options.corpus is not None else None,
        )
        untimed = set_bundle_kernels(manifest, options.provider)
        target = Decoder(
            files.directory / manifest["target"]["onnx"],
            provider=options.provider,
            threads=options.threads,
            capacity=capacity,
            takes_turns=takes_turns,
            provider_options=options.provider_options,
            prompt_graph=prompt_graph(files.directory, manifest["target"], options, options.provider),
        )
        return cls(files, tokenizer, target, options, suffix_cache=suffix_cache, kernels_untimed=untimed)

    def time_kernels(self) -> None:
        """A bundle's first load on a machine other than its export's (``kernels_untimed``): time the native
        op's prefetch choices on the loaded target (a few seconds), set the faster and remember them beside
        the cost profiles for the next loads (``kernel_choice``).  Before the cost profile, which they change."""
        library, self.kernels_untimed = self.kernels_untimed, None
        if library is None:
            return
        with cost_profile.measuring("timing this machine's kernels (first run, a few seconds)"):
            self._settle()
            record = time_kernels(self.target, library)
        cost_profile.remember_record(cost_profile.kernels_key(self.manifest, record["machine"]), record)

    def measure_costs(self, config: LoopConfig) -> CostProfile:
        """Load (or measure quickly once and cache) this device's cost profile for the drafter ``config``
        drafts with and its longest draft: target passes over 1..γ_max+1 tokens, drafter body and head
        steps (see ``cost_profile``).  The γ policy plans with it from the first round; live measurements
        refine it, and the cached profile after each request (:meth:`correct_costs`)."""
        max_tokens = max(config.gamma + 1, 2)
        fits = (self.target.capacity - 2) // 2  # a draft of γ and its verify pass need the room
        adaptive = getattr(config, "adaptive", False)
        if adaptive and REACH_FLOOR + 1 <= fits < max_tokens:
            # an adaptive ceiling is only a ceiling: rounds never draft past the room the context has left
            max_tokens = fits
        if max_tokens > fits:
            least = min(max_tokens, REACH_FLOOR + 1) if adaptive else max_tokens
            raise EdgeSpecError(
                f"a context of {self.target.capacity} tokens is too short for speculative decoding "
                f"with drafts of up to {least - 1} tokens: give a context of at least "
                f"{2 * least + 2} tokens, or run mode 'ar'"
            )
        drafter = self.active_drafter(config)
        key = cost_profile.cache_key(self.manifest, self._drafter_entry(config), *self._placement(), max_tokens)
        with numpy_on_one_thread():  # the profile alternates drafter steps and target passes, as rounds do
            profile = cost_profile.load_or_measure(key, self.target, drafter, max_tokens, self._settle)
        # live measurements, once there are some, win; before the first profile there were none
        first = self.cost_profile is None
        for n, seconds in profile.verify.items():
            if first or n not in self.target.stats.recent:
                self.target.stats.seed(n, seconds)
        if drafter.step_estimate is None:
            drafter.step_estimate = profile.draft_step
        steps = drafter.decoder.stats  # the drafter's second row (its catch-up price) until measured live
        for rows, seconds in ((1, profile.draft_body), (2, profile.draft_body + profile.draft_catch_up)):
            if rows not in steps.recent:
                steps.seed(rows, seconds)
        self.cost_profile, self._profile_key = profile, key
        # the passes counted so far (the profile's) are not live ones
        self._profile_calls = (dict(self.target.stats.costed), dict(steps.costed))
        return profile

    def _settle(self) -> None:
        """Before the machine is timed: let the weight check finish hashing, on a core the passes need (the
        first answer waits for its verdict anyway, and gives it)."""
        if self.weight_check is not None:
            try:
                self.weight_check.result()
            except EdgeSpecError:
                pass

    def correct_costs(self, config: LoopConfig) -> None:
        """After a request, judge the cost profile by the live passes since it was loaded: one that they
        keep losing to belongs to a faster machine than this one is now, so the next load measures it
        again (``cost_profile.outgrown_by_live``); else store what they taught it: a profile they keep
        beating was measured under load and is replaced, estimated sizes take their live latencies
        (``cost_profile.refine_from_live``).  ``config``: the loop the profile was measured for."""
        stats, profile = self.target.stats, self.cost_profile
        if profile is None:
            return
        target_calls, step_calls = self._profile_calls
        calls = {n: c - target_calls.get(n, 0) for n, c in stats.costed.items()}
        if cost_profile.outgrown_by_live(profile, stats.recent, calls):
            cost_profile.forget(self._profile_key)
            return
        steps = self.active_drafter(config).decoder.stats
        drafted = {n: c - step_calls.get(n, 0) for n, c in steps.costed.items()}
        if cost_profile.refine_from_live(profile, stats.recent, calls, steps.recent, drafted):
            cost_profile.save(self._profile_key, profile)
            for n, seconds in profile.verify.items():  # and price the sizes not measured live from it now
                stats.profile[n] = seconds  # (what DecoderStats scales them by: live / this, where measured)
                if stats.costed.get(n, 0) < 2:
                    stats.recent[n] = seconds

    def _placement(self) -> tuple[str, str]:
        """Where the models run, as the cached device facts are keyed: providers (with options), threads, and
        the native attention op where the target runs on it (its passes cost and round otherwise)."""
        o = self.options
        provider_options = ",".join(f"{k}={v}" for k, v in sorted((o.provider_options or {}).items()))
        native = "+native-attention" if getattr(self.target, "native_attention", False) else ""
        if getattr(self.target, "attention_pad_removed", False):
            native += "-unpadded"  # a row of attention less in every pass
        if getattr(self.target, "half_cache", False):
            native += "-kv16"  # half the cache's bytes a pass
        return f"{o.provider}[{provider_options}]{native}/{o.drafter_provider}", f"{o.threads}/{o.drafter_threads}"

    def exact_rows(self, check: bool = True) -> int:
        """Rows a batch-invariant target pass needs on this device: one where one-row passes were found
        equal to multi-row ones bit for bit (attention without a one-query path: padded by the graph, or on the
        native op; matmul kernels without a one-row path: checked once per device and cached:
        ``row_invariance``), else the provider's.
        ``check`` False reads the cached verdict only: before the check, the provider's rows, exact
        without it (what the answers before :meth:`check_device` run)."""
        if self._one_row_exact is None:
            if not self.target.one_row_attention_exact:
                self._one_row_exact = False
            else:
                key = cost_profile.target_key(self.manifest, *self._placement())
                self._one_row_exact = (
                    cost_profile.remembered(key, lambda: one_row_passes_match(self.target))
                    if check
                    else cost_profile.recalled(key)
                )
        return 1 if self._one_row_exact else exact_min_rows(self.options.provider)

    def exact_available(self, check: bool = True) -> bool | None:
        """Whether target passes padded to :meth:`exact_rows` give every row the same logits whatever pass
        carries it, here (checked once per device and cached: ``row_invariance.padded_passes_match``).
        Where they do not, no pad makes greedy speculative output bit-identical to target-only decoding:
        exact mode is refused and the default runs unpadded, as fast as it can.  ``check`` False reads
        the cached verdict only (None: not checked yet)."""
        if self._padded_exact is None:
            rows = self.exact_rows(check)
            if self._one_row_exact is None:  # not checked yet: the padded check is keyed by its verdict
                return None
            placement, threads = self._placement()
            key = cost_profile.target_key(self.manifest, f"{placement}#padded-to-{rows}", threads)
            self._padded_exact = (
                cost_profile.remembered(key, lambda: padded_passes_match(self.target, rows))
                if check
                else cost_profile.recalled(key)
            )
        return self._padded_exact

    def check_device(self) -> None:
        """Run this device's exactness checks where their verdicts are not cached yet (seconds on a CPU, once
        per device).  A speculative engine runs them after its first answer, not before it: until their
        verdicts are in, exact passes take the provider's pad rows, which are exact wherever any are, so
        the first answer of a new install does not wait for them."""
        self.exact_available()

    def pass_rows(self, mode: str) -> int:
        """The fewest rows of an exact target pass in ``mode``: what exactness needs here
        (:meth:`exact_rows`), and in speculative decoding at least two, because a draft-less round
        that verifies the free guess in a second row was measured faster than a one-row round
        (README, *Bit-identical greedy output*); target-only decoding has no guess to carry."""
        rows = self.exact_rows(check=False)
        return rows if mode == "ar" else max(rows, GUESS_ROWS)

    def param_ratio(self, config: LoopConfig) -> float:
        """c in MBSU for the drafter ``config`` drafts with: its parameters read per step / the target's."""
        name = drafter_name(config)
        return DRAFTERS[name].parameters(self.manifest, self.head_of(name)) / self.manifest["target"]["parameters"]

    def bytes_ratio(self, config: LoopConfig) -> float:
        """c in a memory-bound model for the drafter ``config`` drafts with: its bytes read per step / the
        target's."""
        name = drafter_name(config)
        target = sum(f["bytes"] for f in self.manifest["target"]["files"] if f["path"].endswith(".data"))
        return DRAFTERS[name].step_bytes(self.bundle_dir, self.manifest, self.head_of(name)) / target

    def active_drafter(self, config: LoopConfig) -> ChainDrafter:
        """The drafter ``config`` drafts with, loaded on first use."""
        return self.load_drafter(drafter_name(config))

    def load_drafter(self, name: str) -> ChainDrafter:
        """The model drafter ``name`` with its current LM head, loaded on first use."""
        if name not in self._loaders:
            self._loaders[name] = DRAFTERS[name].loader(self)
        return self._loaders[name].get(self.head_of(name))

    @property
    def drafters(self) -> dict[str, ChainDrafter]:
        """The model drafters loaded so far, by name, each with its current LM head."""
        return {name: self.load_drafter(name) for name in self._loaders}

    def _drafter_entry(self, config: LoopConfig) -> dict:
        """What the drafter's costs and acceptance depend on (``DrafterSpec.profile_entry``)."""
        name = drafter_name(config)
        return DRAFTERS[name].profile_entry(self.manifest, self.head_of(name))

    def schedule_memory(self, config: LoopConfig) -> ScheduleMemory:
        """The schedule's acceptance calibration for the drafter ``config`` drafts with and the target,
        carried across requests and kept beside the cost profiles (``schedule.memory``)."""
        key = cost_profile.pair_key(self.manifest, self._drafter_entry(config))
        if key not in self._memories:
            self._memories[key] = ScheduleMemory(cost_profile.cache_dir() / f"acceptance-{key}.json")
        return self._memories[key]

    def head_of(self, drafter: str) -> str | None:
        """The LM head the model drafter ``drafter`` drafts with (None: it has none in this bundle)."""
        if drafter not in self.heads:  # a drafter registered after the bundle was loaded
            self.heads[drafter] = self._chosen_head(drafter)
        return self.heads[drafter]

    def _chosen_head(self, drafter: str) -> str | None:
        """The head the load options pick for ``drafter`` (its ``DrafterSpec.head_option``), checked."""
        option = DRAFTERS[drafter].head_option
        return self.check_head(getattr(self.options, option) if option else None, drafter)

    def check_head(self, name: str | None, drafter: str = DEFAULT_DRAFTER) -> str | None:
        """``name`` (None: the bundle's default) when the bundle has that LM head for the model drafter
        ``drafter``, else a one-line error listing those it has; None for a drafter the bundle lacks."""
        spec = DRAFTERS[drafter]
        heads = spec.heads(self.manifest)
        if not heads:
            if name is not None:
                raise EdgeSpecError(f"bundle has no {spec.title} head, so no {spec.title} head {name!r}: {spec.remedy}")
            return None
        name = name or spec.default_head(self.manifest)
        if name not in heads:
            raise EdgeSpecError(f"bundle has no {spec.title} head {name!r}; available: {', '.join(heads)}")
        return name

    def use_head(self, drafter: str, name: str) -> None:
        """Switch the model drafter ``drafter`` to its LM head ``name`` (the parts its heads share, and
        its KV cache, are kept)."""
        self.heads[drafter] = self.check_head(name, drafter)

    def drafter_for_option(self, option: str) -> str:
        """The model drafter whose LM head the load option ``option`` picks (``DrafterSpec.head_option``)."""
        return next(name for name, spec in DRAFTERS.items() if spec.head_option == option)

    @property
    def draft_head(self) -> str:
        """The drafter model's LM head (the default drafter's)."""
        return self.heads[DEFAULT_DRAFTER]

    @property
    def eagle_head(self) -> str | None:
        """The EAGLE head's LM head (the one ``LoadOptions.eagle_head`` picks; None: the bundle has none)."""
        return self.head_of(self.drafter_for_option("eagle_head"))

    def use_draft_head(self, name: str) -> None:
        self.use_head(DEFAULT_DRAFTER, name)

    def use_eagle_head(self, name: str) -> None:
        self.use_head(self.drafter_for_option("eagle_head"), name)

    @property
    def drafter(self) -> ModelDrafter:
        """The drafter model with the current head, loaded on first use."""
        return self.load_drafter(DEFAULT_DRAFTER)

    @property
    def eagle(self) -> ChainDrafter:
        """The bundle's EAGLE-3 head, loaded on first use."""
        return self.load_drafter(self.drafter_for_option("eagle_head"))

    def draft_placement(self) -> dict:
        """Where the drafter's sessions run: its provider, threads and, on the target's provider, its options."""
        o = self.options
        same = o.drafter_provider.lower() == o.provider.lower()  # the target's options fit its provider only
        options = dict(o.provider_options or {}) if same else {}
        return dict(provider=o.drafter_provider, threads=o.drafter_threads, provider_options=options)

    def draft_prompt_graph(self, entry: dict) -> Path | None:
        """The prompt graph of the drafter model ``entry`` (its manifest record), where it is to be used."""
        return prompt_graph(self.bundle_dir, entry, self.options, self.options.drafter_provider)

    def close(self) -> None:
        """Save what is kept across processes (schedule calibrations, the suffix cache) and drop the ONNX
        Runtime sessions and KV buffers, so they are freed with the last reference to them."""
        for memory in self._memories.values():
            memory.save()
        self._memories.clear()
        self.suffix_cache.save()
        self._loaders.clear()
        self.target = None
