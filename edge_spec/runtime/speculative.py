"""The speculative decoding loop: draft γ tokens, verify them in one target pass, roll back, repeat.

Read it top to bottom like llama.cpp's ``common/speculative.cpp``:

* ``committed`` is every token of the sequence so far; its last token ``x`` is
  *pending*: emitted, but not yet in either KV cache.
* Draft: the drafter catches up on whatever part of ``committed`` it has not
  seen (``x``, plus the last draft after a fully accepted round), then proposes
  up to γ tokens, stopping early when its own confidence says another token is
  unlikely to be accepted.
* Verify: one target pass over ``[x, d1..dγ]`` gives γ+1 rows of logits; the
  verifier (greedy or rejection sampling, :mod:`verification`) returns the
  accepted drafts plus one correction/bonus token.
* Roll back: both caches are cut to the accepted prefix (O(1), see
  :mod:`decoder`).

Exactness does not depend on the drafter: greedy output equals target-only
greedy output, and sampled output follows the target's distribution, because
the verifier sees the same processed target distribution ``p`` the
autoregressive loop samples from, and the exact ``q`` each draft was drawn from
(zero outside a trimmed head).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np

from edge_spec.runtime.decoder import Decoder
from edge_spec.runtime.draft_head import DraftHead, SpecVocabHead
from edge_spec.runtime.lookup import LOOKUP_MIN_N, LookupChoice, NgramLookup
from edge_spec.runtime.policy import AdaptiveGamma, CostModel, DraftRound
from edge_spec.runtime.sampling import SamplingParams, logits_to_probs, sample, scatter_probs
from edge_spec.runtime.verification import VerifyResult, verify_greedy, verify_speculative


@dataclass(frozen=True)
class SpecConfig:
    gamma: int = 3  # drafts per round (the maximum when adaptive)
    min_confidence: float = 0.0  # stop drafting once the drafter's top probability falls below this
    adaptive: bool = False  # choose γ per round from measured costs and running acceptance (policy.py)
    drafts: int = 1  # > 1: multi-draft (tree) verification, γ is then each branch's length (multidraft_loop.py)
    scheme: str = "spechub"  # multi-draft sampling scheme and verifier: rrs, rrs-wor or spechub
    fan_out: int = 3  # SSD: correction/bonus tokens predicted per possible stop point (Saguaro's F)
    speculations: int = -1  # SSD: outcomes prepared per round; -1 = as many as fit while the target verifies
    lookup: bool = False  # also draft by prompt lookup (n-gram match in the sequence) when that pays (lookup.py)


@dataclass
class Drafter:
    """Drafter body (emits final hidden states) + one LM head (full, VocabTrim or SpecVocab)."""

    decoder: Decoder
    head: DraftHead | SpecVocabHead
    step_estimate: float | None = None  # moving average of one draft step (body + head + sampling), seconds

    def step(self, feed: list[int]) -> tuple[np.ndarray, np.ndarray | None]:
        """Feed tokens; return the head's logits for the next position and the target ids of its rows
        (None: the full vocabulary in order)."""
        hidden = self.decoder.forward(feed, 1)["hidden_states"]
        return self.head(hidden[-1])


@dataclass
class SpecStats:
    """Per-request accounting: accepted lengths per round and where the time went."""

    accepted: list[int] = field(default_factory=list)  # drafts accepted per verify call
    drafted: list[int] = field(default_factory=list)  # drafter steps per verify call (= drafts for a chain)
    first_accepted: int = 0  # verify calls that accepted at least their first draft position
    speculation_hits: int = 0  # SSD: rounds whose drafts were ready in the speculation cache
    speculation_misses: int = 0  # SSD: rounds drafted on the spot
    speculations_prepared: int = 0  # SSD: outcomes drafted ahead while the target verified
    prepare_seconds: float = 0.0  # SSD: drafting done off the critical path
    lookup_rounds: int = 0  # rounds drafted by prompt lookup instead of the drafter
    lookup_drafted: int = 0  # their drafts: no drafter step was spent on them
    lookup_accepted: int = 0
    guess_rounds: int = 0  # draft-less rounds whose padding row carried a free guess (exact mode)
    guess_accepted: int = 0
    draft_seconds: float = 0.0
    head_seconds: float = 0.0  # part of draft_seconds spent in the drafter's LM head
    verify_seconds: float = 0.0
    candidate_hits: int = 0  # verified positions whose target token was among the head's rows
    candidate_checks: int = 0

    @property
    def target_calls(self) -> int:
        return len(self.accepted)

    @property
    def tau(self) -> float:
        """Block efficiency: mean tokens emitted per target call (accepted + 1)."""
        return (sum(self.accepted) + len(self.accepted)) / len(self.accepted) if self.accepted else 0.0

    @property
    def mean_gamma(self) -> float:
        return sum(self.drafted) / len(self.drafted) if self.drafted else 0.0

    @property
    def acceptance_rate(self) -> float:
        return sum(self.accepted) / sum(self.drafted) if sum(self.drafted) else 0.0

    @property
    def first_token_acceptance(self) -> float:
        """Share of verify calls with drafts whose first position was accepted (what multi-draft raises)."""
        rounds = sum(1 for d in self.drafted if d)
        return self.first_accepted / rounds if rounds else 0.0

    @property
    def candidate_recall(self) -> float:
        """Share of verified draft positions where the target's token was a row of the drafter's head
        (1 for a full head; the static coverage for VocabTrim; per-step recall for SpecVocab)."""
        return self.candidate_hits / self.candidate_checks if self.candidate_checks else 0.0

    def summary(self, param_ratio: float, bytes_ratio: float | None = None) -> dict:
        gamma = self.mean_gamma
        return {
            "bytes_ratio": bytes_ratio,
            "mbsu_bytes": self.tau / (bytes_ratio * gamma + 1) if self.accepted and bytes_ratio else None,
            "tau": self.tau,
            "target_calls": self.target_calls,
            "mean_gamma": gamma,
            "acceptance_rate": self.acceptance_rate,
            "first_token_acceptance": self.first_token_acceptance,
            "cache_hit_rate": (self.speculation_hits / (self.speculation_hits + self.speculation_misses)
                               if self.speculation_hits + self.speculation_misses else 0.0),
            "speculations_prepared": self.speculations_prepared,
            "prepare_seconds": self.prepare_seconds,
            "lookup_rounds": self.lookup_rounds,
            "lookup_accepted": self.lookup_accepted,
            "guess_rounds": self.guess_rounds,
            "guess_accepted": self.guess_accepted,
            "mbsu": self.tau / (param_ratio * gamma + 1) if self.accepted else 0.0,
            "param_ratio": param_ratio,
            "draft_seconds": self.draft_seconds,
            "verify_seconds": self.verify_seconds,
            "head_seconds": self.head_seconds,
            "draft_steps": sum(self.drafted) - self.lookup_drafted - self.guess_rounds,
            "candidate_recall": self.candidate_recall,
            "accepted_lengths": list(self.accepted),
        }


def draft_chain(drafter: Drafter, feed: list[int], params: SamplingParams, rng: np.random.Generator,
                gamma: int, min_confidence: float, vocab_size: int,
                round_rule: DraftRound | None = None, *, alternatives: int = 0,
                should_stop: Callable[[], bool] | None = None) -> "DraftBlock":
    """Propose up to γ target-vocabulary tokens, stopping early when the drafter is unsure:
    below ``min_confidence``, or (adaptive) when ``round_rule`` says another draft does not pay.

    ``alternatives`` > 0 also records the drafter's top tokens at each step (what speculative
    speculative decoding predicts corrections from); ``should_stop`` is asked before every step and
    ends the block early, marked incomplete."""
    block = DraftBlock()
    for _ in range(gamma):
        if should_stop is not None and should_stop():
            block.complete = False
            break
        started = time.perf_counter()
        logits, ids = drafter.step(feed)
        if params.greedy and not alternatives:
            index = int(np.argmax(logits))
            confidence = _top_probability(logits) if (min_confidence > 0 or round_rule) else 1.0
        else:  # sampling, or alternatives that need the whole distribution: the confidence comes with it
            probs = drafter_probs(logits, params)
            index = int(np.argmax(logits)) if params.greedy else sample(probs, rng)
            confidence = float(probs[index])
        keep, more = True, confidence >= min_confidence
        if round_rule is not None:
            keep, more = round_rule.add(round_rule.acceptance(confidence), may_drop=params.greedy)
        if len(feed) == 1:
            block.step_seconds.append(time.perf_counter() - started)
        if not keep:  # not worth a verify row: the drafter's cache entry is rolled back after verify
            break
        block.tokens.append(int(index) if ids is None else int(ids[index]))
        block.candidates.append(ids)
        block.confidences.append(confidence)
        if not params.greedy:
            block.q_rows.append(probs if ids is None else scatter_probs(probs, ids, vocab_size, validate=False))
        if alternatives:
            block.alternatives.append(top_tokens(probs, ids, alternatives))
        feed = [block.tokens[-1]]
        if not more:
            break
    return block


@dataclass
class DraftBlock:
    """One round's drafts: target ids, (when sampling) their full-vocabulary q rows, the head rows
    each was chosen among (None: full vocabulary), the drafter's confidence in each, and the latency
    of each single-token step (catch-up steps that feed several tokens are left out)."""

    tokens: list[int] = field(default_factory=list)
    q_rows: list[np.ndarray] = field(default_factory=list)
    candidates: list[np.ndarray | None] = field(default_factory=list)
    confidences: list[float] = field(default_factory=list)  # drafter probability of each proposed token
    step_seconds: list[float] = field(default_factory=list)
    alternatives: list[list[tuple[int, float]]] = field(default_factory=list)  # top (id, prob) per step, if asked
    complete: bool = True  # False when should_stop cut the block short

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` drafts (a prefix of a chain is a valid chain)."""
        for rows in (self.tokens, self.q_rows, self.candidates, self.confidences, self.alternatives):
            del rows[length:]


def top_tokens(probs: np.ndarray, ids: np.ndarray | None, n: int) -> list[tuple[int, float]]:
    """The ``n`` most likely (target id, probability) pairs of a head's distribution, best first."""
    n = min(n, len(probs))
    top = np.argpartition(-probs, n - 1)[:n]
    top = top[np.argsort(-probs[top], kind="stable")]
    return [(int(t) if ids is None else int(ids[t]), float(probs[t])) for t in top]


def softmax(logits: np.ndarray) -> np.ndarray:
    """Plain float64 softmax of a head's logits (the drafter's own confidence, before any sampling settings)."""
    shifted = np.exp(logits - logits.max(), dtype=np.float64)
    return shifted / shifted.sum()


def drafter_probs(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The drafter's distribution over its head's rows: what it samples from, or (greedy) its softmax."""
    return softmax(logits) if params.greedy else logits_to_probs(logits, params)


def draft_room(target: Decoder, committed: list[int], emitted: int, max_new_tokens: int) -> int:
    """Most drafts a round may verify: one more token is always emitted, and the context must hold them."""
    return max(min(max_new_tokens - emitted - 1, target.capacity - len(committed) - 1), 0)


def verify_drafts(drafts: list[int], q_rows: list[np.ndarray], rows: np.ndarray, params: SamplingParams,
                  rng: np.random.Generator) -> VerifyResult:
    """Verify one chain of drafts against the target's rows for it (γ + 1 of them): greedy match, or
    rejection sampling against the q rows the drafts were drawn from."""
    if params.greedy:
        return verify_greedy(drafts, rows)
    q = np.array(q_rows) if q_rows else np.zeros((0, rows.shape[-1]))
    return verify_speculative(drafts, q, logits_to_probs(rows, params), rng)


def _top_probability(logits: np.ndarray) -> float:
    shifted = logits - logits.max()
    return float(1.0 / np.exp(shifted, dtype=np.float64).sum())


def prefill_both(target: Decoder, drafter: Drafter, prompt_ids: list[int], params: SamplingParams,
                 rng: np.random.Generator) -> list[int]:
    """Read the prompt into both caches; return the committed sequence: prompt + the first new token.

    The first token comes from the target's prefill, exactly as in autoregressive decoding.  The
    drafter reads the prompt now too, so that its prefill counts as prompt processing."""
    first = target.prefill(prompt_ids)["logits"][-1]
    drafter.decoder.prefill(prompt_ids)
    x = int(np.argmax(first)) if params.greedy else sample(logits_to_probs(first, params), rng)
    return list(prompt_ids) + [x]


def _lookup_block(lookup: NgramLookup, choice: LookupChoice, committed: list[int], drafter: Drafter,
                  target: Decoder, config: SpecConfig, params: SamplingParams, room: int) -> "DraftBlock | None":
    """This round's drafts from a lookup match when there is one and it pays (None: use the drafter).
    Lookup drafts are a function of the prefix, so their q is a point mass (see lookup.py)."""
    proposal = lookup.propose(committed, min(config.gamma, room), min_n=LOOKUP_MIN_N)
    if not proposal:
        return None
    costs = (CostModel(drafter.step_estimate, target.recent_seconds())
             if drafter.step_estimate is not None and target.recent_seconds() else None)
    take = choice.lookup_gamma(costs, config.gamma, config.adaptive)
    return point_mass_block(proposal[:take], params, target.vocab_size) if take else None


def point_mass_block(tokens: list[int], params: SamplingParams, vocab_size: int) -> "DraftBlock":
    """Drafts that are a function of the prefix alone (lookup, guesses): q is a point mass on each."""
    block = DraftBlock(tokens=list(tokens), candidates=[None] * len(tokens), confidences=[1.0] * len(tokens))
    if not params.greedy:
        for token in tokens:
            row = np.zeros(vocab_size)
            row[token] = 1.0
            block.q_rows.append(row)
    return block


def free_guess(guesser: NgramLookup, committed: list[int], params: SamplingParams, vocab_size: int) -> "DraftBlock":
    """A round without drafts still runs a two-row pass when the target is batch-invariant
    (``Decoder.min_rows``): put a free guess in that row instead of a throw-away copy -- what followed
    the latest earlier occurrence of the last tokens, else the last token again -- verified like a
    lookup draft, so it costs nothing and is kept whenever the target agrees."""
    return point_mass_block((guesser.propose(committed, 1) or committed[-1:])[:1], params, vocab_size)


def generate_speculative(
    target: Decoder,
    drafter: Drafter,
    prompt_ids: list[int],
    params: SamplingParams,
    rng: np.random.Generator,
    max_new_tokens: int,
    config: SpecConfig = SpecConfig(),
    stats: SpecStats | None = None,
) -> Iterator[int]:
    """Yield up to ``max_new_tokens`` ids, distributed exactly as target-only decoding would produce them."""
    stats = stats if stats is not None else SpecStats()
    draft = drafter.decoder
    policy = AdaptiveGamma(config.gamma) if config.adaptive else None
    ngrams = NgramLookup(min_n=1)  # one index of the sequence: lookup drafts (2+ token matches), free guesses
    lookup, choice = (ngrams if config.lookup else None), LookupChoice()
    committed = prefill_both(target, drafter, prompt_ids, params, rng)
    emitted = 1
    yield committed[-1]
    while emitted < max_new_tokens:
        # 1. draft: from the sequence itself when a lookup match pays more than the drafter (lookup.py),
        #    else catch the drafter up on committed tokens it has not seen and let it propose.
        started = time.perf_counter()
        base = len(committed) - 1  # cache length both models share before this round
        room = draft_room(target, committed, emitted, max_new_tokens)
        block = _lookup_block(lookup, choice, committed, drafter, target, config, params, room) if lookup else None
        from_lookup = block is not None
        head_before = drafter.head.seconds
        if block is None:
            feed = draft.sync(committed)  # usually [x], or [d_γ, x] after a fully accepted round
            gamma, round_rule = config.gamma, None
            if policy is not None and drafter.step_estimate is not None:
                round_rule = policy.begin_round(CostModel(drafter.step_estimate, target.recent_seconds()))
                gamma = 0 if round_rule is None else round_rule.gamma_max
            block = draft_chain(drafter, feed, params, rng, min(gamma, room), config.min_confidence,
                                target.vocab_size, round_rule)
        guessed = not block.tokens and room > 0 and target.min_rows > 1
        if guessed:  # (a drafter step whose draft was dropped still counts for the step estimate)
            block = dataclasses.replace(free_guess(ngrams, committed, params, target.vocab_size),
                                        step_seconds=block.step_seconds)
        drafts = block.tokens
        verify_started = time.perf_counter()
        stats.draft_seconds += verify_started - started
        stats.head_seconds += drafter.head.seconds - head_before
        for step in block.step_seconds:
            previous = drafter.step_estimate
            drafter.step_estimate = step if previous is None else 0.8 * previous + 0.2 * step

        # 2. verify: one target pass over [x, d1..dγ] -> γ+1 rows.
        rows = target.forward([committed[-1]] + drafts, len(drafts) + 1)["logits"]
        result = verify_drafts(drafts, block.q_rows, rows, params, rng)
        stats.verify_seconds += time.perf_counter() - verify_started
        stats.accepted.append(result.accepted)
        stats.drafted.append(len(drafts))
        stats.first_accepted += result.accepted > 0
        if from_lookup:
            stats.lookup_rounds += 1
            stats.lookup_drafted += len(drafts)
            stats.lookup_accepted += result.accepted
        elif guessed:  # a drafter-less round for the policy; its own tally
            stats.guess_rounds += 1
            stats.guess_accepted += result.accepted
        else:
            for token, ids in zip(result.tokens, block.candidates):
                stats.candidate_checks += 1
                stats.candidate_hits += bool(ids is None or token in ids)
            if policy is not None:
                policy.update(len(drafts), result.accepted, block.confidences)
        if not guessed:
            choice.update(from_lookup, len(drafts), result.accepted)

        # 3. roll back both caches to the accepted prefix; the correction/bonus token becomes pending.
        target.rewind(base + 1 + result.accepted)
        draft.rewind(min(draft.length, base + 1 + result.accepted))
        committed.extend(result.tokens)
        for token in result.tokens:
            yield token
            emitted += 1
            if emitted >= max_new_tokens:
                return
