"""Suffix drafts: the continuation of the longest earlier occurrence of the sequence's end, in this
request or in what the engine produced before (:mod:`suffix_cache`), chosen by how often it followed.

Like prompt lookup it costs microseconds instead of a drafter step, so a round that takes its drafts
costs only its verify pass; unlike it, it sees earlier requests' answers (and a corpus the user points
at), measures matches up to 64 tokens instead of 4 (code repeats short n-grams everywhere: the longest
match is where the copy really comes from), and where the earlier occurrences disagree it follows the
continuation most of them took, as SuffixDecoding does: each draft carries the share of occurrences
still agreeing (its ``confidence``), and drafting stops once that share falls below
:data:`MIN_SHARE`.  How many of the drafts a round takes is the schedule's call (``schedule.sources``).

The drafts are a deterministic function of the prefix and the cache, i.e. drawn from a point mass q:
verified as lookup's are, greedy output stays the target's and sampling stays exact.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from edge_spec.runtime.propose.base import DraftBlock, DraftRule, SequenceProposer, point_mass_block
from edge_spec.runtime.propose.suffix_cache import SuffixCache
from edge_spec.runtime.propose.suffix_index import MAX_MATCH, SEPARATOR, SuffixIndex

MIN_SHARE = 0.3  # a continuation fewer of the occurrences agree on is not drafted
MIN_MATCH = 2  # as prompt lookup: a one-token match says little


class SuffixDrafts(SequenceProposer):
    """The ``suffix`` proposer: this request's prompt and answer, and the engine's suffix cache."""

    name = "suffix"
    kind = "sequence"
    own_first = True  # its first draft is not the free guess's token: the schedule judges it on its own

    def __init__(self, context) -> None:
        super().__init__(context)
        self.cache: SuffixCache | None = context.suffix_cache
        self.active = SuffixIndex()

    def begin(self, prompt_ids: list[int], outputs: dict[str, np.ndarray]) -> None:
        self.active = SuffixIndex(len(prompt_ids) + 1024)
        self.active.extend(prompt_ids)

    def propose(self, committed: list[int], room: int, rule: DraftRule) -> DraftBlock:
        if len(committed) > self.active.size:  # the request's own tokens since the last round
            self.active.extend(committed[self.active.size :])
        drafts, shares, matched, sources = continuation(
            np.asarray(committed[-MAX_MATCH:], np.int32), self._indexes(), min(rule.gamma, room)
        )
        block = point_mass_block(self.name, drafts, rule.params, self.context.vocab_size)
        block.confidences = shares[: len(block.tokens)]
        block.matched = matched
        if self.cache is not None and sources:
            self.cache.used(sources)
        return block

    def _indexes(self) -> list[SuffixIndex]:
        return [self.active] if self.cache is None else [self.active, self.cache.index]


def continuation(
    context: np.ndarray, indexes: list[SuffixIndex], gamma: int
) -> tuple[list[int], list[float], int, list[int]]:
    """Up to ``gamma`` drafts after ``context``: ``(tokens, shares, matched, positions)``.

    The occurrences are those of the longest indexed length any index has (so a 20-token match in the
    cache outranks a 3-token one in the prompt, and both count when they reach the same length); each
    step follows the token most of the occurrences still alive continue with (ties: the longest match,
    then the first index, the current request's); ``shares`` is the running product of the agreeing
    share, ``matched`` the longest match among the occurrences behind the first draft, ``positions``
    where the drafts were read in the last index (the cache), for its recency."""
    if gamma <= 0 or len(context) < MIN_MATCH:
        return [], [], 0, []
    found = [index.occurrences(context) for index in indexes]
    level = max(level for level, _, _ in found)
    if level < MIN_MATCH:
        return [], [], 0, []
    alive = [
        (i, position, length)
        for i, (lvl, positions, lengths) in enumerate(found)
        if lvl == level
        for position, length in zip(positions, lengths)
    ]
    tokens: list[int] = []
    shares: list[float] = []
    share, matched, positions = 1.0, 0, []
    for _ in range(gamma):
        nexts = [_token(indexes[i], p) for i, p, _ in alive]
        votes = Counter(t for t in nexts if t != SEPARATOR)
        if not votes:
            break
        best = max(
            votes,
            key=lambda t: (
                votes[t],
                max(m for (i, _, m), n in zip(alive, nexts) if n == t),
                -min(i for (i, _, _), n in zip(alive, nexts) if n == t),
            ),
        )
        share *= votes[best] / len(alive)
        if share < MIN_SHARE:
            break
        supporters = [(i, p, m) for (i, p, m), n in zip(alive, nexts) if n == best]
        if not tokens:
            matched = max(m for _, _, m in supporters)
            positions = [p for i, p, _ in supporters if i == len(indexes) - 1 and i > 0]
        tokens.append(int(best))
        shares.append(share)
        alive = [(i, p + 1, m) for i, p, m in supporters]
    return tokens, shares, matched, positions


def _token(index: SuffixIndex, position: int) -> int:
    return int(index.tokens[position]) if position < index.size else SEPARATOR
