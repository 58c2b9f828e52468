"""What a caller may set for one answer, as one value built once and handed down whole.

:class:`GenerateOptions` holds every per-answer setting of :meth:`Engine.generate
<edge_spec.runtime.engine.Engine.generate>`: sampling, stop strings, the token budget, the loop's mode,
a constraint, the chat template's tools and the side channels (progress, sources, log-probabilities).
The Python API builds it from keywords (:meth:`GenerateOptions.from_kwargs`), the server from a
request (``server.schemas.Sampling.options``); the engine reads it, never a keyword list.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, fields, replace

from edge_spec.errors import EdgeSpecError
from edge_spec.runtime.constrain import Constraint
from edge_spec.runtime.logprobs import LogprobRecorder, TokenLogprob
from edge_spec.runtime.verify.sampling import SamplingParams

DEFAULT_MAX_NEW_TOKENS = 256  # an answer's most tokens when the Python API is given no limit


@dataclass(frozen=True)
class GenerateOptions:
    """One answer's settings, as :meth:`Engine.generate <edge_spec.runtime.engine.Engine.generate>` takes them.

    ``max_new_tokens``: the most tokens of the answer (None: until the end token or a full context).
    ``temperature`` (0: greedy), ``top_k``, ``top_p`` and ``seed`` set the sampling; ``sampler``
    "coupled" makes a sampled answer a function of the seed alone, the same in every mode
    (``SamplingParams``).  ``stop``: one stop string or several.  ``mode`` and ``exact`` override the
    engine's for this answer (a mode other than the engine's runs with that mode's defaults).
    ``response_format`` (OpenAI's shape: ``{"type": "json_object"}``, ``{"type": "json_schema",
    "json_schema": {"schema": ...}}``, see ``constrain.grammar``) constrains the answer to it, losslessly
    in ar and one-chain spec mode (refused elsewhere, in one line); a JSON schema is also shown to the
    model when the prompt is chat messages (``constrain.instruction``).  ``tools`` (OpenAI's function
    schemas) go to the chat template, which tells the model how to call them.

    Side channels, which read the tokens and never change them: ``on_prefill(fraction)`` follows the
    reading of a prompt too long for one pass (``Decoder.prefill``).  ``on_sources(pieces)`` is called
    before each text chunk is yielded with where its text came from, token by token: ``[[text,
    source], ...]`` joining to the chunk, source "target" or the proposer of an accepted draft ("model",
    "lookup", "forced", ...; see :mod:`provenance`), and once more after the last chunk when the answer
    ends with tokens whose text is empty.  ``logprobs`` (0 to 20; None: nothing computed) keeps each
    token's log-probability and that many most likely alternatives under the target's own distribution
    (its raw logits, whatever the sampling or constraint: :mod:`logprobs`) in ``Engine.last_logprobs``;
    ``on_logprobs(entries)`` gets the entries of the tokens whose text begins in each chunk, as
    ``on_sources`` gets their sources.  Tokens cut off with a stop string are never handed out.
    ``marked_tokens``: token ids whose text the answer gives whole after
    :data:`~edge_spec.runtime.text.TOKEN_MARK` (a character no decoded text holds), so that a reader
    tells them from their characters spelled by other tokens (the server's tool-call parser); not with
    ``on_sources`` or ``on_logprobs``."""

    max_new_tokens: int | None = DEFAULT_MAX_NEW_TOKENS
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    sampler: str = "rejection"
    stop: tuple[str, ...] = ()  # one string or several; kept as a tuple
    mode: str | None = None  # None: the engine's loop
    exact: bool | None = None  # None: the engine's (see Engine.exact_for)
    response_format: dict | Constraint | None = None  # or a constraint Engine.constraint_for compiled already
    tools: list[dict] | None = None
    logprobs: int | None = None
    marked_tokens: Collection[int] = ()
    on_prefill: Callable[[float], None] | None = None
    on_sources: Callable[[list[list[str]]], None] | None = None
    on_logprobs: Callable[[list[TokenLogprob]], None] | None = None

    def __post_init__(self) -> None:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        object.__setattr__(self, "stop", stop)
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise EdgeSpecError("max_new_tokens must be at least 1")
        if self.marked_tokens and (self.on_sources is not None or self.on_logprobs is not None):
            raise EdgeSpecError("marked tokens and per-token sources or log-probabilities cannot go together")

    @classmethod
    def from_kwargs(cls, base: GenerateOptions | None = None, **kwargs) -> GenerateOptions:
        """``base`` (None: the defaults) with the keywords given set; an unknown keyword is a TypeError,
        as it is for any function."""
        unknown = sorted(set(kwargs) - FIELDS)
        if unknown:
            raise TypeError(f"generate() got an unexpected keyword argument {unknown[0]!r}")
        return replace(base, **kwargs) if base is not None else cls(**kwargs)

    def sampling(self, end_ids: Collection[int]) -> SamplingParams:
        """The sampling settings the token loop draws with, ``end_ids`` ending the answer."""
        return SamplingParams(
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            seed=self.seed,
            end_ids=frozenset(end_ids),
            sampler=self.sampler,
        )

    def logprob_recorder(self) -> LogprobRecorder | None:
        """What keeps each token's log-probability entry (None: they were not asked for)."""
        wanted = self.logprobs is not None or self.on_logprobs is not None
        return LogprobRecorder(self.logprobs or 0) if wanted else None

    @property
    def tracked(self) -> bool:
        """Whether the answer's text pieces are labelled by token (per-token sources or log-probabilities)."""
        return self.on_sources is not None or self.on_logprobs is not None


FIELDS = frozenset(f.name for f in fields(GenerateOptions))
