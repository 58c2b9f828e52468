"""Public Python API: ``Engine.from_bundle(path).generate(prompt)``.

The engine generates with a loaded bundle (:attr:`Engine.bundle`, :mod:`loaded`: the models, the tokenizer,
the suffix cache, the device's costs and exactness).  It owns the text side (:mod:`generation`: chat
template, detokenization, stop strings, cancellation, statistics), holds one generation at a time, and
hands the tokens to the loop its configuration names (:mod:`loops`), which knows nothing of text.  What a
caller sets per answer is one :class:`~edge_spec.runtime.options.GenerateOptions`.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

from edge_spec.errors import EdgeSpecError
from edge_spec.runtime import heap
from edge_spec.runtime.constrain import Constraint, GrammarVocabulary
from edge_spec.runtime.generation import prefill
from edge_spec.runtime.generation import prompt as prompting
from edge_spec.runtime.generation.constraints import Constraints
from edge_spec.runtime.generation.loading import load_engine
from edge_spec.runtime.generation.passes import exact_passes
from edge_spec.runtime.generation.prefill import PrefillCancelled
from edge_spec.runtime.generation.stats import Completion, GenerationStats
from edge_spec.runtime.generation.text_stream import TextStream
from edge_spec.runtime.generation.token_loop import token_loop
from edge_spec.runtime.generation.turns import EngineBusy, EngineClosed, GenerationSuperseded, Turns
from edge_spec.runtime.loaded import LoadedBundle, LoadOptions, drafter_name
from edge_spec.runtime.logprobs import LogprobRecorder, TokenLogprob
from edge_spec.runtime.loops.config import LoopConfig, loop_config
from edge_spec.runtime.loops.stats import SpecStats
from edge_spec.runtime.model.session import numpy_on_one_thread
from edge_spec.runtime.options import GenerateOptions
from edge_spec.runtime.progress import ProgressCallback
from edge_spec.runtime.schedule.cost_profile import CostProfile
from edge_spec.runtime.text import Message
from edge_spec.runtime.verify.sampling import NonFiniteLogits

__all__ = ["Completion", "Engine", "EngineBusy", "EngineClosed", "GenerationStats", "GenerationSuperseded"]


class Engine:
    """A loaded bundle ready to generate.  One generation runs at a time: :meth:`generate` holds the
    engine from its first chunk until the generator is exhausted or closed; a caller in another thread
    waits for it (or, with ``wait=False``, gets :class:`EngineBusy`).  A new generation in the same
    thread takes over, and the generator it replaced raises :class:`GenerationSuperseded`.
    :meth:`cancel` may be called from any thread."""

    def __init__(self, bundle: LoadedBundle, config: LoopConfig | None = None, *, exact: bool | None = None) -> None:
        self.bundle = bundle  # the models, the tokenizer, the suffix cache and what is known of this device
        self.config = config or loop_config("ar")
        self.exact = exact  # None: batch-invariant target passes in the speculative modes only (see exact_for)
        self._constraints = Constraints(bundle)  # see constraint_for
        self._closed = False
        self._turns = Turns()
        self.last_stats = GenerationStats()
        self.last_token_ids: list[int] = []
        self.last_logprobs: list[TokenLogprob] = []  # one per last_token_ids entry, when asked for

    @classmethod
    def from_bundle(
        cls,
        path: str | Path | None = None,
        options: LoadOptions | None = None,
        *,
        mode: str | None = None,
        config: LoopConfig | None = None,
        on_progress: ProgressCallback | None = None,
        cancel: threading.Event | None = None,
        **settings,
    ) -> Engine:
        """Load a bundle: ``path``, or the default bundle (:func:`edge_spec.paths.default_bundle`) when None.
        How (where the models run, which heads draft, where the suffix cache is kept, ...): ``options``, a
        :class:`~edge_spec.runtime.loaded.LoadOptions` as the CLI builds it, or its fields as keywords
        (``provider``, ``threads``, ``verify``, ``draft_head``, ``exact``, ...), set over ``options``.
        ``mode`` (``"spec"``, the default, ``"ar"`` or ``"ssd"``) picks a loop with its default settings,
        ``config`` a loop and its settings (``loops.config``); ``on_progress`` follows the load and
        ``cancel`` stops it (:mod:`~edge_spec.runtime.generation.loading`)."""
        options = replace(options, **settings) if options is not None else LoadOptions(**settings)
        return load_engine(cls, path, options, mode, config, on_progress, cancel)

    load = from_bundle  # the name the CLI calls it by, with its LoadOptions

    def drafter_name(self, config: LoopConfig | None = None) -> str:
        """Which drafter a configuration (default: the engine's) drafts with: the drafter model or the EAGLE head."""
        return drafter_name(config or self.config)

    def measure_costs(self) -> CostProfile:
        """Load or measure this device's cost profile for the engine's drafter and longest draft."""
        return self.bundle.measure_costs(self.config)

    def use_head(self, drafter: str, name: str) -> None:
        """Switch the model drafter ``drafter``'s LM head (what its heads share, and its KV cache, are kept)."""
        self.bundle.use_head(drafter, name)
        if self.config.mode != "ar" and self.drafter_name() == drafter:
            self.measure_costs()

    def use_eagle_head(self, name: str) -> None:
        """Switch the EAGLE head's LM head (its layer, features and KV cache are shared by all heads)."""
        self.use_head(self.bundle.drafter_for_option("eagle_head"), name)

    def use_draft_head(self, name: str) -> None:
        """Switch the drafter's LM head (the drafter body and its KV cache are shared by all heads)."""
        self.bundle.use_draft_head(name)
        if self.config.mode != "ar":
            self.measure_costs()

    def cancel(self) -> None:
        """Stop the generation in progress (safe to call from another thread): the model pass under way
        (a prefill pass, a drafter step or a verify pass) is cut and no other starts; the answer ends
        having given only verified tokens.  Passes of a first request's set-up are not cut: it ends
        after them."""
        self._turns.cancel()

    def close(self) -> None:
        """Release the ONNX Runtime sessions and KV buffers now, not when the last reference goes: a timer
        or callback holding ``engine.cancel`` would otherwise keep gigabytes alive.  A generation in
        progress in another thread is cancelled and waited for; later calls raise :class:`EngineClosed`."""
        self.cancel()
        with self._turns.held():
            self._turns.close_tokens()
            self.bundle.close()
            self._closed = True
        heap.release()  # the process's resident size falls by what the models held (see heap)

    @contextlib.contextmanager
    def held(self, wait: bool = True) -> Iterator[Engine]:
        """Hold the engine across several calls from this thread, as :meth:`complete` does for one
        answer: another thread's generation waits until the block ends (or, with ``wait=False`` here,
        this raises :class:`EngineBusy` when another thread holds it now)."""
        with self._turns.held(wait):
            yield self

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def prompt_ids(
        self,
        prompt: str | list[Message],
        check_length: bool = True,
        tools: list[dict] | None = None,
        response_format: dict | Constraint | None = None,
    ) -> list[int]:
        """Token ids of a raw prompt or of chat messages (:func:`~edge_spec.runtime.generation.prompt.prompt_ids`)."""
        capacity = self.bundle.target.capacity
        return prompting.prompt_ids(self.bundle.tokenizer, capacity, prompt, check_length, tools, response_format)

    def fit_messages(self, messages: list[Message], reserve: int) -> tuple[list[Message], int]:
        """The latest part of a conversation that leaves ``reserve`` tokens for the answer, and how many
        messages were dropped (:func:`~edge_spec.runtime.generation.prompt.fit_messages`)."""
        return prompting.fit_messages(self.bundle.tokenizer, self.bundle.target.capacity, messages, reserve)

    def exact_for(self, mode: str, exact: bool | None = None, deterministic: bool = True) -> bool:
        """Whether a generation in ``mode`` runs batch-invariant target passes: the call's ``exact``, else the
        engine's, else the default (:func:`~edge_spec.runtime.generation.passes.exact_passes`)."""
        return exact_passes(self.bundle, mode, exact if exact is not None else self.exact, deterministic)

    def generate(
        self, prompt: str | list[Message], options: GenerateOptions | None = None, *, wait: bool = True, **settings
    ) -> Iterator[str]:
        """Stream the answer to ``prompt`` (raw text or chat messages) as text chunks.  ``options``
        (:class:`~edge_spec.runtime.options.GenerateOptions`, which describes each setting) or its fields
        as keywords, set over ``options`` when both are given; an unknown keyword is a TypeError.
        :meth:`cancel` stops the answer.  While another thread generates, the call waits for it
        (``wait=False``: raises :class:`EngineBusy`); see the class docstring."""
        return self._held_generation(prompt, GenerateOptions.from_kwargs(options, **settings), wait)

    def _held_generation(self, prompt: str | list[Message], options: GenerateOptions, wait: bool) -> Iterator[str]:
        with self._turns.held(wait):
            if self._closed:
                where = str(self.bundle.bundle_dir)
                raise EngineClosed(f"this engine was closed; load the bundle again: Engine.from_bundle({where!r})")
            generation = self._turns.take_over()
            with numpy_on_one_thread():
                yield from self._generate(generation, prompt, options)

    def _generate(self, generation: int, prompt: str | list[Message], options: GenerateOptions) -> Iterator[str]:
        """One answer with the engine held: set up its token loop, then stream it (:meth:`_stream`)."""
        turns, bundle = self._turns, self.bundle
        turns.cancelled.clear()  # before any work: a cancel from here on, during the set-up too, stops this answer
        if bundle.weight_check is not None:  # a bundle damaged in place answers nothing
            bundle.weight_check.result()
        config = self.config if options.mode in (None, self.config.mode) else loop_config(options.mode)  # its defaults
        params = options.sampling(bundle.tokenizer.eos_token_ids)
        constraint = self.constraint_for(options.response_format, config)
        ids = self.prompt_ids(prompt, tools=options.tools, response_format=options.response_format)
        exact_passes = self.exact_for(config.mode, options.exact, params.deterministic)
        target, speculative = bundle.target, config.mode != "ar"
        target.min_rows = bundle.pass_rows(config.mode) if exact_passes else 1
        target.lean_rows = bundle.exact_rows(check=False) if exact_passes else 1  # a round without drafts or guess
        coupled_seed = params.seed if params.coupled else None
        self.last_stats = stats = GenerationStats(prompt_tokens=len(ids), mode=config.mode, coupled_seed=coupled_seed)
        self.last_token_ids, self.last_logprobs = [], []
        recorder = options.logprob_recorder()
        spec_stats = SpecStats(token_sources=[] if options.on_sources is not None else None, token_logprobs=recorder)
        started = time.perf_counter()
        max_new = min(options.max_new_tokens or target.capacity, target.capacity - len(ids) - 1)
        loop = token_loop(bundle, config, ids, params, max_new, spec_stats, constraint)
        if turns.cancelled.is_set():  # cancelled during the set-up (a first request's checks and measurements)
            stats.stop_reason = "cancelled"
            return
        turns.tokens, turns.interruptible = loop.tokens, loop.decoders
        sources = spec_stats.token_sources if speculative else None  # ar: every token is the target's
        text = TextStream(bundle.tokenizer, options, sources, self.last_logprobs)
        prefill.watch(loop.decoders, turns.cancelled.is_set, options.on_prefill)
        try:
            yield from self._stream(generation, loop.tokens, text, recorder, started)
        finally:
            if generation == turns.generation:  # a superseded generation leaves the newer one's hooks alone
                prefill.unwatch(loop.decoders)
                turns.tokens, turns.interruptible = None, []
            loop.tokens.close()
            bundle.suffix_cache.remember(ids, self.last_token_ids)  # what later requests may draft from
            bundle.suffix_cache.save(throttled=True)
            if loop.memory is not None:
                stats.spec = spec_stats.summary(bundle.param_ratio(config), bundle.bytes_ratio(config))
                loop.memory.save()
                if config is self.config:  # the cost profile was measured for the engine's loop, not another
                    bundle.correct_costs(config)
        if speculative and stats.stop_reason != "cancelled":
            bundle.check_device()  # after the answer (a first one, on a new device), which it would delay

    def _stream(
        self, generation: int, tokens: Iterator[int], text: TextStream, recorder: LogprobRecorder | None, started: float
    ) -> Iterator[str]:
        """The answer's text chunks from its token loop, its statistics kept in :attr:`last_stats`."""
        stats, cancelled = self.last_stats, self._turns.cancelled.is_set
        eos, first_token_at = self.bundle.tokenizer.eos_token_ids, None
        stats.stop_reason = "length"
        try:
            for token in prefill.until_interrupted(tokens, cancelled):
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
                chunk = text.push(token)
                if chunk:
                    yield chunk
                    self._turns.check_active(generation)
                if text.stopped or cancelled():
                    stats.stop_reason = "stop" if text.stopped else "cancelled"
                    break
            else:
                if cancelled():  # the loop ended mid-round, before a model pass
                    stats.stop_reason = "cancelled"
            if stats.stop_reason != "stop":
                chunk = text.flush()
                if chunk:
                    yield chunk
                text.finish()
        except PrefillCancelled:
            stats.stop_reason = "cancelled"
        except NonFiniteLogits:  # met while sampling: a model of the bundle computes garbage
            raise EdgeSpecError(
                f"the target or drafter produced NaN/inf logits: the bundle's weights are "
                f"damaged; run edge-spec info {self.bundle.bundle_dir} --verify"
            ) from None
        finally:
            end = time.perf_counter()
            stats.decode_seconds = end - (first_token_at or end)  # excludes prefill

    def constraint_for(
        self, response_format: dict | Constraint | None, config: LoopConfig | None = None, **how
    ) -> Constraint | None:
        """The constraint of one answer in the loop ``config`` (default: the engine's), refused in one line
        where that loop cannot honour it; ``how``: ``grammar``, ``vet``
        (:meth:`Constraints.make <edge_spec.runtime.generation.constraints.Constraints.make>`)."""
        return self._constraints.make(response_format, config or self.config, **how)

    def grammar_vocabulary(self) -> GrammarVocabulary:
        """The grammar engine's view of the bundle's tokenizer, built on the first constrained request."""
        return self._constraints.vocabulary()

    def complete(
        self, prompt: str | list[Message], options: GenerateOptions | None = None, *, wait: bool = True, **settings
    ) -> Completion:
        """Non-streaming :meth:`generate` (the engine is held until its statistics are read)."""
        with self._turns.held(wait):
            text = "".join(self.generate(prompt, options, **settings))
            return Completion(text, list(self.last_token_ids), self.last_stats)
