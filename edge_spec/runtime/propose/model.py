"""A drafter model: a small decoder body (final hidden states) plus one LM head (full, VocabTrim or SpecVocab).

It keeps its own KV cache, so before each proposal it catches up on the committed tokens it has
not seen (usually the pending token, or the last draft plus the pending token after a fully
accepted round) and after verification it is cut back to the accepted prefix.

Of a long prompt it reads only the last :data:`DRAFT_CONTEXT` tokens (its cache holds them from position
0).  It reads a long prompt after the first token is given, a short one before (``Request.start``), and
every draft step attends over what the cache holds; drafts lean on the last few tokens (copies from further
back come from the suffix and lookup proposers) and only decide speed, never the answer (the target verifies
every token).  On the long bench
prompts (``benchmarks/draft_window_ab.py``) a window of 128 tokens decoded 1.19x faster than one of 512, at
the same acceptance (docs/measurements.md).
"""

from __future__ import annotations

import time

import numpy as np

from edge_spec.runtime.model.decoder import Decoder
from edge_spec.runtime.propose.base import DraftBlock, DraftRule, Proposer
from edge_spec.runtime.propose.heads import DraftHead, SpecVocabHead
from edge_spec.runtime.verify.coupled import draw_sampled
from edge_spec.runtime.verify.sampling import SamplingParams, logits_to_probs, mask_logits, scatter_probs

STEP_SMOOTHING = 0.2  # weight of the newest single-token step in the drafter's step estimate
DRAFT_CONTEXT = 128  # prompt tokens a drafter model reads at most (the prompt's tail; see above)


class ChainDrafter(Proposer):
    """A drafter that proposes a chain one step at a time (the drafter model, the EAGLE head).

    Subclasses give ``start(committed)`` -- catch up on the committed tokens and return the head's
    logits for the next position with the target ids of its rows and how many rows that step fed --
    and ``step(token)``, the same after one more drafted token."""

    kind = "model"

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size  # the target's: q rows are scattered over it
        self.step_estimate: float | None = None  # moving average of one single-row draft step, s
        self.busy_seconds = 0.0  # all draft steps so far, whole (pass, head, confidence, stop rule)

    def covered(self, prompt_ids: list[int]) -> int:
        """A drafter that reads tokens catches up on any prompt by itself."""
        return len(prompt_ids)

    def start(self, committed: list[int]) -> tuple[np.ndarray, np.ndarray | None, int]:
        raise NotImplementedError

    def step(self, token: int) -> tuple[np.ndarray, np.ndarray | None]:
        raise NotImplementedError

    def propose(self, committed: list[int], room: int, rule: DraftRule) -> DraftBlock:
        """Up to ``min(rule.gamma, room)`` target-vocabulary tokens after ``committed``, stopping early
        when the drafter is unsure: below ``rule.min_confidence``, or when ``rule.stop`` says another
        draft does not pay; and after a draft that ends the answer (``params.end_ids``).  With
        ``rule.alternatives`` it also records its top tokens per step.

        Under ``rule.constraint`` each step draws from the head's distribution over the tokens the grammar
        allows there (masked, then the sampling settings: the q the verifier gets), advancing the constraint
        along the drafts and leaving it after the last: those steps and their masks are the verifier's
        (``Constraint.masks``); the block ends where the grammar allows none of the head's rows."""
        block = DraftBlock(self.name)
        self._draft(block, committed, room, rule)
        if block.steps == 0:
            self.start_empty(committed)
        return block

    def _draft(self, block: DraftBlock, committed: list[int], room: int, rule: DraftRule) -> None:
        params, constraint = rule.params, rule.constraint
        for _ in range(min(rule.gamma, room)):
            if rule.should_stop is not None and rule.should_stop():
                block.complete = False
                break
            started = time.perf_counter()
            if block.steps == 0:
                logits, ids, fed = self.start(committed)
            else:
                (logits, ids), fed = self.step(block.tokens[-1]), 1
            block.steps += 1
            if constraint is not None:
                allowed = head_rows(constraint.allowed(), ids, logits.shape[-1])
                if not allowed.any():  # the grammar allows none of this head's rows
                    self.busy_seconds += time.perf_counter() - started
                    break
                logits = mask_logits(logits, allowed)
            if params.greedy and not rule.alternatives:
                index = int(np.argmax(logits))
                confidence = top_probability(logits) if (rule.min_confidence > 0 or rule.stop) else 1.0
            else:  # sampling, or alternatives that need the whole distribution: the confidence comes with it
                probs = drafter_probs(logits, params)
                index = draw_index(
                    probs, logits, ids, params, rule.rng, len(committed) + len(block.tokens), self.vocab_size
                )
                confidence = float(probs[index])
            keep, more = True, confidence >= rule.min_confidence
            if rule.stop is not None:  # a draft whose outcome is fixed by the prefix may be left unverified
                keep, more = rule.stop.add(confidence, may_drop=params.deterministic)
            elapsed = time.perf_counter() - started
            self.busy_seconds += elapsed  # what a round's time outside the drafter leaves out
            if fed == 1:  # catch-up steps that feed several rows say little about one step's cost
                self._time_step(block, elapsed)
            if not keep:  # not worth a verify row: the cache entry is cut after verification
                break
            token = int(index) if ids is None else int(ids[index])
            if constraint is not None:
                constraint.advance(token)
            block.tokens.append(token)
            block.candidates.append(ids)
            block.confidences.append(confidence)
            if not params.deterministic:
                block.q_rows.append(
                    probs if ids is None else scatter_probs(probs, ids, self.vocab_size, validate=False)
                )
            if rule.alternatives:
                block.alternatives.append(top_tokens(probs, ids, rule.alternatives))
            if not more or block.tokens[-1] in params.end_ids:  # nothing after an end token is emitted
                break

    def start_empty(self, committed: list[int]) -> None:
        """A round without drafter steps: nothing to catch up on yet (the next start does it)."""

    @property
    def catch_up_seconds(self) -> float:
        """What reading a second token in one step adds to it, as measured live (0 until both sizes
        were): the price of each token a round leaves the drafter beyond the one it reads anyway."""
        seconds = self.decoder.stats.recent_seconds()
        return max(seconds[2] - seconds[1], 0.0) if 1 in seconds and 2 in seconds else 0.0

    @property
    def decoder(self) -> Decoder:
        """The decoder whose passes are this drafter's steps (pass logs, prefill progress)."""
        raise NotImplementedError

    @property
    def head_seconds(self) -> float:
        """Time spent so far in the drafter's LM head (the part VocabTrim and SpecVocab shrink)."""
        raise NotImplementedError

    def profile_fill(self, length: int) -> None:
        """Forget the request; hold ``length`` throw-away positions (cost profiling)."""
        raise NotImplementedError

    def profile_step(self, rows: int = 1) -> tuple[float, float]:
        """Time one step that reads ``rows`` tokens after the profiling fill, as (body, head) seconds,
        leaving the cache as it was."""
        raise NotImplementedError

    def _time_step(self, block: DraftBlock, seconds: float) -> None:
        block.step_seconds.append(seconds)
        previous = self.step_estimate
        self.step_estimate = seconds if previous is None else (1 - STEP_SMOOTHING) * previous + STEP_SMOOTHING * seconds


class ModelDrafter(ChainDrafter):
    """The ``model`` proposer: a small decoder body plus one LM head (see :mod:`propose.base`)."""

    name = "model"

    def __init__(
        self, body: Decoder, head: DraftHead | SpecVocabHead, vocab_size: int, context: int | None = DRAFT_CONTEXT
    ) -> None:
        super().__init__(vocab_size)
        self.body = body
        self.head = head
        self.context = context  # prompt tokens read at most (None: all)
        self.offset = 0  # the committed index the cache's position 0 holds

    def begin(self, prompt_ids: list[int], outputs: dict[str, np.ndarray]) -> None:
        """Read the prompt (its tail, past :attr:`context` tokens) now, so that the drafter's prefill counts
        as prompt processing."""
        self.offset = self._window_start(prompt_ids)
        self.body.prefill(prompt_ids[self.offset :])

    def _window_start(self, prompt_ids: list[int]) -> int:
        """Where the drafter's window into ``prompt_ids`` begins: 0 for a prompt within :attr:`context`; the
        window in the cache while it still starts the prompt's cached part and the uncached rest stays within
        another :attr:`context` (a conversation's next turn reads only its new tokens); else the last
        :attr:`context` tokens."""
        if self.context is None or len(prompt_ids) <= self.context:
            return 0
        kept, cached = self.offset, self.body.tokens
        if 0 < kept and len(prompt_ids) - kept <= 2 * self.context and cached[:1] == prompt_ids[kept : kept + 1]:
            return kept
        return len(prompt_ids) - self.context

    def _window(self, committed: list[int]) -> list[int]:
        if self.offset >= len(committed):  # rewound before the window: read from the start again
            self.offset = 0
        return committed[self.offset :] if self.offset else committed

    def next_logits(self, prefix: list[int]) -> tuple[np.ndarray, np.ndarray | None]:
        """The head's logits for the token after ``prefix`` and the target ids of its rows (None: the
        full vocabulary in order); the cache then holds ``prefix`` (its window)."""
        return self._forward(self.body.sync(self._window(prefix)))

    def start(self, committed: list[int]) -> tuple[np.ndarray, np.ndarray | None, int]:
        feed = self.body.sync(self._window(committed))
        return (*self._forward(feed), len(feed))

    def step(self, token: int) -> tuple[np.ndarray, np.ndarray | None]:
        return self._forward([token])

    def start_empty(self, committed: list[int]) -> None:
        self.body.sync(self._window(committed))  # forget what the cache holds beyond the committed tokens

    def observe(self, tokens: list[int], outputs: dict[str, np.ndarray], accepted: int) -> None:
        """A model drafter reads tokens only; it catches up on them at the next proposal."""

    def rewind(self, length: int) -> None:
        if length <= self.offset:
            self.offset = 0
            self.body.rewind(0)
            return
        self.body.rewind(min(self.body.length, length - self.offset))

    @property
    def decoder(self) -> Decoder:
        return self.body

    @property
    def head_seconds(self) -> float:
        return self.head.seconds

    def profile_fill(self, length: int) -> None:
        self.body.reset()
        self.offset = 0
        if length:
            self.body.forward([0] * length, 1)

    def profile_step(self, rows: int = 1) -> tuple[float, float]:
        length = self.body.length
        started = time.perf_counter()
        hidden = self.body.forward([0] * rows, 1)["hidden_states"][-1]
        body_done = time.perf_counter()
        self.head(hidden)
        self.body.rewind(length)
        return body_done - started, time.perf_counter() - body_done

    def _forward(self, feed: list[int]) -> tuple[np.ndarray, np.ndarray | None]:
        hidden = self.body.forward(feed, 1)["hidden_states"]
        return self.head(hidden[-1])


def draw_index(
    probs: np.ndarray,
    logits: np.ndarray,
    ids: np.ndarray | None,
    params: SamplingParams,
    rng: np.random.Generator | None,
    position: int,
    vocab_size: int,
) -> int:
    """The head row drafted for sequence index ``position``: the argmax when greedy, the coupled race
    with that position's noise (the target's own choice whenever the two agree), else a draw from q
    (the only case that needs ``rng``)."""
    if params.greedy:
        return int(np.argmax(logits))
    return draw_sampled(probs, params, rng, position, vocab_size, ids)


def head_rows(allowed: np.ndarray, ids: np.ndarray | None, rows: int) -> np.ndarray:
    """A target-vocabulary mask as a mask over a head's ``rows`` rows (``ids``: their target ids; None:
    the first ``rows`` ids in order)."""
    return allowed[:rows] if ids is None else allowed[ids]


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


def top_probability(logits: np.ndarray) -> float:
    shifted = logits - logits.max()
    return float(1.0 / np.exp(shifted, dtype=np.float64).sum())
