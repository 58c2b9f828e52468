"""Where did the end of a sequence occur before, and what followed it there: a growing token store
with hashed n-gram chains at a few lengths.

Why not a suffix tree or automaton (SuffixDecoding's structure): in Python their nodes cost a
dictionary each, hundreds of bytes per cached token, and they are built token by token.  Here every
level ``n`` in :data:`LEVELS` is two int32 arrays -- the latest position whose last ``n`` tokens hash
to a bucket, and for every position the previous one in its bucket -- so memory is
``4 * (1 + 2 * len(LEVELS))`` bytes per token plus the bucket heads, every insertion is vectorised, a
rebuild after dropping documents takes milliseconds, and the store is saved as plain arrays.
A query walks the chain of the longest level that has an occurrence, verifies each one token by token
(hash collisions and n-grams across document boundaries never match) and measures how far back the
match really goes.
"""

from __future__ import annotations

import numpy as np

LEVELS = (2, 4, 8, 16)  # n-gram lengths indexed; the longest level with an occurrence is examined
MAX_CANDIDATES = 24  # occurrences examined per query (the latest ones of its level)
MAX_MATCH = 64  # how far back a match is measured
# appends this short (a round's few accepted tokens) are linked one position at a time in plain integers:
# the vectorised path's numpy calls, a dozen a level, cost more than the work itself there (an append of
# 1-4 tokens to a request's index: 72 against 11 µs, Zen 5 EPYC)
SMALL_APPEND = 8
SEPARATOR = -1  # between documents: nothing matches across it, no continuation runs past it
_MULTIPLIER = np.uint64(0x9E3779B97F4A7C15)
_MIX = np.uint64(0xBF58476D1CE4E5B9)


class SuffixIndex:
    """Documents appended to one token store, each ending with :data:`SEPARATOR`; the last may still
    be growing (:meth:`extend`)."""

    def __init__(self, capacity: int = 1024) -> None:
        self.size = 0
        self.tokens = np.empty(max(capacity, 64), np.int32)
        self._allocate(len(self.tokens))

    @property
    def nbytes(self) -> int:
        """Memory held by the arrays (what a cached token costs, measured)."""
        return self.tokens.nbytes + sum(a.nbytes for a in (*self._heads, *self._chains))

    def extend(self, tokens: list[int] | np.ndarray) -> None:
        """Append ``tokens`` and index every n-gram that now ends at one of them."""
        new = np.asarray(tokens, dtype=np.int32)
        if len(new) == 0:
            return
        start, end = self.size, self.size + len(new)
        if end > len(self.tokens):
            self._grow(end)
            self.tokens[start:end] = new
            self.size = end
            self._reindex()
            return
        self.tokens[start:end] = new
        self.size = end
        self._index(start, end)

    def end_document(self) -> None:
        self.extend([SEPARATOR])

    def occurrences(self, context: np.ndarray, exclude_from: int | None = None) -> tuple[int, list[int], list[int]]:
        """Occurrences of the end of ``context`` in the store: ``(level, continuations, match lengths)``,
        where each continuation is the position of the token that followed, at the longest level with
        any occurrence (0 and empty lists: none).  Occurrences whose continuation is at or after
        ``exclude_from`` are skipped (the query's own tail, when the context is the store's last document)."""
        limit = self.size if exclude_from is None else min(exclude_from, self.size)
        buckets = tail_buckets(context, self._bits)
        for level, n in reversed(list(enumerate(LEVELS))):
            if len(context) < n:
                continue
            tail = context[-n:]
            chain, position, walked = self._chains[level], int(self._heads[level][buckets[level]]), []
            while position >= 0 and len(walked) < MAX_CANDIDATES:
                walked.append(position)
                position = int(chain[position])
            follows = np.asarray(walked, np.int64) + 1
            follows = follows[follows < limit]
            if len(follows) == 0:
                continue
            window = self.tokens[follows[:, None] + np.arange(-n, 0)]  # each occurrence's last n tokens
            follows = follows[(window == tail).all(axis=1) & (self.tokens[follows] != SEPARATOR)]
            if len(follows):
                return n, follows.tolist(), self._match_lengths(context, follows, n)
        return 0, [], []

    def _match_lengths(self, context: np.ndarray, follows: np.ndarray, at_least: int) -> list[int]:
        """How many tokens before each of ``follows`` equal the end of ``context`` (up to :data:`MAX_MATCH`)."""
        span = min(MAX_MATCH, len(context), int(follows.min()))
        if span <= at_least:
            return [at_least] * len(follows)
        back = self.tokens[follows[:, None] - np.arange(1, span + 1)]  # the tokens before, nearest first
        same = back == context[::-1][:span]
        lengths = np.where(same.all(axis=1), span, same.argmin(axis=1))
        return np.maximum(lengths, at_least).tolist()

    def _allocate(self, capacity: int) -> None:
        self._bits = max(int(capacity - 1).bit_length(), 6)
        self._heads = [np.full(1 << self._bits, -1, np.int32) for _ in LEVELS]
        self._chains = [np.full(capacity, -1, np.int32) for _ in LEVELS]

    def _grow(self, needed: int) -> None:
        capacity = len(self.tokens)
        while capacity < needed:
            capacity *= 2
        tokens = np.empty(capacity, np.int32)
        tokens[: self.size] = self.tokens[: self.size]
        self.tokens = tokens
        self._allocate(capacity)

    def _reindex(self) -> None:
        for heads, chain in zip(self._heads, self._chains):
            heads.fill(-1)
            chain.fill(-1)
        self._index(0, self.size)

    def _index(self, start: int, end: int) -> None:
        """Link the n-grams ending at positions ``start..end-1`` into every level's chains, in order."""
        if end - start <= SMALL_APPEND:
            self._index_few(start, end)
            return
        for level, n in enumerate(LEVELS):
            first = max(start, n - 1)
            if first >= end:
                continue
            window = self.tokens[first - n + 1 : end]
            positions = np.arange(first, end, dtype=np.int32)
            _link(self._heads[level], self._chains[level], positions, _buckets(_hashes(window, n), self._bits))

    def _index_few(self, start: int, end: int) -> None:
        """:meth:`_index` for a few positions: the same buckets (:func:`tail_buckets` hashes as
        :func:`_hashes` does) and the same links, one position after the other."""
        heads, chains = self._heads, self._chains
        for position in range(start, end):
            ending_here = self.tokens[max(0, position + 1 - LEVELS[-1]) : position + 1]
            for level, bucket in enumerate(tail_buckets(ending_here, self._bits)):
                if bucket < 0:  # fewer tokens than this level's n so far: the vectorised path skips it too
                    break
                chains[level][position] = heads[level][bucket]
                heads[level][bucket] = position

    def compact(self, keep: list[tuple[int, int]]) -> list[int]:
        """Keep only the spans ``[start, end)`` (whole documents, each ending with its separator), in
        order, and index them afresh; returns each span's new start."""
        parts = [self.tokens[a:b] for a, b in keep]
        starts, total = [], 0
        for part in parts:
            starts.append(total)
            total += len(part)
        kept = np.concatenate(parts) if parts else np.empty(0, np.int32)
        capacity = 64
        while capacity < total:
            capacity *= 2
        self.tokens = np.empty(capacity, np.int32)
        self.tokens[:total] = kept
        self.size = total
        self._allocate(capacity)
        self._index(0, total)
        return starts


_MASK = (1 << 64) - 1
_POWERS = [pow(int(_MULTIPLIER), i, 1 << 64) for i in range(max(LEVELS))]


def _hashes(window: np.ndarray, n: int) -> np.ndarray:
    """The hash of every n-gram of ``window`` (``len(window) - n + 1`` of them), in order: the sum of its
    tokens weighted by powers of the multiplier, the newest by the first, so that one pass over a
    query's tail gives every level's hash (:func:`tail_buckets`)."""
    values = window.astype(np.int64).astype(np.uint64) + np.uint64(2)  # the separator hashes too (never matched)
    count = len(window) - n + 1
    hashed = np.zeros(count, np.uint64)
    for i in range(n):  # token i places before each n-gram's last
        hashed += values[n - 1 - i : n - 1 - i + count] * np.uint64(_POWERS[i])
    return hashed


def _buckets(hashed: np.ndarray, bits: int) -> np.ndarray:
    mixed = (hashed ^ (hashed >> np.uint64(31))) * _MIX
    return (mixed >> np.uint64(64 - bits)).astype(np.int64)


def tail_buckets(context: np.ndarray, bits: int) -> list[int]:
    """The bucket of the last ``n`` tokens of ``context`` for every level ``n`` (-1 where it is shorter):
    what :func:`_hashes` and :func:`_buckets` give, in plain integers (a query's few tokens)."""
    tail = context[-max(LEVELS) :].tolist()
    found, hashed, mix, shift = [], 0, int(_MIX), 64 - bits
    for i, token in enumerate(reversed(tail)):
        hashed = (hashed + (token + 2) * _POWERS[i]) & _MASK
        if i + 1 in LEVELS:
            found.append(((((hashed ^ (hashed >> 31)) * mix) & _MASK) >> shift))
    return found + [-1] * (len(LEVELS) - len(found))


def _link(heads: np.ndarray, chain: np.ndarray, positions: np.ndarray, buckets: np.ndarray) -> None:
    """For each position in increasing order: its chain points at the bucket's previous head, and it
    becomes the head -- done for all at once by sorting on (bucket, position)."""
    order = np.lexsort((positions, buckets))
    positions, buckets = positions[order], buckets[order]
    starts = np.ones(len(order), bool)
    starts[1:] = buckets[1:] != buckets[:-1]
    previous = np.empty_like(positions)
    previous[1:] = positions[:-1]
    previous[starts] = heads[buckets[starts]]
    chain[positions] = previous
    ends = np.ones(len(order), bool)
    ends[:-1] = starts[1:]
    heads[buckets[ends]] = positions[ends]
