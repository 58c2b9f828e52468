"""What proposers of one request share: the target's vocabulary, the drafter model, one n-gram index."""

from __future__ import annotations

from dataclasses import dataclass, field

from edge_spec.runtime.propose.model import ModelDrafter
from edge_spec.runtime.propose.ngrams import NgramLookup


@dataclass
class ProposerContext:
    vocab_size: int
    drafter: ModelDrafter | None = None  # kept across requests (its cache is reused for a shared prefix)
    ngrams: NgramLookup = field(default_factory=lambda: NgramLookup(min_n=1))  # lookup (2+ tokens) and guesses
