"""An n-gram index of one growing sequence: what followed the latest earlier occurrence of its last tokens.

Built incrementally (each call indexes only the n-grams added since the last), so one index per
request serves every proposer that drafts from the sequence itself (prompt lookup, free guesses).
"""

from __future__ import annotations

LOOKUP_MIN_N = 2  # a lookup draft continues a match of at least this many tokens


class NgramLookup:
    """Index of n-grams (``min_n``..``max_n`` tokens) of one growing sequence -> where each last ended."""

    def __init__(self, min_n: int = LOOKUP_MIN_N, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError("need 1 <= min_n <= max_n")
        self.min_n, self.max_n = min_n, max_n
        self._ends: dict[tuple[int, ...], int] = {}  # n-gram -> index just past its latest occurrence
        self._indexed = 0  # n-grams ending before this index are in _ends

    def continuation(self, tokens: list[int], gamma: int, min_n: int | None = None) -> list[int]:
        """Up to γ tokens that followed the longest (then latest) earlier occurrence of the sequence's
        suffix; [] when no suffix of ``min_n`` tokens or more occurred before (default and floor: the
        index's own ``min_n``, so one index serves callers that need longer matches)."""
        return self.match(tokens, gamma, min_n)[0]

    def match(self, tokens: list[int], gamma: int, min_n: int | None = None) -> tuple[list[int], int]:
        """:meth:`continuation` and the length of the suffix it matched (0: none): a longer match
        is more likely to go on as before."""
        shortest = self.min_n if min_n is None else max(min_n, self.min_n)
        end = len(tokens)
        # index every n-gram that ends before the last token: the suffix itself must not match itself
        for stop in range(max(self._indexed, 1), end):
            for n in range(self.min_n, self.max_n + 1):
                if stop >= n:
                    self._ends[tuple(tokens[stop - n : stop])] = stop
        self._indexed = max(self._indexed, end)
        if gamma <= 0:
            return [], 0
        for n in range(min(self.max_n, end), shortest - 1, -1):
            start = self._ends.get(tuple(tokens[end - n :]))
            if start is not None:
                return list(tokens[start : start + gamma]), n
        return [], 0
