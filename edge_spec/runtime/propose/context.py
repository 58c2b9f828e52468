"""What proposers of one request share: the target's vocabulary, the loaded drafters, one n-gram index,
the engine's suffix cache."""

from __future__ import annotations

from dataclasses import dataclass, field

from edge_spec.runtime.propose.model import ChainDrafter
from edge_spec.runtime.propose.ngrams import NgramLookup
from edge_spec.runtime.propose.suffix_cache import SuffixCache


@dataclass
class ProposerContext:
    vocab_size: int
    # drafters by proposer name ("model", "eagle"): kept across requests, their caches reused for a shared prefix
    drafters: dict[str, ChainDrafter] = field(default_factory=dict)
    ngrams: NgramLookup = field(default_factory=lambda: NgramLookup(min_n=1))  # lookup (2+ tokens) and guesses
    suffix_cache: SuffixCache | None = None  # earlier answers, kept by the engine (None: this request only)
