"""Multi-draft verification at one tree node: RRS with and without replacement, and SpecHub.

The drafter proposes k first tokens ``x_1..x_k`` at a node where the target's
(processed) distribution is ``p`` and the drafter's is ``q``.  A verifier emits
exactly one token; it is *exact* when, averaged over how the drafts were
drawn, the emitted token is distributed as ``p``.

Every verifier here is written as a :class:`Ladder`: a fixed sequence of
accept tests ``(token, probability)`` tried in order, then a residual
distribution sampled when all of them fail.  The same ladder drives sampling
(:meth:`Ladder.sample`) and the exact output distribution
(:meth:`Ladder.distribution`), so the exactness tests enumerate every draft
tuple through the very code the runtime uses.

Verifiers and the way each wants its drafts drawn (``VERIFIERS``):

* ``rrs`` - recursive rejection sampling *with replacement* (SpecTr / Chen et
  al.): drafts i.i.d. from q; draft j is accepted with ``min(1, p_j(x)/q(x))``
  and after a rejection ``p_{j+1} = norm((p_j - q)^+)``, q unchanged.  Each
  step is an ordinary speculative-sampling step against the current
  residual, so by induction the output follows p.  A repeated draft is
  always rejected (its residual mass is 0) but still updates the residual.
* ``rrs-wor`` - RRS *without replacement* (Jeon et al. 2024): drafts are an
  ordered sample without replacement (Gumbel top-k); after rejecting x, p
  updates as above and q drops x and renormalises, which is exactly the
  distribution the next draft was drawn from.
* ``spechub`` - SpecHub (Sun et al., EMNLP 2024), k = 2 only: see
  :func:`spechub_ladder`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from edge_spec.runtime.verify.chain import residual_distribution
from edge_spec.runtime.verify.sampling import sample

VERIFIERS = ("rrs", "rrs-wor", "spechub")

# q(hub) this close to 1 leaves no room for a second SpecHub draft (its mass q(a)q(i)/(1 - q(a)) is
# undefined); such a node is verified as a single draft, which is exact on its own.
_HUB_ONLY = 1.0 - 1e-12


@dataclass
class Ladder:
    """Accept tests in order, then a residual: the complete verification of one node."""

    tests: list[tuple[int, float]]  # (token, probability of accepting it when the test is reached)
    residual: np.ndarray  # distribution sampled when every test fails

    def sample(self, rng: np.random.Generator) -> tuple[int, bool]:
        """Run the tests with fresh uniforms; return (token, True) for an accepted draft or
        (residual token, False)."""
        for token, probability in self.tests:
            if rng.random() < probability:
                return token, True
        return sample(self.residual, rng), False

    def distribution(self) -> np.ndarray:
        """The exact distribution of the emitted token for these drafts (tests + residual)."""
        out = np.zeros(len(self.residual), dtype=np.float64)
        reach = 1.0
        for token, probability in self.tests:
            out[token] += reach * probability
            reach *= 1.0 - probability
        return out + reach * self.residual


def _ratio(numerator: float, denominator: float) -> float:
    """min(1, numerator / denominator), 0 when the denominator is 0 (the test can only be reached
    with probability 0 then, see the callers)."""
    return min(1.0, numerator / denominator) if denominator > 0 else 0.0


# -- drawing the first tokens of k drafts --------------------------------------------------------


def draw_first_tokens(q: np.ndarray, k: int, verifier: str, rng: np.random.Generator) -> list[int]:
    """k first tokens from the drafter's distribution ``q`` the way ``verifier`` expects them drawn."""
    if verifier not in VERIFIERS:
        raise ValueError(f"unknown multi-draft verifier {verifier!r}; choose one of {', '.join(VERIFIERS)}")
    if k < 1:
        raise ValueError("need at least one draft")
    q = np.asarray(q, dtype=np.float64)
    if verifier == "rrs":
        return [sample(q, rng) for _ in range(k)]
    if verifier == "rrs-wor":
        return _without_replacement(q, k, rng)
    if k != 2:
        raise ValueError("SpecHub verifies exactly two drafts per node")
    return spechub_pair(q, rng)


def _without_replacement(q: np.ndarray, k: int, rng: np.random.Generator) -> list[int]:
    """An ordered sample without replacement (Gumbel top-k == drawing one by one and renormalising);
    fewer than k tokens when q has fewer non-zero entries."""
    support = np.flatnonzero(q > 0)
    keys = np.log(q[support]) - np.log(-np.log(rng.random(len(support))))
    order = np.argsort(-keys)[:k]
    return [int(t) for t in support[order]]


def spechub_pair(q: np.ndarray, rng: np.random.Generator) -> list[int]:
    """SpecHub's sparse joint draft: the hub a = argmax q is always one of the two drafts.

    x1 ~ q; if x1 != a the second draft is a, else x2 ~ q without a.  The pair (i, a) therefore has
    mass q(i) and the pair (a, i) mass q(a) q(i) / (1 - q(a)); the first draft alone follows q.
    """
    hub = int(np.argmax(q))
    first = sample(q, rng)
    if first != hub:
        return [first, hub]
    if q[hub] >= _HUB_ONLY:
        return [hub]
    rest = q.copy()
    rest[hub] = 0.0
    return [hub, sample(rest / rest.sum(), rng)]


# -- verifiers ---------------------------------------------------------------------------------


def rrs_ladder(drafts: list[int], q: np.ndarray, p: np.ndarray, *, without_replacement: bool) -> Ladder:
    """Recursive rejection sampling over k drafts (module docstring says why it is exact)."""
    p_j = np.asarray(p, dtype=np.float64)
    q_j = np.asarray(q, dtype=np.float64)
    tests = []
    for token in drafts:
        tests.append((token, _ratio(p_j[token], q_j[token])))
        p_j = residual_distribution(p_j, q_j)
        if without_replacement:
            q_j = q_j.copy()
            q_j[token] = 0.0
            mass = q_j.sum()
            if mass <= 0:  # q is exhausted: no draft follows
                break
            q_j /= mass
    return Ladder(tests, p_j)


def spechub_ladder(drafts: list[int], q: np.ndarray, p: np.ndarray) -> Ladder:
    """SpecHub verification of a pair drawn by :func:`spechub_pair` (hub a = argmax q).

    How mass moves (an optimal-transport plan from the sparse joint draft to p):

    1. every non-hub token i is served first by the pairs whose *first* draft is i: (i, a) accepts i
       with min(1, p(i)/q(i)), i.e. min(p(i), q(i)) of mass, as plain speculative sampling would;
    2. what i still needs, p'(i) = (p(i) - q(i))^+, comes from the pair (a, i), whose *second* draft is
       i: it accepts i with min(1, p'(i) / Q_ai(i)), Q_ai(i) = q(a) q(i) / (1 - q(a));
    3. the hub is served by what pairs (a, ·) have left, S_ai = sum_i (Q_ai(i) - p'(i))^+: accept a with
       min(1, p(a) / S_ai);
    4. what the hub still needs, p'(a) = (p(a) - S_ai)^+, comes from what pairs (i, a) have left,
       S_ia = sum_i (q(i) - p(i))^+: accept a with min(1, p'(a) / S_ia);
    5. otherwise sample the remaining need: (p'(i) - Q_ai(i))^+ for i != a and (p'(a) - S_ia)^+.

    Why p is preserved: each step hands a token at most what it still needs, so after step 4 the
    unserved mass of every token is exactly the residual of step 5, and the unassigned draft mass
    equals the total unserved need (both are 1 minus what was served).  Sampling the normalised
    residual with that leftover mass tops every token up to exactly p.  A token gets
    min(p, q/(1 - q(a))) from steps 1-2 against min(p, q) in single-draft speculation, which is
    where SpecHub gains when the drafter's top token carries much mass.
    """
    q = np.asarray(q, dtype=np.float64)
    p = np.asarray(p, dtype=np.float64)
    hub = int(np.argmax(q))
    if len(drafts) == 1:  # q(a) ~ 1: a single draft, verified by plain speculative sampling
        return rrs_ladder(drafts, q, p, without_replacement=False)
    if hub not in drafts or len(drafts) != 2 or drafts[0] == drafts[1]:
        raise ValueError(f"SpecHub drafts must be a pair containing the hub {hub}, got {drafts}")
    q_hub = q[hub]
    pair_mass = q * (q_hub / (1.0 - q_hub))  # Q_ai(i) for i != a
    pair_mass[hub] = 0.0
    need = np.maximum(p - q, 0.0)  # p'(i) after step 1
    need[hub] = 0.0
    left_ai = float(np.maximum(pair_mass - need, 0.0).sum())  # S_ai
    left_ia = max(float(np.maximum(q - p, 0.0).sum()) - max(q_hub - p[hub], 0.0), 0.0)  # S_ia, i != a
    hub_need = max(p[hub] - left_ai, 0.0)  # p'(a)
    residual = np.maximum(need - pair_mass, 0.0)
    residual[hub] = max(hub_need - left_ia, 0.0)
    mass = residual.sum()
    residual = residual / mass if mass > 0 else p  # reached with probability ~0 then
    if drafts[1] == hub:  # pair (i, a)
        i = drafts[0]
        tests = [(i, _ratio(p[i], q[i])), (hub, _ratio(hub_need, left_ia))]
    else:  # pair (a, i)
        i = drafts[1]
        tests = [(i, _ratio(need[i], pair_mass[i])), (hub, _ratio(p[hub], left_ai))]
    return Ladder(tests, residual)


def ladder_for(verifier: str, drafts: list[int], q: np.ndarray, p: np.ndarray) -> Ladder:
    """The verifier that matches the way ``drafts`` were drawn (see :func:`draw_first_tokens`)."""
    if verifier == "rrs":
        return rrs_ladder(drafts, q, p, without_replacement=False)
    if verifier == "rrs-wor":
        return rrs_ladder(drafts, q, p, without_replacement=True)
    if verifier == "spechub":
        return spechub_ladder(drafts, q, p)
    raise ValueError(f"unknown multi-draft verifier {verifier!r}; choose one of {', '.join(VERIFIERS)}")


# -- expected acceptance (planning and measurement without sampling noise) -----------------------


def expected_acceptance(verifier: str, q: np.ndarray, p: np.ndarray) -> float:
    """Probability that a node with two drafts (one for ``single``) emits a draft rather than a residual
    sample, averaged over how the drafts are drawn: exact, in O(V log V).

    With branches of length 1 this is the expected number of accepted tokens per target call, so it
    compares verifiers on real distributions without Monte Carlo noise.  Why the formulas hold:

    * single: sum min(p, q);
    * rrs: the residual after a rejection, p1 = norm((p - q)^+), does not depend on the rejected token,
      so alpha = a1 + (1 - a1) sum min(p1, q);
    * rrs-wor: after rejecting x the second draft follows q(y) / (1 - q(x)) (y != x) and p1(x) = 0, so
      the second test accepts with f(s_x) = sum_y min(p1(y), s_x q(y)), s_x = 1 / (1 - q(x)); f is
      evaluated for every x at once from the ratios p1/q sorted once;
    * spechub: the mass each step of :func:`spechub_ladder` hands out, summed.
    """
    q = np.asarray(q, dtype=np.float64)
    p = np.asarray(p, dtype=np.float64)
    overlap = np.minimum(p, q)
    single = float(overlap.sum())
    if verifier == "single":
        return single
    p1 = residual_distribution(p, q)
    if verifier == "rrs":
        return single + (1.0 - single) * float(np.minimum(p1, q).sum())
    if verifier == "rrs-wor":
        return _expected_rrs_without_replacement(q, p, p1)
    if verifier == "spechub":
        return _expected_spechub(q, p)
    raise ValueError(f"unknown verifier {verifier!r}; choose single or one of {', '.join(VERIFIERS)}")


def _expected_rrs_without_replacement(q: np.ndarray, p: np.ndarray, p1: np.ndarray) -> float:
    support = np.flatnonzero(q > 0)
    ratio = p1[support] / q[support]
    order = np.argsort(ratio)
    ratio_sorted = ratio[order]
    p1_below = np.concatenate([[0.0], np.cumsum(p1[support][order])])  # sum of p1 over ratios <= s
    q_above = np.concatenate([np.cumsum(q[support][order][::-1])[::-1], [0.0]])  # sum of q over ratios > s
    qx = q[support]
    first = np.minimum(1.0, p[support] / qx)
    with np.errstate(divide="ignore"):
        scale = np.where(qx < _HUB_ONLY, 1.0 / (1.0 - qx), 0.0)
    cut = np.searchsorted(ratio_sorted, scale, side="right")
    second = p1_below[cut] + scale * q_above[cut]
    return float((qx * (first + (1.0 - first) * second)).sum())


def _expected_spechub(q: np.ndarray, p: np.ndarray) -> float:
    hub = int(np.argmax(q))
    q_hub = q[hub]
    if q_hub >= _HUB_ONLY:
        return float(np.minimum(p, q).sum())
    pair_mass = q * (q_hub / (1.0 - q_hub))
    pair_mass[hub] = 0.0
    need = np.maximum(p - q, 0.0)
    need[hub] = 0.0
    served = np.minimum(p, q)
    served[hub] = 0.0
    left_ai = float(np.maximum(pair_mass - need, 0.0).sum())
    left_ia = max(float(np.maximum(q - p, 0.0).sum()) - max(q_hub - p[hub], 0.0), 0.0)
    hub_served = min(p[hub], left_ai) + min(max(p[hub] - left_ai, 0.0), left_ia)
    return float(served.sum() + np.minimum(need, pair_mass).sum() + hub_served)
