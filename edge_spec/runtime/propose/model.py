"""A drafter model: a small decoder body (final hidden states) plus one LM head (full, VocabTrim or SpecVocab).

It keeps its own KV cache, so before each proposal it catches up on the committed tokens it has
not seen (usually the pending token, or the last draft plus the pending token after a fully
accepted round) and after verification it is cut back to the accepted prefix.
"""

from __future__ import annotations

import time

import numpy as np

from edge_spec.runtime.model.decoder import Decoder
from edge_spec.runtime.propose.base import DraftBlock, DraftRule
from edge_spec.runtime.propose.heads import DraftHead, SpecVocabHead
from edge_spec.runtime.verify.sampling import SamplingParams, logits_to_probs, sample, scatter_probs

STEP_SMOOTHING = 0.2  # weight of the newest single-token step in the drafter's step estimate


class ModelDrafter:
    """The ``model`` proposer (see :mod:`propose.base`)."""

    name = "model"
    kind = "model"

    def __init__(self, body: Decoder, head: DraftHead | SpecVocabHead, vocab_size: int) -> None:
        self.body = body
        self.head = head
        self.vocab_size = vocab_size  # the target's: q rows are scattered over it
        self.step_estimate: float | None = None  # moving average of one draft step (body + head + sampling), s

    def begin(self, prompt_ids: list[int], outputs: dict[str, np.ndarray]) -> None:
        """Read the prompt now, so that the drafter's prefill counts as prompt processing."""
        self.body.prefill(prompt_ids)

    def next_logits(self, prefix: list[int]) -> tuple[np.ndarray, np.ndarray | None]:
        """The head's logits for the token after ``prefix`` and the target ids of its rows (None: the
        full vocabulary in order); the cache then holds ``prefix``."""
        return self._step(self.body.sync(prefix))

    def propose(self, committed: list[int], room: int, rule: DraftRule) -> DraftBlock:
        """Up to ``min(rule.gamma, room)`` target-vocabulary tokens after ``committed``, stopping early
        when the drafter is unsure: below ``rule.min_confidence``, or when ``rule.stop`` says another
        draft does not pay.  With ``rule.alternatives`` it also records its top tokens per step."""
        params, feed = rule.params, self.body.sync(committed)
        block = DraftBlock(self.name)
        for _ in range(min(rule.gamma, room)):
            if rule.should_stop is not None and rule.should_stop():
                block.complete = False
                break
            started = time.perf_counter()
            logits, ids = self._step(feed)
            block.steps += 1
            if params.greedy and not rule.alternatives:
                index = int(np.argmax(logits))
                confidence = top_probability(logits) if (rule.min_confidence > 0 or rule.stop) else 1.0
            else:  # sampling, or alternatives that need the whole distribution: the confidence comes with it
                probs = drafter_probs(logits, params)
                index = int(np.argmax(logits)) if params.greedy else sample(probs, rule.rng)
                confidence = float(probs[index])
            keep, more = True, confidence >= rule.min_confidence
            if rule.stop is not None:
                keep, more = rule.stop.add(rule.stop.acceptance(confidence), may_drop=params.greedy)
            if len(feed) == 1:
                self._time_step(block, time.perf_counter() - started)
            if not keep:  # not worth a verify row: the cache entry is cut after verification
                break
            block.tokens.append(int(index) if ids is None else int(ids[index]))
            block.candidates.append(ids)
            block.confidences.append(confidence)
            if not params.greedy:
                block.q_rows.append(probs if ids is None else scatter_probs(probs, ids, self.vocab_size,
                                                                            validate=False))
            if rule.alternatives:
                block.alternatives.append(top_tokens(probs, ids, rule.alternatives))
            feed = [block.tokens[-1]]
            if not more:
                break
        return block

    def observe(self, outputs: dict[str, np.ndarray], accepted: int) -> None:
        """A model drafter reads tokens only; it catches up on them at the next proposal."""

    def rewind(self, length: int) -> None:
        self.body.rewind(min(self.body.length, length))

    def _step(self, feed: list[int]) -> tuple[np.ndarray, np.ndarray | None]:
        hidden = self.body.forward(feed, 1)["hidden_states"]
        return self.head(hidden[-1])

    def _time_step(self, block: DraftBlock, seconds: float) -> None:
        block.step_seconds.append(seconds)
        previous = self.step_estimate
        self.step_estimate = seconds if previous is None else (1 - STEP_SMOOTHING) * previous + STEP_SMOOTHING * seconds


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
