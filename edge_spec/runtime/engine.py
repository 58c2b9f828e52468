"""Public Python API: ``Engine.from_bundle(path).generate(prompt)``.

The engine generates with a loaded bundle (:mod:`loaded`: the models, the tokenizer, the suffix cache
and the device's cost profile and exactness verdicts).  It owns the text side (chat template, streaming
detokenization, stop strings, cancellation, statistics), holds one generation at a time, and delegates
token generation to the loop its configuration names (:mod:`loops`).  Token loops know nothing about
text; the engine knows nothing about KV caches.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edge_spec.defaults import DEFAULT_MODE, DEFAULT_PROVIDER, DEFAULT_THREADS
from edge_spec.errors import EdgeSpecError
from edge_spec.runtime import heap
from edge_spec.runtime.constrain import (
    Constraint,
    GrammarVocabulary,
    grammar_for,
    schema_instruction,
    with_instruction,
)
from edge_spec.runtime.loaded import BundleFiles, LoadedBundle, LoadOptions, drafter_name
from edge_spec.runtime.logprobs import ChunkLogprobs, LogprobRecorder, TokenLogprob
from edge_spec.runtime.loops import check_constraint, generate_tokens
from edge_spec.runtime.loops.config import LoopConfig, TreeConfig, loop_config
from edge_spec.runtime.loops.stats import TARGET, SpecStats, SpecSummary
from edge_spec.runtime.loops.tree import check_tree
from edge_spec.runtime.model.decoder import Decoder, PassInterrupted
from edge_spec.runtime.model.session import numpy_on_one_thread
from edge_spec.runtime.progress import LoadTracker, ProgressCallback
from edge_spec.runtime.propose.context import ProposerContext
from edge_spec.runtime.propose.drafters import DRAFTERS
from edge_spec.runtime.propose.eagle import EagleDrafter
from edge_spec.runtime.propose.model import ChainDrafter, ModelDrafter
from edge_spec.runtime.propose.suffix_cache import DEFAULT_CAPACITY as DEFAULT_SUFFIX_CAPACITY
from edge_spec.runtime.propose.suffix_cache import SuffixCache
from edge_spec.runtime.provenance import SourcedText
from edge_spec.runtime.schedule.cost_profile import CostProfile
from edge_spec.runtime.schedule.memory import ScheduleMemory
from edge_spec.runtime.text import Message, StopMatcher, StreamingDetokenizer, TextTokenizer
from edge_spec.runtime.verify.sampling import NonFiniteLogits, SamplingParams


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


def _role_bytes(manifest: dict, role: str | None) -> int:
    """The bytes of a manifest role's files (0 for None or a role the bundle lacks): what reading it costs."""
    return sum(record["bytes"] for record in (manifest.get(role) or {}).get("files", [])) if role else 0


def _bundle_bytes(path: str | Path | None) -> int:
    """The bytes of all of a bundle's recorded files: what verifying it hashes."""
    from edge_spec.manifest import ROLES, read_manifest
    from edge_spec.paths import find_bundle

    manifest = read_manifest(find_bundle(path))
    return sum(_role_bytes(manifest, role) for role in ROLES)


class EngineClosed(EdgeSpecError):
    """A generation asked of an engine after :meth:`Engine.close`."""


class Engine:
    """A loaded bundle ready to generate.  One generation runs at a time: :meth:`generate` holds the
    engine from its first chunk until the generator is exhausted or closed; a caller in another thread
    waits for it (or, with ``wait=False``, gets :class:`EngineBusy`).  A new generation in the same
    thread takes over, and the generator it replaced raises :class:`GenerationSuperseded`.
    :meth:`cancel` may be called from any thread."""

    def __init__(self, loaded: LoadedBundle, config: LoopConfig | None = None, *, exact: bool | None = None) -> None:
        self.loaded = loaded  # the models, the tokenizer, the suffix cache and what is known of this device
        self.config = config or loop_config("ar")
        self.exact = exact  # None: batch-invariant target passes in the speculative modes only (see exact_for)
        self._grammar_vocabulary: GrammarVocabulary | None = None  # see grammar_vocabulary
        self._closed = False
        self._cancel = threading.Event()
        self._turn = threading.Condition()  # who holds the engine: one thread, possibly several times
        self._owner: int | None = None
        self._holds = 0
        self._generation = 0  # the active generation; an older generator raises when resumed
        self._tokens: Iterator[int] | None = None  # the active generation's token loop
        self._interruptible: list[Decoder] = []  # the decoders of the active generation's token loop
        self.last_stats = GenerationStats()
        self.last_token_ids: list[int] = []
        self.last_logprobs: list[TokenLogprob] = []  # one per last_token_ids entry, when asked for

    @classmethod
    def from_bundle(
        cls,
        path: str | Path | None = None,
        *,
        provider: str = DEFAULT_PROVIDER,
        threads: int = DEFAULT_THREADS,
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
        on_progress: ProgressCallback | None = None,
        cancel: threading.Event | None = None,
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
        see :mod:`decoder`, unless this device's one-row passes were found exact:
        :meth:`~edge_spec.runtime.loaded.LoadedBundle.exact_rows`):
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

        ``on_progress(LoadProgress(stage, fraction))`` follows the load (:mod:`~edge_spec.runtime.progress`:
        stages ``verifying``, ``reading``, ``measuring``); its returning False, or ``cancel`` (a
        ``threading.Event`` set from any thread), stops the load with
        :class:`~edge_spec.runtime.progress.LoadCancelled`, having freed what it loaded.  With either, the
        load also waits for the check of the files changed since they were last found whole (which the
        first answer waits for otherwise), so that the progress covers it.
        """
        options = LoadOptions(
            provider=provider,
            threads=threads,
            context_length=context_length,
            draft_head=draft_head,
            verify=verify,
            draft_provider=draft_provider,
            draft_threads=draft_threads,
            exact=exact,
            provider_options=provider_options,
            eagle_head=eagle_head,
            cache_dir=cache_dir,
            suffix_capacity=suffix_capacity,
            corpus=corpus,
        )
        return cls.load(path, options, mode=mode, config=config, on_progress=on_progress, cancel=cancel)

    @classmethod
    def load(
        cls,
        path: str | Path | None = None,
        options: LoadOptions | None = None,
        *,
        mode: str | None = None,
        config: LoopConfig | None = None,
        on_progress: ProgressCallback | None = None,
        cancel: threading.Event | None = None,
    ) -> "Engine":
        """:meth:`from_bundle` with its load settings in one :class:`~edge_spec.runtime.loaded.LoadOptions`
        (None: the defaults), as the CLI builds them from its flags; ``mode`` and ``config`` pick the loop,
        ``on_progress`` and ``cancel`` follow and stop the load (see :meth:`from_bundle`)."""
        options = options or LoadOptions()
        tracker = LoadTracker(on_progress, cancel, str(path) if path is not None else "the default bundle")
        if options.verify and tracker.active:
            tracker.report("verifying", 0.0)
            files = BundleFiles.open(path, True, tracker.counter("verifying", _bundle_bytes(path)))
            tracker.report("verifying", 1.0)
        else:
            files = BundleFiles.open(path, options.verify)
        if config is None:
            config = loop_config(mode or DEFAULT_MODE)
        elif mode is not None and mode != config.mode:
            raise EdgeSpecError(
                f"mode {mode!r} does not match the {type(config).__name__} given (mode {config.mode!r})"
            )
        try:
            options.check()
            return cls._load_models(files, options, config, tracker)
        except BaseException:  # a failed or cancelled load: its models were closed, its hashing is stopped
            if files.weight_check is not None:
                files.weight_check.stop()
            heap.release()
            raise

    @classmethod
    def _load_models(
        cls, files: BundleFiles, options: LoadOptions, config: LoopConfig, tracker: LoadTracker
    ) -> "Engine":
        """The models of an opened bundle, loaded (and this machine's costs measured for the speculative
        modes), the progress told to ``tracker``; a failed or cancelled load closes what it loaded."""
        speculative = config.mode != "ar"
        drafter_role = DRAFTERS[drafter_name(config)].manifest_key if speculative else None
        target_bytes, drafter_bytes = (_role_bytes(files.manifest, role) for role in ("target", drafter_role))
        tracker.report("reading", 0.0)
        loaded = LoadedBundle.load(files, options, takes_turns=speculative)
        try:
            engine = cls(loaded, config, exact=options.exact)
            tracker.report("reading", target_bytes / max(target_bytes + drafter_bytes, 1))
            if isinstance(config, TreeConfig):
                check_tree(loaded.target, config)  # the verifier's draft count and the sampler are checked per request
            if speculative:
                engine.active_drafter()  # loaded now, so the first answer is not slowed down
            tracker.report("reading", 1.0)
            if tracker.active and not options.verify:
                tracker.wait_for(files.weight_check)
            if speculative:
                tracker.report("measuring", 0.0)
                engine.measure_costs()
                tracker.report("measuring", 1.0)
            return engine
        except BaseException:
            loaded.close()
            raise

    # what the loaded bundle holds, read where the engine is
    @property
    def bundle_dir(self) -> Path:
        return self.loaded.bundle_dir

    @property
    def manifest(self) -> dict:
        return self.loaded.manifest

    @property
    def tokenizer(self) -> TextTokenizer:
        return self.loaded.tokenizer

    @property
    def target(self) -> Decoder:
        """The target model (None once the engine is closed)."""
        return self.loaded.target

    @property
    def suffix_cache(self) -> SuffixCache:
        """Earlier answers the ``suffix`` proposer drafts from; every answer is kept in it."""
        return self.loaded.suffix_cache

    @property
    def draft_head(self) -> str:
        return self.loaded.draft_head

    @property
    def eagle_head(self) -> str | None:
        return self.loaded.eagle_head

    @property
    def drafter(self) -> ModelDrafter:
        """The drafter model with the current head, loaded on first use."""
        return self.loaded.drafter

    @property
    def eagle(self) -> EagleDrafter:
        """The bundle's EAGLE-3 head, loaded on first use."""
        return self.loaded.eagle

    @property
    def cost_profile(self) -> CostProfile | None:
        """This device's cost profile for the configured drafter (None in ``"ar"`` mode until measured)."""
        return self.loaded.cost_profile

    @property
    def mode(self) -> str:
        return self.config.mode

    # what depends on the configured loop: which drafter drafts, how far
    def drafter_name(self, config: LoopConfig | None = None) -> str:
        """Which drafter a configuration (default: the engine's) drafts with: the drafter model or the EAGLE head."""
        return drafter_name(config or self.config)

    def active_drafter(self, config: LoopConfig | None = None) -> ChainDrafter:
        """The drafter a configuration (default: the engine's) drafts with, loaded on first use."""
        return self.loaded.active_drafter(config or self.config)

    def schedule_memory(self, config: LoopConfig | None = None) -> ScheduleMemory:
        """The schedule's acceptance calibration for a configuration's drafter (default: the engine's)."""
        return self.loaded.schedule_memory(config or self.config)

    def measure_costs(self) -> CostProfile:
        """Load or measure this device's cost profile for the engine's drafter and longest draft
        (:meth:`LoadedBundle.measure_costs <edge_spec.runtime.loaded.LoadedBundle.measure_costs>`)."""
        return self.loaded.measure_costs(self.config)

    def use_head(self, drafter: str, name: str) -> None:
        """Switch the model drafter ``drafter``'s LM head (what its heads share, and its KV cache, are kept)."""
        self.loaded.use_head(drafter, name)
        if self.config.mode != "ar" and self.drafter_name() == drafter:
            self.measure_costs()

    def use_eagle_head(self, name: str) -> None:
        """Switch the EAGLE head's LM head (its layer, features and KV cache are shared by all heads)."""
        self.use_head(self.loaded.drafter_for_option("eagle_head"), name)

    def use_draft_head(self, name: str) -> None:
        """Switch the drafter's LM head (the drafter body and its KV cache are shared by all heads)."""
        self.loaded.use_draft_head(name)
        if self.config.mode != "ar":
            self.measure_costs()

    @property
    def param_ratio(self) -> float:
        """c in MBSU: drafter parameters read per step / target parameters read per step."""
        return self.loaded.param_ratio(self.config)

    @property
    def bytes_ratio(self) -> float:
        """c in a memory-bound model: drafter bytes read per step / target bytes read per step."""
        return self.loaded.bytes_ratio(self.config)

    def cancel(self) -> None:
        """Stop the generation in progress (safe to call from another thread): the model pass under way
        (a prefill pass, a drafter step or a verify pass) is cut and no other starts; the answer ends
        having given only verified tokens.  Passes of a first request's set-up are not cut: it ends
        after them."""
        self._cancel.set()
        for decoder in self._interruptible:  # after the flag: a pass starting now sees it (stop_requested)
            decoder.interrupt()

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
            self.loaded.close()
            self._closed = True
        finally:
            self._release()
        heap.release()  # the process's resident size falls by what the models held (see heap)

    @contextlib.contextmanager
    def held(self, wait: bool = True) -> Iterator["Engine"]:
        """Hold the engine across several calls from this thread, as :meth:`complete` does for one
        answer: another thread's generation waits until the block ends (or, with ``wait=False`` here,
        this raises :class:`EngineBusy` when another thread holds it now)."""
        self._acquire(wait)
        try:
            yield self
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
        self,
        prompt: str | list[Message],
        check_length: bool = True,
        tools: list[dict] | None = None,
        response_format: dict | Constraint | None = None,
    ) -> list[int]:
        """Token ids of a raw prompt or of chat messages through the chat template, which gets ``tools``
        (OpenAI's function schemas) when given and a JSON schema ``response_format`` as a system
        instruction (``constrain.instruction``: the model is told the format it is held to);
        ``check_length``: refuse a prompt that leaves no room in the context for an answer."""
        if isinstance(prompt, str):
            if tools:
                raise EdgeSpecError("tools need chat messages, not a raw prompt")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = self._encode_chat_told(list(prompt), schema_instruction(response_format), tools)
        if not ids:
            raise EdgeSpecError("empty prompt")
        if check_length and len(ids) >= self.target.capacity:
            raise EdgeSpecError(f"prompt is {len(ids)} tokens, longer than the context length {self.target.capacity}")
        return ids

    def _encode_chat_told(
        self, messages: list[Message], instruction: str | None, tools: list[dict] | None
    ) -> list[int]:
        """``messages`` through the chat template with ``instruction`` as system text, or in the first user
        message where the template refuses the system message it would be (Gemma 2's, older Mistral's)."""
        told = with_instruction(messages, instruction)
        try:
            return self.tokenizer.encode_chat(told, tools=tools)
        except EdgeSpecError:
            if instruction is None or (messages and messages[0].get("role") == "system"):
                raise  # nothing added, or the conversation's own system message is what the template refuses
            return self.tokenizer.encode_chat(with_instruction(messages, instruction, into_user=True), tools=tools)

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
            return mode != "ar" and deterministic and self.loaded.exact_available(check=False) is not False
        if wanted and not self.loaded.exact_available():
            provider = self.loaded.options.provider
            elsewhere = " (the cpu provider is exact)" if provider != "cpu" else ""
            raise EdgeSpecError(
                f"exact decoding is not available on {provider} here: its kernels give a "
                "token's logits that depend on how many tokens share the pass (checked at the first "
                "request), so no padding makes passes batch-invariant; greedy output matches "
                f"target-only decoding up to that rounding{elsewhere}"
            )
        return wanted

    def config_for(self, mode: str | None) -> LoopConfig:
        """The engine's configuration, or for another ``mode`` that mode's defaults."""
        return self.config if mode in (None, self.config.mode) else loop_config(mode)

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
        response_format: dict | Constraint | None = None,
        tools: list[dict] | None = None,
        on_sources: Callable[[list[list[str]]], None] | None = None,
        logprobs: int | None = None,
        on_logprobs: Callable[[list[TokenLogprob]], None] | None = None,
        marked_tokens: Collection[int] = (),
    ) -> Iterator[str]:
        """Stream the answer as text chunks.  ``prompt`` is raw text or chat messages; ``mode`` and
        ``exact`` override the engine's for this call.  ``on_prefill(fraction)`` follows the reading of
        a prompt too long for one pass (see ``Decoder.prefill``); :meth:`cancel` also stops that.
        ``stop`` is one stop string or several.  ``sampler`` "coupled" makes a sampled answer a function
        of the seed alone, the same in every mode (``SamplingParams``).  ``response_format`` (OpenAI's
        shape: ``{"type": "json_object"}``, ``{"type": "json_schema", "json_schema": {"schema": ...}}``,
        see ``constrain.grammar``) constrains the answer to it, losslessly in ar and one-chain spec
        mode (refused elsewhere, in one line), or is a constraint :meth:`constraint_for` compiled
        already; a JSON schema is also shown to the model when the prompt is chat messages
        (``constrain.instruction``).  ``tools`` (OpenAI's function schemas) go to the chat
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
        never handed out.  Neither changes a token.  ``marked_tokens``: token ids whose text the answer
        gives whole after :data:`~edge_spec.runtime.text.TOKEN_MARK` (a character no decoded text holds),
        so that a reader tells them from their characters spelled by other tokens (the server's tool-call
        parser: the model's ``<tool_call>`` token); not with ``on_sources`` or ``on_logprobs``.  While
        another thread generates, the call waits for it (``wait=False``: raises :class:`EngineBusy`); see
        the class docstring."""
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
                    marked_tokens=marked_tokens,
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
        response_format: dict | Constraint | None = None,
        on_prefill: Callable[[float], None] | None,
        tools: list[dict] | None = None,
        on_sources: Callable[[list[list[str]]], None] | None = None,
        logprobs: int | None = None,
        on_logprobs: Callable[[list[TokenLogprob]], None] | None = None,
        marked_tokens: Collection[int] = (),
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
        if self.loaded.weight_check is not None:  # a bundle damaged in place answers nothing
            self.loaded.weight_check.result()
        config = self.config_for(mode)
        mode = config.mode
        if max_new_tokens < 1:
            raise EdgeSpecError("max_new_tokens must be at least 1")
        constraint = self.constraint_for(response_format, config)
        ids = self.prompt_ids(prompt, tools=tools, response_format=response_format)
        exact_passes = self.exact_for(mode, exact, params.deterministic)
        self.target.min_rows = self.loaded.pass_rows(mode) if exact_passes else 1
        # the rows of a round without drafts or guess
        self.target.lean_rows = self.loaded.exact_rows(check=False) if exact_passes else 1
        max_new = min(max_new_tokens, self.target.capacity - len(ids) - 1)
        stats = GenerationStats(prompt_tokens=len(ids), mode=mode, coupled_seed=params.seed if params.coupled else None)
        self.last_stats = stats
        self.last_token_ids = []
        self.last_logprobs = []
        recorder = LogprobRecorder(logprobs or 0) if logprobs is not None or on_logprobs is not None else None
        chunk_logprobs = ChunkLogprobs(self.last_logprobs) if on_logprobs is not None else None
        tracked = on_sources is not None or on_logprobs is not None  # text pieces labelled by token index
        if tracked and marked_tokens:
            raise EdgeSpecError("marked tokens and per-token sources or log-probabilities cannot go together")
        detok = SourcedText(self.tokenizer) if tracked else StreamingDetokenizer(self.tokenizer, marked_tokens)
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
            self._cancel.is_set,  # seen between any two model passes, mid-round too
        )
        self._tokens = tokens
        watched = self._watch_prefill(mode, on_prefill)
        self._interruptible = watched
        stats.stop_reason = "length"
        try:
            for token in self._until_interrupted(tokens):
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
            else:
                if self._cancel.is_set():  # the loop ended mid-round, before a model pass
                    stats.stop_reason = "cancelled"
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
                    decoder.prefill_listener = decoder.stop_requested = None
                self._tokens = None
                self._interruptible = []
            tokens.close()
            end = time.perf_counter()
            stats.decode_seconds = end - (first_token_at or end)  # excludes prefill
            self.suffix_cache.remember(ids, self.last_token_ids)  # what later requests may draft from
            self.suffix_cache.save(throttled=True)
            if memory is not None:
                stats.spec = spec_stats.summary(self.param_ratio, self.bytes_ratio)
                memory.save()
                self.loaded.correct_costs(self.config)
        if mode != "ar" and stats.stop_reason != "cancelled":
            self.loaded.check_device()  # after the answer (a first one, on a new device), which it would delay

    def constraint_for(
        self,
        response_format: dict | Constraint | None,
        config: LoopConfig | None = None,
        *,
        grammar: str | None = None,
        vet: Callable[[str], None] | None = None,
    ) -> Constraint | None:
        """The constraint of one answer (None: unconstrained): ``response_format`` compiled here, or one
        compiled already (a server compiles each request's once, with this method), taken as it is: fresh
        and of this bundle's vocabulary.  Where the loop ``config`` cannot honour a constraint it is
        refused here, in one line (``ConstraintUnsupported``), before anything is compiled: the one place
        that is decided.  ``grammar``: ``grammar_for(response_format)`` when the caller has it already;
        ``vet(grammar)`` runs before the compile (a server checks the grammar in a child process it can
        stop at a time limit, ``constrain.isolated``)."""
        compiled = response_format if isinstance(response_format, Constraint) else None
        if compiled is None and grammar is None:
            grammar = grammar_for(response_format)
            if grammar is None:
                return None
        check_constraint(config or self.config)
        if compiled is not None:
            if compiled.tokens or compiled.vocabulary is not self.grammar_vocabulary():
                raise EdgeSpecError("response_format: a compiled constraint is fresh and of this model's vocabulary")
            return compiled
        if vet is not None:
            vet(grammar)
        return Constraint(grammar, self.grammar_vocabulary(), response_format)

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
        its prefill costs); refuse their passes once cancelled (see :meth:`cancel`).  Returns the
        decoders to unhook afterwards."""
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
            decoder.stop_requested = self._cancel.is_set  # a pass about to start when cancel() came
        return decoders

    def _until_interrupted(self, tokens: Iterator[int]) -> Iterator[int]:
        """The token loop's tokens until a pass of it is cut by :meth:`cancel`: the answer then ends as a
        cancel between passes ends it (the tokens given were verified; the text held back is flushed)."""
        try:
            yield from tokens
        except PassInterrupted:
            if not self._cancel.is_set():  # only cancel() cuts passes
                raise

    def complete(self, prompt: str | list[Message], *, wait: bool = True, **kwargs) -> Completion:
        """Non-streaming :meth:`generate` (the engine is held until its statistics are read)."""
        self._acquire(wait)
        try:
            text = "".join(self.generate(prompt, **kwargs))
            return Completion(text, list(self.last_token_ids), self.last_stats)
        finally:
            self._release()
