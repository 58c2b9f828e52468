"""Prompt-lookup drafting: propose the continuation of the latest earlier occurrence of the last n tokens.

Code edits, RAG answers, summaries and multi-turn chats copy long spans from the prompt or from earlier
in the answer.  There, the sequence itself is a drafter that costs microseconds instead of a drafter
step (a third of a target step on a laptop CPU), so a round costs only its verify pass.  The drafts
are a deterministic function of the prefix, i.e. drawn from a point mass q = δ: the speculative
verifier accepts a draft x with probability p(x) and otherwise samples norm((p - δ_x)^+), which is
exact like any other q (greedy: accepted iff x is the target's argmax).
"""

from __future__ import annotations

from dataclasses import dataclass

from edge_spec.runtime.policy import CostModel, best_gamma, expected_tokens, fold_acceptance


LOOKUP_MIN_N = 2  # a lookup draft continues a match of at least this many tokens


class NgramLookup:
    """Index of n-grams (``min_n``..``max_n`` tokens) of one growing sequence -> where each last ended."""

    def __init__(self, min_n: int = LOOKUP_MIN_N, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError("need 1 <= min_n <= max_n")
        self.min_n, self.max_n = min_n, max_n
        self._ends: dict[tuple[int, ...], int] = {}  # n-gram -> index just past its latest occurrence
        self._indexed = 0  # n-grams ending before this index are in _ends

    def propose(self, tokens: list[int], gamma: int, min_n: int | None = None) -> list[int]:
        """Up to γ tokens that followed the longest (then latest) earlier occurrence of the sequence's
        suffix; [] when no suffix of ``min_n`` tokens or more occurred before (default and floor: the
        index's own ``min_n``, so one index serves callers that need longer matches)."""
        shortest = self.min_n if min_n is None else max(min_n, self.min_n)
        end = len(tokens)
        # index every n-gram that ends before the last token: the suffix itself must not match itself
        for stop in range(max(self._indexed, 1), end):
            for n in range(self.min_n, self.max_n + 1):
                if stop >= n:
                    self._ends[tuple(tokens[stop - n:stop])] = stop
        self._indexed = max(self._indexed, end)
        if gamma <= 0:
            return []
        for n in range(min(self.max_n, end), shortest - 1, -1):
            start = self._ends.get(tuple(tokens[end - n:]))
            if start is not None:
                return list(tokens[start:start + gamma])
        return []


@dataclass
class LookupChoice:
    """Per request: when the sequence offers a lookup draft, take it or run the drafter?

    Both sources keep a running acceptance (EMA).  A lookup round costs only its verify pass; a
    drafter round costs γ drafter steps plus its verify pass (:class:`~edge_spec.runtime.policy.CostModel`).
    Lookup wins when its expected tokens per second are at least the drafter's.  A proposal that
    loses is still tried every ``probe_every``-th time, so that its acceptance stays current.
    """

    lookup_alpha: float = 0.7
    model_alpha: float = 0.8
    smoothing: float = 0.2
    probe_every: int = 8
    _skipped: int = 0

    def lookup_gamma(self, costs: CostModel | None, gamma_max: int, adaptive: bool) -> int:
        """Lookup drafts to take this round (0: use the drafter)."""
        if costs is None:  # nothing measured yet: trust a lookup that has been doing well
            return gamma_max if self.lookup_alpha >= 0.5 else 0
        lookup_costs = CostModel(0.0, costs.verify)
        gamma = best_gamma(self.lookup_alpha, lookup_costs, gamma_max) if adaptive else gamma_max
        model_gamma = best_gamma(self.model_alpha, costs, gamma_max) if adaptive else gamma_max
        lookup_rate = expected_tokens(self.lookup_alpha, gamma) / lookup_costs.round_cost(gamma)
        model_rate = expected_tokens(self.model_alpha, model_gamma) / costs.round_cost(model_gamma)
        if gamma and lookup_rate >= model_rate:
            return gamma
        self._skipped += 1
        if self._skipped >= self.probe_every:
            self._skipped = 0
            return 1
        return 0

    def update(self, from_lookup: bool, drafted: int, accepted: int) -> None:
        if from_lookup:
            self.lookup_alpha = fold_acceptance(self.lookup_alpha, self.smoothing, drafted, accepted)
        else:
            self.model_alpha = fold_acceptance(self.model_alpha, self.smoothing, drafted, accepted)
