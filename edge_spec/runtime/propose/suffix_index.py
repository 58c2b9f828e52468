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
        for n in reversed(LEVELS):
            if len(context) < n:
                continue
            tail = context[-n:]
            bucket = int(_buckets(_hashes(tail, n)[-1:], self._bits)[0])
            position = int(self._heads[LEVELS.index(n)][bucket])
            chain = self._chains[LEVELS.index(n)]
            found, lengths, seen = [], [], 0
            while position >= 0 and seen < MAX_CANDIDATES:
                seen += 1
                follow = position + 1
                if (
                    follow < limit
                    and self.tokens[follow] != SEPARATOR
                    and np.array_equal(self.tokens[follow - n : follow], tail)
                ):
                    found.append(follow)
                    lengths.append(self._match_length(context, follow, n))
                position = int(chain[position])
            if found:
                return n, found, lengths
        return 0, [], []

    def _match_length(self, context: np.ndarray, follow: int, at_least: int) -> int:
        """How many tokens before ``follow`` equal the end of ``context`` (up to :data:`MAX_MATCH`)."""
        span = min(MAX_MATCH, follow, len(context))
        if span <= at_least:
            return at_least
        differ = np.flatnonzero(self.tokens[follow - span : follow][::-1] != context[-span:][::-1])
        return int(differ[0]) if len(differ) else span

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
        for level, n in enumerate(LEVELS):
            first = max(start, n - 1)
            if first >= end:
                continue
            window = self.tokens[first - n + 1 : end]
            positions = np.arange(first, end, dtype=np.int32)
            _link(self._heads[level], self._chains[level], positions, _buckets(_hashes(window, n), self._bits))

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


def _hashes(window: np.ndarray, n: int) -> np.ndarray:
    """The hash of every n-gram of ``window`` (``len(window) - n + 1`` of them), in order."""
    values = window.astype(np.int64).astype(np.uint64) + np.uint64(2)  # the separator hashes too (never matched)
    count = len(window) - n + 1
    hashed = np.zeros(count, np.uint64)
    for i in range(n):
        hashed = hashed * _MULTIPLIER + values[i : i + count]
    return hashed


def _buckets(hashed: np.ndarray, bits: int) -> np.ndarray:
    mixed = (hashed ^ (hashed >> np.uint64(31))) * _MIX
    return (mixed >> np.uint64(64 - bits)).astype(np.int64)


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
