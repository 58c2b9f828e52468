"""Suffix drafts: the continuation of the longest earlier occurrence of the sequence's end, in this
request or in what the engine produced before (:mod:`suffix_cache`), chosen by how often it followed.

Like prompt lookup it costs microseconds instead of a drafter step, so a round that takes its drafts
costs only its verify pass; unlike it, it sees earlier requests' answers (and a corpus the user points
at), measures matches up to 64 tokens instead of 4 (code repeats short n-grams everywhere: the longest
match is where the copy really comes from), and where the earlier occurrences disagree it follows the
continuation most of them took, as SuffixDecoding does: each draft carries the share of occurrences
still agreeing (its ``confidence``), and drafting stops once that share falls below
:data:`MIN_SHARE`.  Where this request's text is copied better by the latest occurrence of its last few
tokens (prompt lookup's rule), its rounds draft that instead (:mod:`copy_rules`).  How many of the drafts
a round takes is the schedule's call (``schedule.sources``).

The drafts are a deterministic function of the prefix and the cache, i.e. drawn from a point mass q:
verified as lookup's are, greedy output stays the target's and sampling stays exact.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from edge_spec.runtime.propose.base import DraftBlock, DraftRule, SequenceProposer, point_mass_block
from edge_spec.runtime.propose.copy_rules import CopyRuleRecord
from edge_spec.runtime.propose.ngrams import LOOKUP_MIN_N
from edge_spec.runtime.propose.suffix_cache import SuffixCache
from edge_spec.runtime.propose.suffix_index import MAX_MATCH, SEPARATOR, SuffixIndex

MIN_SHARE = 0.3  # a continuation fewer of the occurrences agree on is not drafted
MIN_MATCH = 2  # as prompt lookup: a one-token match says little
# in earlier answers, shorter matches are mostly chance (measured: taking them lost rounds on unrelated prompts)
CACHE_MIN_MATCH = 4


class SuffixDrafts(SequenceProposer):
    """The ``suffix`` proposer: this request's prompt and answer, and the engine's suffix cache."""

    name = "suffix"
    kind = "sequence"
    own_first = True  # its first draft is not the free guess's token: the schedule judges it on its own

    def __init__(self, context) -> None:
        super().__init__(context)
        self.cache: SuffixCache | None = context.suffix_cache
        self.active = SuffixIndex()
        self.rules = CopyRuleRecord()

    def begin(self, prompt_ids: list[int], outputs: dict[str, np.ndarray]) -> None:
        self.active = SuffixIndex(len(prompt_ids) + 1024)
        self.active.extend(prompt_ids)
        self.rules = CopyRuleRecord()

    def propose(self, committed: list[int], room: int, rule: DraftRule) -> DraftBlock:
        if len(committed) > self.active.size:  # the request's own tokens since the last round
            self.active.extend(committed[self.active.size :])
        gamma = min(rule.gamma, room)
        found = continuation(np.asarray(committed[-MAX_MATCH:], np.int32), self._indexes(), gamma)
        latest, latest_matched = self.context.ngrams.match(committed, gamma, min_n=LOOKUP_MIN_N)
        self.rules.settle(committed)
        self.rules.offer(len(committed), found.tokens, latest)
        if latest and (self.rules.prefers_latest() or not found.tokens):  # see ``copy_rules``
            block = point_mass_block(self.name, latest, rule.params)
            block.matched = latest_matched
            return block
        block = point_mass_block(self.name, found.tokens, rule.params)
        block.confidences = found.shares[: len(block.tokens)]
        block.matched, block.cached = found.matched, found.cached
        if self.cache is not None and found.positions:
            self.cache.used(found.positions)
        return block

    def _indexes(self) -> list[SuffixIndex]:
        return [self.active] if self.cache is None else [self.active, self.cache.index]


class Continuation(NamedTuple):
    """What :func:`continuation` drafts."""

    tokens: list[int]
    shares: list[float]  # per draft: the running product of the share of occurrences agreeing
    matched: int  # the longest match among the occurrences behind the first draft
    positions: list[int]  # where the drafts were read in the last index (the cache), for its recency
    cached: bool  # only the last index (earlier requests' text), none of the first, has the first draft


NOTHING = Continuation([], [], 0, [], False)


def continuation(context: np.ndarray, indexes: list[SuffixIndex], gamma: int) -> Continuation:
    """Up to ``gamma`` drafts after ``context``.

    The occurrences are those of the longest indexed length any index has (so a 20-token match in the
    cache outranks a 3-token one in the prompt, and both count when they reach the same length; the
    indexes after the first, the cache, count from :data:`CACHE_MIN_MATCH` tokens on); each
    step follows the token most of the occurrences still alive continue with (ties: the longest match,
    then the first index, the current request's)."""
    if gamma <= 0 or len(context) < MIN_MATCH:
        return NOTHING
    found = [index.occurrences(context) for index in indexes]
    found = [f if i == 0 or f[0] >= CACHE_MIN_MATCH else (0, [], []) for i, f in enumerate(found)]
    level = max(level for level, _, _ in found)
    if level < MIN_MATCH:
        return NOTHING
    chosen = [i for i, (lvl, _, _) in enumerate(found) if lvl == level]
    which = np.concatenate([np.full(len(found[i][1]), i) for i in chosen])
    lengths = np.concatenate([np.asarray(found[i][2], np.int64) for i in chosen])
    ahead = np.vstack([_ahead(indexes[i], found[i][1], gamma) for i in chosen])  # [occurrences, gamma]
    tokens: list[int] = []
    shares: list[float] = []
    share, alive, step = 1.0, np.arange(len(which)), 0
    first_supporters = alive
    while step < gamma:
        rows = ahead[alive, step:]
        unanimous = (rows == rows[0]).all(axis=0)  # steps every occurrence still alive agrees on
        run = len(unanimous) if unanimous.all() else int(unanimous.argmin())
        for token in rows[0, :run].tolist():
            if token == SEPARATOR:
                return _drafts(tokens, shares, lengths, which, first_supporters, found, len(indexes))
            tokens.append(token)
            shares.append(share)
        step += run
        if step >= gamma:
            break
        column = ahead[alive, step]
        valid = column != SEPARATOR
        if not valid.any():
            break
        values, counts = np.unique(column[valid], return_counts=True)
        best = _best(values[counts == counts.max()], column, lengths[alive], which[alive])
        agree = column == best
        share *= int(agree.sum()) / len(alive)
        if share < MIN_SHARE:
            break
        alive = alive[agree]
        if not tokens:
            first_supporters = alive
        tokens.append(best)
        shares.append(share)
        step += 1
    return _drafts(tokens, shares, lengths, which, first_supporters, found, len(indexes))


def _ahead(index: SuffixIndex, follows: list[int], gamma: int) -> np.ndarray:
    """The ``gamma`` tokens from each position of ``follows`` on, :data:`SEPARATOR` from a document's end on."""
    at = np.asarray(follows, np.int64)[:, None] + np.arange(gamma)
    tokens = np.where(at < index.size, index.tokens[np.minimum(at, index.size - 1)], SEPARATOR)
    tokens[np.cumsum(tokens == SEPARATOR, axis=1) > 0] = SEPARATOR
    return tokens


def _drafts(
    tokens: list[int],
    shares: list[float],
    lengths: np.ndarray,
    which: np.ndarray,
    supporters: np.ndarray,
    found: list[tuple[int, list[int], list[int]]],
    count: int,
) -> Continuation:
    """The result of :func:`continuation`: the first draft's longest match, and where its occurrences in
    the cache (the last of ``count`` indexes) are."""
    if not tokens:
        return NOTHING
    last = count - 1
    in_cache = np.flatnonzero(which == last) if last > 0 else np.empty(0, np.int64)
    rows = supporters[which[supporters] == last] if len(in_cache) else []
    positions = [found[last][1][int(row) - int(in_cache[0])] for row in rows]
    cached = last > 0 and len(rows) == len(supporters)
    return Continuation(tokens, shares, int(lengths[supporters].max()), positions, cached)


def _best(tied: np.ndarray, column: np.ndarray, lengths: np.ndarray, which: np.ndarray) -> int:
    """Among tokens equally many occurrences continue with: the one behind the longest match, then the
    one the earliest index (the current request) has."""
    if len(tied) == 1:
        return int(tied[0])
    return int(max(tied, key=lambda t: (lengths[column == t].max(), -which[column == t].min())))
