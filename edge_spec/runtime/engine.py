"""Public Python API: ``Engine.from_bundle(path).generate(prompt)``.

The engine owns the text side (chat template, streaming detokenization, stop
strings, cancellation, statistics) and the loaded models, and delegates token
generation to the loop its configuration names (:mod:`loops`).  Token loops know
nothing about text; the engine knows nothing about KV caches.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edge_spec.errors import EdgeSpecError
from edge_spec.integrity import WeightCheck
from edge_spec.manifest import eagle_heads, read_manifest, verify_files
from edge_spec.paths import find_bundle
from edge_spec.runtime.constrain import Constraint, GrammarVocabulary, grammar_for
from edge_spec.runtime.logprobs import ChunkLogprobs, LogprobRecorder, TokenLogprob
from edge_spec.runtime.loops import check_constraint, generate_tokens, proposer_names
from edge_spec.runtime.loops.config import LoopConfig, TreeConfig, loop_config
from edge_spec.runtime.loops.stats import TARGET, SpecStats, SpecSummary
from edge_spec.runtime.loops.tree import check_tree
from edge_spec.runtime.model.decoder import Decoder
from edge_spec.runtime.model.providers import exact_min_rows
from edge_spec.runtime.model.row_invariance import one_row_passes_match, padded_passes_match
from edge_spec.runtime.model.session import numpy_on_one_thread, small_session
from edge_spec.runtime.propose import DRAFTERS
from edge_spec.runtime.propose.context import ProposerContext
from edge_spec.runtime.propose.eagle import EagleDrafter
from edge_spec.runtime.propose.heads import DraftHead, SpecVocabHead
from edge_spec.runtime.propose.model import ChainDrafter, ModelDrafter
from edge_spec.runtime.propose.suffix_cache import DEFAULT_CAPACITY as DEFAULT_SUFFIX_CAPACITY
from edge_spec.runtime.propose.suffix_cache import SuffixCache
from edge_spec.runtime.provenance import SourcedText
from edge_spec.runtime.schedule import cost_profile
from edge_spec.runtime.schedule.cost_profile import CostProfile
from edge_spec.runtime.schedule.memory import ScheduleMemory
from edge_spec.runtime.suffix_store import open_suffix_cache
from edge_spec.runtime.text import Message, StopMatcher, StreamingDetokenizer, TextTokenizer
from edge_spec.runtime.verify.sampling import NonFiniteLogits, SamplingParams, check_vocab_ids

GUESS_ROWS = 2  # a speculative pass's rows at least: the target's own token and the free guess


def load_array(path: Path) -> np.ndarray:
    """A bundle's ``.npy`` table; a damaged one is a one-line error naming it."""
    try:
        return np.load(path, allow_pickle=False)
    except (ValueError, OSError, EOFError) as exc:
        why = str(exc).strip().splitlines()[0][:120] if str(exc).strip() else type(exc).__name__
        raise EdgeSpecError(
            f"cannot read {path} ({why}): the bundle is damaged; run edge-spec info {path.parent.parent} --verify"
        ) from None


class EngineBusy(EdgeSpecError):
    """``generate(..., wait=False)`` while another thread's generation is in progress."""


class GenerationSuperseded(EdgeSpecError):
    """A generator resumed after the same thread started a newer generation on the engine."""


class PrefillCancelled(Exception):
    """Raised between prefill passes once :meth:`Engine.cancel` was called (caught by ``generate``)."""


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    stop_reason: str = ""
    mode: str = "ar"
    spec: SpecSummary | None = None  # what the speculative loop did (τ, acceptance, MBSU, ...); None in ar
    coupled_seed: int | None = None  # a coupled sampled answer's seed (drawn if none was given): it remakes the answer

    @property
    def tokens_per_second(self) -> float:
        """Decode speed: tokens after the first (which comes out of the prefill pass) per decode second."""
        return (self.new_tokens - 1) / self.decode_seconds if self.new_tokens > 1 and self.decode_seconds > 0 else 0.0


@dataclass
class Completion:
    text: str
    token_ids: list[int]
    stats: GenerationStats


DEFAULT_MODE = "spec"  # what the CLI, the server and the Python API run when no mode is named


class EngineClosed(EdgeSpecError):
    """A generation asked of an engine after :meth:`Engine.close`."""


class Engine:
    """A loaded bundle ready to generate.  One generation runs at a time: :meth:`generate` holds the
    engine from its first chunk until the generator is exhausted or closed; a caller in another thread
    waits for it (or, with ``wait=False``, gets :class:`EngineBusy`).  A new generation in the same
    thread takes over, and the generator it replaced raises :class:`GenerationSuperseded`.
    :meth:`cancel` may be called from any thread."""

    def __init__(
        self,
        bundle_dir: Path,
        manifest: dict,
        tokenizer: TextTokenizer,
        target: Decoder,
        *,
        provider: str = "cpu",
        threads: int = 0,
        config: LoopConfig | None = None,
        draft_head: str | None = None,
        draft_provider: str | None = None,
        draft_threads: int | None = None,
        exact: bool | None = None,
        provider_options: dict[str, str] | None = None,
        eagle_head: str | None = None,
        suffix_cache: SuffixCache | None = None,
    ) -> None:
        self.bundle_dir = bundle_dir
        self.manifest = manifest
        self.tokenizer = tokenizer
        self.target = target
        self.config = config or loop_config("ar")
        self.exact = exact  # None: batch-invariant target passes in the speculative modes only (see exact_for)
        self._provider, self._threads = provider, threads
        self._draft_provider = draft_provider or provider
        self._provider_options = dict(provider_options or {})  # for sessions on the target's provider
        self._draft_threads = threads if draft_threads is None else draft_threads
        self._draft_body: Decoder | None = None
        self._drafters: dict[str, ModelDrafter] = {}
        self._eagle: EagleDrafter | None = None
        self._eagle_heads: dict[str, DraftHead | SpecVocabHead | None] = {}
        self._memories: dict[str, ScheduleMemory] = {}
        # earlier answers the ``suffix`` proposer drafts from (``propose.suffix_cache``): in memory unless given
        self.suffix_cache = suffix_cache if suffix_cache is not None else SuffixCache()
        self.draft_head = self._check_head(draft_head or manifest["draft"]["default_head"])
        self.eagle_head = self._check_eagle_head(eagle_head)
        self.cost_profile: CostProfile | None = None
        self._one_row_exact: bool | None = None  # see exact_rows
        self._padded_exact: bool | None = None  # see exact_available
        self._profile_key = ""
        self._profile_calls: tuple[dict[int, int], dict[int, int]] = ({}, {})  # passes before the live ones
        self._weight_check: WeightCheck | None = None  # see from_bundle: answers wait for its verdict
        self._grammar_vocabulary: GrammarVocabulary | None = None  # see grammar_vocabulary
        self._closed = False
        self._cancel = threading.Event()
        self._turn = threading.Condition()  # who holds the engine: one thread, possibly several times
        self._owner: int | None = None
        self._holds = 0
        self._generation = 0  # the active generation; an older generator raises when resumed
        self._tokens: Iterator[int] | None = None  # the active generation's token loop
        self.last_stats = GenerationStats()
        self.last_token_ids: list[int] = []
        self.last_logprobs: list[TokenLogprob] = []  # one per last_token_ids entry, when asked for

    @classmethod
    def from_bundle(
        cls,
        path: str | Path | None = None,
        *,
        provider: str = "cpu",
        threads: int = 0,
        context_length: int | None = None,
        mode: str | None = None,
        config: LoopConfig | None = None,
        draft_head: str | None = None,
        verify: bool = False,
        draft_provider: str | None = None,
        draft_threads: int | None = None,
        exact: bool | None = None,
        provider_options: dict[str, str] | None = None,
        eagle_head: str | None = None,
        cache_dir: str | Path | None = None,
        suffix_capacity: int = DEFAULT_SUFFIX_CAPACITY,
        corpus: str | Path | None = None,
    ) -> "Engine":
        """Load a bundle: ``path``, or the default bundle (the one ``edge-spec export`` makes with no arguments,
        :func:`edge_spec.paths.default_bundle`) when None.  ``threads`` = 0 lets ORT pick; ``verify`` re-hashes
        every file first.

        ``mode`` is ``"spec"`` (speculative decoding, the default, as in the CLI and the server), ``"ar"``
        (the target alone) or ``"ssd"`` with that loop's default settings; ``config`` (``loops.config``: ``ChainConfig``, ``TreeConfig``, ``SsdConfig``,
        or :func:`~edge_spec.runtime.loops.config.loop_config` from user settings) sets the loop and its
        settings instead.  ``draft_head`` picks one of the bundle's drafter heads,
        e.g. ``"full"``, ``"trim-16384"`` or ``"specvocab-r128-k2048"``; ``eagle_head`` one of its EAGLE
        head's LM heads (``"full"``, ``"trim-N"``, ``"specvocab-rR-kC-ofK"``; default: the bundle's).

        ``exact`` makes every target pass batch-invariant (one-token passes get a throw-away second row,
        see :mod:`decoder`, unless this device's one-row passes were found exact: :meth:`exact_rows`):
        greedy output is then the same bit for bit in every mode, whatever the draft lengths.  The
        default (None) is exact in greedy speculative decoding, where nearly every pass has several rows
        anyway, and plain one-row decoding in ``"ar"`` mode, which is faster where the pad row is needed
        but rounds differently there, so it can part from the speculative answer at a numerical near-tie;
        sampled speculative decoding runs one-row passes where a round has no drafts (see :meth:`exact_for`).
        The drafter is loaded on first use when ``mode="ar"``.  ``mode="ssd"`` drafts the next round while
        the target verifies (:mod:`ssd`): give the two models their own cores or devices with
        ``draft_threads`` / ``draft_provider`` (default: the target's ``threads`` / ``provider``).
        ``provider_options`` go as they are to every session on the target's provider (the drafter's too
        when it shares that provider), e.g. ``{"device_id": "1"}``.

        Every answer is kept in the engine's suffix cache (``suffix_capacity`` tokens, least recently
        used dropped first), which speculative decoding drafts from: in memory only, unless
        ``cache_dir`` names a directory to keep it in across processes (one private file per bundle).
        ``corpus``: a directory whose text files (a repository) are read into it too.
        """
        bundle_dir = find_bundle(path)
        manifest = read_manifest(bundle_dir)
        verify_files(bundle_dir, manifest, full_hash=verify)
        weight_check = None if verify else WeightCheck(bundle_dir, manifest)  # hashes changed files meanwhile
        if config is None:
            config = loop_config(mode or DEFAULT_MODE)
        elif mode is not None and mode != config.mode:
            raise EdgeSpecError(
                f"mode {mode!r} does not match the {type(config).__name__} given (mode {config.mode!r})"
            )
        if threads < 0 or (draft_threads is not None and draft_threads < 0):
            raise EdgeSpecError("threads must be 0 (all cores) or more")
        capacity = min(context_length or manifest["context_length"], manifest["context_length"])
        tokenizer = TextTokenizer(bundle_dir)
        suffix_cache = open_suffix_cache(
            manifest,
            tokenizer.encode_literal,
            Path(cache_dir) if cache_dir is not None else None,
            suffix_capacity,
            Path(corpus) if corpus is not None else None,
        )
        target = Decoder(
            bundle_dir / manifest["target"]["onnx"],
            provider=provider,
            threads=threads,
            capacity=capacity,
            takes_turns=config.mode != "ar",
            provider_options=provider_options,
        )
        engine = cls(
            bundle_dir,
            manifest,
            tokenizer,
            target,
            provider=provider,
            threads=threads,
            config=config,
            draft_head=draft_head,
            draft_provider=draft_provider,
            draft_threads=draft_threads,
            exact=exact,
            provider_options=provider_options,
            eagle_head=eagle_head,
            suffix_cache=suffix_cache,
        )
        engine._weight_check = weight_check
        if isinstance(config, TreeConfig):
            check_tree(target, config)  # the verifier's draft count and the sampler are checked per request
        if config.mode != "ar":
            engine.measure_costs()  # loads the drafter too, so the first answer is not slowed down
        return engine

    def measure_costs(self) -> CostProfile:
        """Load (or measure quickly once and cache) this device's cost profile for the current drafter head:
        target passes over 1..γ_max+1 tokens, drafter body and head steps (see ``cost_profile``).
        The γ policy plans with it from the first round; live measurements refine it, and the cached
        profile after each request (:meth:`_correct_costs`)."""
        max_tokens = max(self.config.gamma + 1, 2)
        if self.target.capacity < 2 * max_tokens + 2:  # a draft of γ and its verify pass need the room
            raise EdgeSpecError(
                f"a context of {self.target.capacity} tokens is too short for speculative decoding "
                f"with drafts of up to {max_tokens - 1} tokens: give a context of at least "
                f"{2 * max_tokens + 2} tokens, or run mode 'ar'"
            )
        drafter = self.active_drafter()
        key = cost_profile.cache_key(self.manifest, self._drafter_entry(), *self._placement(), max_tokens)
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
        self._profile_calls = (dict(self.target.stats.calls), dict(steps.calls))
        return profile

    def _settle(self) -> None:
        """Before the machine is timed: let the weight check finish hashing, on a core the passes need (the
        first answer waits for its verdict anyway, and gives it)."""
        if self._weight_check is not None:
            try:
                self._weight_check.result()
            except EdgeSpecError:
                pass

    def _placement(self) -> tuple[str, str]:
        """Where the models run, as the cached device facts are keyed: providers (with options), threads."""
        options = ",".join(f"{k}={v}" for k, v in sorted(self._provider_options.items()))
        return f"{self._provider}[{options}]/{self._draft_provider}", f"{self._threads}/{self._draft_threads}"

    def exact_rows(self, check: bool = True) -> int:
        """Rows a batch-invariant target pass needs on this device: one where one-row passes were found
        equal to multi-row ones bit for bit (a graph that pads its own attention, on kernels without a
        one-row path; checked once per device and cached: ``row_invariance``), else the provider's.
        ``check`` False reads the cached verdict only: before the check, the provider's rows, exact
        without it (what the answers before :meth:`check_device` run)."""
        if self._one_row_exact is None:
            if not self.target.pads_attention:
                self._one_row_exact = False
            else:
                key = cost_profile.target_key(self.manifest, *self._placement())
                self._one_row_exact = (
                    cost_profile.remembered(key, lambda: one_row_passes_match(self.target))
                    if check
                    else cost_profile.recalled(key)
                )
        return 1 if self._one_row_exact else exact_min_rows(self._provider)

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

    def _correct_costs(self) -> None:
        """After a request, judge the cost profile by the live passes since it was loaded: one that they
        keep losing to belongs to a faster machine than this one is now, so the next load measures it
        again (``cost_profile.outgrown_by_live``); else store what they taught it: a profile they keep
        beating was measured under load and is replaced, estimated sizes take their live latencies
        (``cost_profile.refine_from_live``)."""
        stats, profile = self.target.stats, self.cost_profile
        if profile is None:
            return
        target_calls, step_calls = self._profile_calls
        calls = {n: c - target_calls.get(n, 0) for n, c in stats.calls.items()}
        if cost_profile.outgrown_by_live(profile, stats.recent, calls):
            cost_profile.forget(self._profile_key)
            return
        steps = self.active_drafter().decoder.stats
        drafted = {n: c - step_calls.get(n, 0) for n, c in steps.calls.items()}
        if cost_profile.refine_from_live(profile, stats.recent, calls, steps.recent, drafted):
            cost_profile.save(self._profile_key, profile)
            for n, seconds in profile.verify.items():  # and price the sizes not measured live from it now
                stats.profile[n] = seconds  # (what DecoderStats scales them by: live / this, where measured)
                if stats.calls.get(n, 0) < 2:
                    stats.recent[n] = seconds

    @property
    def bytes_ratio(self) -> float:
        """c in a memory-bound model: drafter bytes read per step / target bytes read per step."""
        if self.drafter_name() == "eagle":
            return (
                cost_profile.eagle_bytes(self.bundle_dir, self.manifest, self.eagle_head)
                / cost_profile.weight_bytes(self.bundle_dir, self.manifest, self.draft_head)[0]
            )
        target, draft = cost_profile.weight_bytes(self.bundle_dir, self.manifest, self.draft_head)
        return draft / target

    def drafter_name(self, config: LoopConfig | None = None) -> str:
        """Which drafter a configuration drafts with: the drafter model or the EAGLE head."""
        names = proposer_names(config or self.config)
        return next((n for n in names if n in DRAFTERS), "model")

    def active_drafter(self, config: LoopConfig | None = None) -> ChainDrafter:
        return self.eagle if self.drafter_name(config) == "eagle" else self.drafter

    def _drafter_entry(self, config: LoopConfig | None = None) -> dict:
        """What the active drafter's costs and acceptance depend on (its manifest record)."""
        if self.drafter_name(config) == "eagle":
            entry = self.manifest["eagle"]
            if "heads" not in entry:  # one graph: its record is all there is (cache keys as before the split)
                return entry
            layer = {k: v for k, v in entry.items() if k not in ("heads", "default_head", "files", "bytes")}
            return {"eagle": layer, "head": entry["heads"][self.eagle_head]}
        return {"head": self.manifest["draft"]["heads"][self.draft_head], "body": self.manifest["draft"]["config"]}

    def schedule_memory(self, config: LoopConfig | None = None) -> ScheduleMemory:
        """The schedule's acceptance calibration for this drafter and target, carried across requests
        and kept beside the cost profiles (``schedule.memory``)."""
        key = cost_profile.pair_key(self.manifest, self._drafter_entry(config))
        if key not in self._memories:
            self._memories[key] = ScheduleMemory(cost_profile.cache_dir() / f"acceptance-{key}.json")
        return self._memories[key]

    def _check_head(self, name: str) -> str:
        heads = self.manifest["draft"]["heads"]
        if name not in heads:
            raise EdgeSpecError(f"bundle has no drafter head {name!r}; available: {', '.join(heads)}")
        return name

    def _check_eagle_head(self, name: str | None) -> str | None:
        heads = eagle_heads(self.manifest)
        if not heads:
            if name is not None:
                raise EdgeSpecError(
                    f"bundle has no EAGLE head, so no EAGLE head {name!r}: train one with `edge-spec train-head BUNDLE`"
                )
            return None
        name = name or self.manifest["eagle"].get("default_head", "full")
        if name not in heads:
            raise EdgeSpecError(f"bundle has no EAGLE head {name!r}; available: {', '.join(heads)}")
        return name

    def use_eagle_head(self, name: str) -> None:
        """Switch the EAGLE head's LM head (its layer, features and KV cache are shared by all heads)."""
        self.eagle_head = self._check_eagle_head(name)
        if self._eagle is not None:
            self._eagle.lm_head = self._eagle_lm_head()
        if self.config.mode != "ar" and self.drafter_name() == "eagle":
            self.measure_costs()

    def use_draft_head(self, name: str) -> None:
        """Switch the drafter's LM head (the drafter body and its KV cache are shared by all heads)."""
        self.draft_head = self._check_head(name)
        if self.config.mode != "ar":
            self.measure_costs()

    @property
    def mode(self) -> str:
        return self.config.mode

    @property
    def drafter(self) -> ModelDrafter:
        """The drafter for the current head, loaded on first use."""
        if self._draft_body is None:
            self._draft_body = Decoder(
                self.bundle_dir / self.manifest["draft"]["onnx"],
                capacity=self.target.capacity,
                takes_turns=True,
                **self._draft_placement(),
            )
        if self.draft_head not in self._drafters:
            self._drafters[self.draft_head] = ModelDrafter(
                self._draft_body, self._load_head(self.draft_head), self.target.vocab_size
            )
        return self._drafters[self.draft_head]

    @property
    def eagle(self) -> EagleDrafter:
        """The bundle's EAGLE-3 head (``edge-spec train-head`` or a SpecForge checkpoint), loaded on first use."""
        if self._eagle is None:
            from edge_spec.runtime.model.embedding import TargetEmbedding

            entry = self.manifest.get("eagle")
            if not entry:
                raise EdgeSpecError("this bundle has no EAGLE head: train one with `edge-spec train-head BUNDLE`")
            if "features" not in self.target.output_names:
                raise EdgeSpecError(
                    "this bundle's target graph has no features output for its EAGLE head; "
                    "attach the head again with this edge-spec version"
                )
            where = self._draft_placement()
            head = Decoder(self.bundle_dir / entry["onnx"], capacity=self.target.capacity, takes_turns=True, **where)
            fc = small_session(self.bundle_dir / entry["fc_onnx"], what="EAGLE feature projection", **where)
            d2t = load_array(self.bundle_dir / entry["d2t"])
            ids = check_vocab_ids(np.arange(len(d2t)) + d2t, self.target.vocab_size)
            embedding = TargetEmbedding.from_onnx(self.bundle_dir / self.manifest["target"]["onnx"])
            self._eagle = EagleDrafter(head, fc, embedding.rows, ids, self.target.vocab_size, self._eagle_lm_head())
        return self._eagle

    def _eagle_lm_head(self) -> DraftHead | SpecVocabHead | None:
        """The current EAGLE LM head, loaded on first use (None: the single graph has it inside)."""
        name = self.eagle_head
        if name not in self._eagle_heads:
            head = eagle_heads(self.manifest)[name]
            self._eagle_heads[name] = None if head.get("kind") == "builtin" else self._load_head_entry(head, name)
        return self._eagle_heads[name]

    def _draft_placement(self) -> dict:
        """Where the drafter's sessions run: its provider, threads and, on the target's provider, its options."""
        options = self._provider_options if self._draft_provider.lower() == self._provider.lower() else {}
        return dict(provider=self._draft_provider, threads=self._draft_threads, provider_options=options)

    def _load_head(self, name: str) -> DraftHead | SpecVocabHead:
        return self._load_head_entry(self.manifest["draft"]["heads"][name], name)

    def _load_head_entry(self, head: dict, name: str) -> DraftHead | SpecVocabHead:
        """A drafter's (or the EAGLE head's) LM head from its manifest entry."""
        where = self._draft_placement()
        if head.get("kind") == "specvocab":
            always, universe = self._token_ids(head, "always_ids"), self._token_ids(head, "universe")
            try:
                return SpecVocabHead(
                    self.bundle_dir / head["onnx"],
                    self.bundle_dir / head["rows"],
                    self.bundle_dir / head["scales"],
                    head["candidates"],
                    always_ids=always,
                    universe=universe,
                    rows_by_universe=head.get("rows_by") == "universe",
                    **where,
                )
            except (ValueError, OSError, EOFError, KeyError) as exc:  # its int8 rows or scales
                raise EdgeSpecError(
                    f"cannot read drafter head {name!r} ({str(exc)[:120] or type(exc).__name__}): "
                    f"the bundle is damaged; run edge-spec info {self.bundle_dir} --verify"
                ) from None
        return DraftHead(self.bundle_dir / head["onnx"], vocab_ids=self._token_ids(head, "vocab_ids"), **where)

    def _token_ids(self, head: dict, key: str) -> np.ndarray | None:
        """A head's id table (vocabulary map, always-kept ids, scorer universe), checked against the target."""
        if not head.get(key):
            return None
        return check_vocab_ids(load_array(self.bundle_dir / head[key]), self.target.vocab_size)

    def cancel(self) -> None:
        """Stop the generation in progress (safe to call from another thread)."""
        self._cancel.set()

    def close(self) -> None:
        """Release the ONNX Runtime sessions and KV buffers now, not when the last reference goes: a timer
        or callback holding ``engine.cancel`` would otherwise keep gigabytes alive.  A generation in
        progress in another thread is cancelled and waited for; later calls raise :class:`EngineClosed`."""
        self.cancel()
        self._acquire(wait=True)
        try:
            if self._tokens is not None:
                self._tokens.close()
                self._tokens = None
            for memory in self._memories.values():
                memory.save()
            self._memories.clear()
            self.suffix_cache.save()
            self._drafters.clear()
            self._eagle_heads.clear()
            self._draft_body = self._eagle = None
            self.target = None
            self._closed = True
        finally:
            self._release()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosed(
                f"this engine was closed; load the bundle again: Engine.from_bundle({str(self.bundle_dir)!r})"
            )

    def prompt_ids(
        self, prompt: str | list[Message], check_length: bool = True, tools: list[dict] | None = None
    ) -> list[int]:
        """Token ids of a raw prompt or of chat messages through the chat template, which gets ``tools``
        (OpenAI's function schemas) when given (``check_length``: refuse a prompt that leaves no room in
        the context for an answer)."""
        if isinstance(prompt, str):
            if tools:
                raise EdgeSpecError("tools need chat messages, not a raw prompt")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = self.tokenizer.encode_chat(list(prompt), tools=tools)
        if not ids:
            raise EdgeSpecError("empty prompt")
        if check_length and len(ids) >= self.target.capacity:
            raise EdgeSpecError(f"prompt is {len(ids)} tokens, longer than the context length {self.target.capacity}")
        return ids

    def fit_messages(self, messages: list[Message], reserve: int) -> tuple[list[Message], int]:
        """The latest part of a conversation whose prompt leaves ``reserve`` tokens of the context for
        the answer, and how many messages were dropped to get it.

        A chat outgrows any context: rather than refusing the next turn, drop the oldest messages.
        A leading system message is kept, the last message is always kept, and what remains after the
        system message starts with a user message (some chat templates require that).  Raises
        :class:`EdgeSpecError` when the system and last messages alone leave less than ``reserve``.
        """
        messages = list(messages)
        system = messages[:1] if messages and messages[0].get("role") == "system" else []
        rest = messages[len(system) :]
        dropped = 0
        while (needed := len(self.prompt_ids(system + rest, check_length=False))) + reserve > self.target.capacity:
            if len(rest) <= 1:
                raise EdgeSpecError(
                    f"the prompt needs {needed} tokens even with only the last message; with {reserve} "
                    f"kept for the answer the context holds {self.target.capacity}: shorten it"
                )
            rest.pop(0)
            dropped += 1
            while len(rest) > 1 and rest[0].get("role") != "user":
                rest.pop(0)
                dropped += 1
        return system + rest, dropped

    def exact_for(self, mode: str, exact: bool | None = None, deterministic: bool = True) -> bool:
        """Whether a generation in ``mode`` runs batch-invariant target passes (call > engine > default).

        By default only deterministic speculative decoding does (greedy, or coupled sampling): there the
        padded passes make its answer bit-identical to ``ar --exact`` whatever the draft lengths.  A
        rejection-sampled answer already depends on the draft lengths through which random draws the
        verifier makes, so the pad row would buy no reproducibility, only cost: a draft-less round is
        then the one-row pass plain decoding runs."""
        wanted = exact if exact is not None else self.exact
        if wanted is None:  # padded until the device check finds a pad buys nothing here
            return mode != "ar" and deterministic and self.exact_available(check=False) is not False
        if wanted and not self.exact_available():
            elsewhere = " (the cpu provider is exact)" if self._provider != "cpu" else ""
            raise EdgeSpecError(
                f"exact decoding is not available on {self._provider} here: its kernels give a "
                "token's logits that depend on how many tokens share the pass (checked at the first "
                "request), so no padding makes passes batch-invariant; greedy output matches "
                f"target-only decoding up to that rounding{elsewhere}"
            )
        return wanted

    def config_for(self, mode: str | None) -> LoopConfig:
        """The engine's configuration, or for another ``mode`` that mode's defaults."""
        return self.config if mode in (None, self.config.mode) else loop_config(mode)

    @property
    def param_ratio(self) -> float:
        """c in MBSU: drafter parameters read per step / target parameters read per step."""
        if self.drafter_name() == "eagle":
            return self.manifest["eagle"]["parameters"] / self.manifest["target"]["parameters"]
        draft = self.manifest["draft"]
        head = draft["heads"][self.draft_head]
        return (draft["parameters"] + head["parameters"]) / self.manifest["target"]["parameters"]

    def generate(
        self,
        prompt: str | list[Message],
        *,
        max_new_tokens: int = 256,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        sampler: str = "rejection",
        stop: list[str] | tuple[str, ...] = (),
        mode: str | None = None,
        exact: bool | None = None,
        on_prefill: Callable[[float], None] | None = None,
        wait: bool = True,
        response_format: dict | None = None,
        tools: list[dict] | None = None,
        on_sources: Callable[[list[list[str]]], None] | None = None,
        logprobs: int | None = None,
        on_logprobs: Callable[[list[TokenLogprob]], None] | None = None,
    ) -> Iterator[str]:
        """Stream the answer as text chunks.  ``prompt`` is raw text or chat messages; ``mode`` and
        ``exact`` override the engine's for this call.  ``on_prefill(fraction)`` follows the reading of
        a prompt too long for one pass (see ``Decoder.prefill``); :meth:`cancel` also stops that.
        ``stop`` is one stop string or several.  ``sampler`` "coupled" makes a sampled answer a function
        of the seed alone, the same in every mode (``SamplingParams``).  ``response_format`` (OpenAI's
        shape: ``{"type": "json_object"}``, ``{"type": "json_schema", "json_schema": {"schema": ...}}``,
        see ``constrain.grammar``) constrains the answer to it, losslessly in ar and one-chain spec
        mode (refused elsewhere, in one line).  ``tools`` (OpenAI's function schemas) go to the chat
        template, which tells the model how to call them.  ``on_sources(pieces)`` is called before each
        text chunk is yielded with where its text came from, token by token: ``[[text, source], ...]``
        joining to the chunk, source "target" or the proposer of an accepted draft ("model", "lookup",
        "forced", ...; see :mod:`provenance`), and once more after the last chunk when the answer ends
        with tokens whose text is empty (their pieces join to ""); it reads the tokens, never changes
        them.  ``logprobs`` (0 to 20; None: nothing computed) keeps each token's log-probability and that
        many most likely alternatives under the target's own distribution there (its raw logits, whatever
        the sampling settings or constraint: :mod:`logprobs`) in :attr:`last_logprobs`, one per
        :attr:`last_token_ids` entry; ``on_logprobs(entries)`` is called before each text chunk is yielded
        with the entries of the tokens whose text begins in it (``text_offset`` set), and once more at the
        end for tokens whose text is empty, as ``on_sources`` is; tokens cut off with a stop string are
        never handed out.  Neither changes a token.  While another thread generates, the call waits for it
        (``wait=False``: raises :class:`EngineBusy`); see the class docstring."""
        self._acquire(wait)
        try:
            self._check_open()
            generation = self._take_over()
            with numpy_on_one_thread():
                yield from self._generate(
                    generation,
                    prompt,
                    max_new_tokens=max_new_tokens,
                    temperature=temperature,
                    top_k=top_k,
                    top_p=top_p,
                    seed=seed,
                    sampler=sampler,
                    stop=stop,
                    mode=mode,
                    exact=exact,
                    on_prefill=on_prefill,
                    response_format=response_format,
                    tools=tools,
                    on_sources=on_sources,
                    logprobs=logprobs,
                    on_logprobs=on_logprobs,
                )
        finally:
            self._release()

    def _acquire(self, wait: bool) -> None:
        me = threading.get_ident()
        with self._turn:
            if self._owner not in (None, me):
                if not wait:
                    raise EngineBusy("engine busy: another generation is in progress")
                self._turn.wait_for(lambda: self._owner is None)
            self._owner = me
            self._holds += 1

    def _release(self) -> None:
        with self._turn:
            self._holds -= 1
            if self._holds == 0:
                self._owner = None
                self._turn.notify_all()

    def _take_over(self) -> int:
        """Start a new generation (the engine is held): the one it replaces in this thread stops here,
        its token loop closed (an SSD loop's pending target pass finishes first)."""
        if self._tokens is not None:
            self._tokens.close()
            self._tokens = None
        self._generation += 1
        return self._generation

    def _check_active(self, generation: int) -> None:
        if generation != self._generation:
            raise GenerationSuperseded(
                "this generation was superseded by a newer one on the same engine "
                "(finish or close a generator before starting the next)"
            )

    def _generate(
        self,
        generation: int,
        prompt: str | list[Message],
        *,
        max_new_tokens: int,
        temperature: float,
        top_k: int,
        top_p: float,
        seed: int | None,
        sampler: str,
        stop: str | list[str] | tuple[str, ...],
        mode: str | None,
        exact: bool | None,
        response_format: dict | None = None,
        on_prefill: Callable[[float], None] | None,
        tools: list[dict] | None = None,
        on_sources: Callable[[list[list[str]]], None] | None = None,
        logprobs: int | None = None,
        on_logprobs: Callable[[list[TokenLogprob]], None] | None = None,
    ) -> Iterator[str]:
        params = SamplingParams(
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            seed=seed,
            end_ids=frozenset(self.tokenizer.eos_token_ids),
            sampler=sampler,
        )
        self._cancel.clear()  # before any work: a cancel from here on, during the set-up too, stops this answer
        if self._weight_check is not None:  # a bundle damaged in place answers nothing
            self._weight_check.result()
        config = self.config_for(mode)
        mode = config.mode
        if max_new_tokens < 1:
            raise EdgeSpecError("max_new_tokens must be at least 1")
        ids = self.prompt_ids(prompt, tools=tools)
        constraint = self.constraint_for(response_format, config)
        exact_passes = self.exact_for(mode, exact, params.deterministic)
        self.target.min_rows = self.pass_rows(mode) if exact_passes else 1
        self.target.lean_rows = self.exact_rows(check=False) if exact_passes else 1  # a round without drafts or guess
        max_new = min(max_new_tokens, self.target.capacity - len(ids) - 1)
        stats = GenerationStats(prompt_tokens=len(ids), mode=mode, coupled_seed=params.seed if params.coupled else None)
        self.last_stats = stats
        self.last_token_ids = []
        self.last_logprobs = []
        recorder = LogprobRecorder(logprobs or 0) if logprobs is not None or on_logprobs is not None else None
        chunk_logprobs = ChunkLogprobs(self.last_logprobs) if on_logprobs is not None else None
        tracked = on_sources is not None or on_logprobs is not None  # text pieces labelled by token index
        detok = SourcedText(self.tokenizer) if tracked else StreamingDetokenizer(self.tokenizer)
        stopper = StopMatcher([stop] if isinstance(stop, str) else list(stop))
        eos = self.tokenizer.eos_token_ids
        started = time.perf_counter()
        first_token_at = None
        spec_stats = SpecStats(token_sources=[] if on_sources is not None else None, token_logprobs=recorder)
        sources = spec_stats.token_sources if mode != "ar" else None  # ar: every token is the target's

        def hand_out(pieces: list[list]) -> None:
            """The side channels asked for, for the tokens of ``pieces`` ([[text, token index], ...])."""
            if on_sources is not None:
                on_sources([[piece, sources[i] if sources is not None else TARGET] for piece, i in pieces])
            if chunk_logprobs is not None:
                on_logprobs(chunk_logprobs.take(pieces))

        drafters = {} if mode == "ar" else {self.drafter_name(config): self.active_drafter(config)}
        context = ProposerContext(self.target.vocab_size, drafters, suffix_cache=self.suffix_cache)
        memory = None if mode == "ar" else self.schedule_memory(config)
        if self._cancel.is_set():  # cancelled during the set-up (a first request's checks and measurements)
            stats.stop_reason = "cancelled"
            return
        tokens = generate_tokens(
            config,
            self.target,
            context,
            ids,
            params,
            np.random.default_rng(params.seed),
            max_new,
            spec_stats,
            memory,
            constraint,
        )
        self._tokens = tokens
        watched = self._watch_prefill(mode, on_prefill)
        stats.stop_reason = "length"
        try:
            for token in tokens:
                if first_token_at is None:
                    first_token_at = time.perf_counter()
                    stats.prefill_seconds = first_token_at - started
                if token in eos:
                    stats.stop_reason = "eos"
                    break
                self.last_token_ids.append(token)
                if recorder is not None:
                    self.last_logprobs.append(recorder.entries[stats.new_tokens])
                stats.new_tokens += 1
                if not tracked:
                    text, stopped = stopper.feed(detok.push(token))
                else:
                    text, stopped = stopper.feed(detok.push(token, stats.new_tokens - 1))
                if text:
                    if tracked:
                        hand_out(detok.take(len(text)))
                    yield text
                    self._check_active(generation)
                if stopped:
                    stats.stop_reason = "stop"
                    break
                if self._cancel.is_set():
                    stats.stop_reason = "cancelled"
                    break
            if stats.stop_reason != "stop":
                text, stopped = stopper.feed(detok.flush())
                text += "" if stopped else stopper.flush()
                if text:
                    if tracked:
                        hand_out(detok.take(len(text)))
                    yield text
                if tracked and not stopped and detok.waiting():
                    hand_out(detok.take_rest())  # the last tokens, whose text is empty
        except PrefillCancelled:
            stats.stop_reason = "cancelled"
        except NonFiniteLogits:  # met while sampling: a model of the bundle computes garbage
            raise EdgeSpecError(
                f"the target or drafter produced NaN/inf logits: the bundle's weights are "
                f"damaged; run edge-spec info {self.bundle_dir} --verify"
            ) from None
        finally:
            if generation == self._generation:  # a superseded generation leaves the newer one's hooks alone
                for decoder in watched:
                    decoder.prefill_listener = None
                self._tokens = None
            tokens.close()
            end = time.perf_counter()
            stats.decode_seconds = end - (first_token_at or end)  # excludes prefill
            self.suffix_cache.remember(ids, self.last_token_ids)  # what later requests may draft from
            self.suffix_cache.save()
            if memory is not None:
                stats.spec = spec_stats.summary(self.param_ratio, self.bytes_ratio)
                memory.save()
                self._correct_costs()
        if mode != "ar" and stats.stop_reason != "cancelled":
            self.check_device()  # after the answer (a first one, on a new device), which it would delay

    def constraint_for(self, response_format: dict | None, config: LoopConfig | None = None) -> Constraint | None:
        """A fresh constraint for one answer in ``response_format`` (None: unconstrained), refused in one
        line where the loop ``config`` cannot honour it."""
        grammar = grammar_for(response_format)
        if grammar is None:
            return None
        check_constraint(config or self.config)
        return Constraint(grammar, self.grammar_vocabulary())

    def grammar_vocabulary(self) -> GrammarVocabulary:
        """The grammar engine's view of the bundle's tokenizer, built on the first constrained request."""
        if self._grammar_vocabulary is None:
            self._grammar_vocabulary = GrammarVocabulary(
                self.tokenizer.tokenizer, self.target.vocab_size, self.tokenizer.eos_token_ids
            )
        return self._grammar_vocabulary

    def _watch_prefill(self, mode: str, on_prefill: Callable[[float], None] | None) -> list[Decoder]:
        """Listen to the prefill passes of the decoders this mode uses: stop between passes once
        cancelled, and report progress as one fraction, each model weighted by its parameters (what
        its prefill costs).  Returns the decoders to unhook afterwards."""
        decoders = [self.target] if mode == "ar" else [self.target, self.active_drafter().decoder]
        weights = [1.0] if mode == "ar" else [1.0, self.param_ratio]
        for index, decoder in enumerate(decoders):
            start, share = sum(weights[:index]) / sum(weights), weights[index] / sum(weights)

            def listener(done: int, total: int, start: float = start, share: float = share) -> None:
                if self._cancel.is_set():
                    raise PrefillCancelled
                if on_prefill is not None:
                    on_prefill(start + share * done / total)

            decoder.prefill_listener = listener
        return decoders

    def complete(self, prompt: str | list[Message], *, wait: bool = True, **kwargs) -> Completion:
        """Non-streaming :meth:`generate` (the engine is held until its statistics are read)."""
        self._acquire(wait)
        try:
            text = "".join(self.generate(prompt, **kwargs))
            return Completion(text, list(self.last_token_ids), self.last_stats)
        finally:
            self._release()
