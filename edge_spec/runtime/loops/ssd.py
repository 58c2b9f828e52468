"""Speculative speculative decoding (SSD, algorithm Saguaro): draft round t+1 while the target verifies round t.

Plain speculative decoding alternates: the drafter waits while the target verifies.  Here the
verify pass runs in a worker thread (ONNX Runtime releases the GIL inside ``run``; each session
has its own thread pool, e.g. 1 + 1 threads on a 2-core laptop, or the target on a GPU provider
and the drafter on the CPU) and the drafter meanwhile prepares the next round for the verification
outcomes it finds likely.  One round, top to bottom:

1. Drafts: if the previous outcome ``(accepted j, next token c)`` is in the speculation cache, its
   drafts are ready (a *hit*: no drafting on the critical path); otherwise draft now (a *miss*).
2. Verify in the background.  Meanwhile predict outcomes from the drafter's own probabilities
   (:func:`predict_outcomes`): stop after j drafts with probability ``prod a_i (1 - a_{j+1})``,
   ``a_i`` the drafter's probability of its draft i; the next token is one of the drafter's top-F
   tokens at that position *other than its own draft* (a rejected token has no residual mass, so it
   can never be the correction), or, when every draft passes, one of its top-F tokens after the
   last draft (one look-ahead step).  Draft γ tokens for each outcome, most likely first, until the
   verification is done (or a fixed number, ``SpecConfig.speculations``).
3. Verify the drafts exactly as :mod:`loops.chain` does and look the outcome up for the next round.

Why it stays exact: the verifier is unchanged, and every draft it sees was drawn from the q row it
is verified against.  Which prepared block is used depends only on the verified prefix, never on
the uniforms the verifier will draw.  Draft randomness comes from a stream keyed by the prefix
length (independent of the verifier's stream), so a hit and a miss draft *the same tokens*: output
does not depend on timing, and a forced-miss run equals a forced-hit run token for token.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from edge_spec.errors import EdgeSpecError
from edge_spec.runtime.loops.config import SsdConfig
from edge_spec.runtime.loops.request import Request
from edge_spec.runtime.loops.stats import SpecStats
from edge_spec.runtime.propose.base import DraftBlock, DraftRule
from edge_spec.runtime.propose.model import ModelDrafter, drafter_probs, top_tokens
from edge_spec.runtime.verify.chain import verify_chain
from edge_spec.runtime.verify.sampling import SamplingParams

Outcome = tuple[int, int]  # (drafts accepted, the correction or bonus token that follows)


def predict_outcomes(block: DraftBlock, bonus: list[tuple[int, float]], fan_out: int) -> list[tuple[float, Outcome]]:
    """Likely verification outcomes of ``block`` with their estimated probabilities, most likely first.

    ``bonus`` is the drafter's top tokens after the last draft (empty when no look-ahead was done)."""
    outcomes = []
    reach = 1.0  # estimated probability that drafts 1..j were all accepted
    for j, token in enumerate(block.tokens):
        accept = block.confidences[j]
        others = [(c, pc) for c, pc in block.alternatives[j] if c != token][:fan_out]
        rest = max(1.0 - accept, 1e-12)
        outcomes += [(reach * (1.0 - accept) * pc / rest, (j, c)) for c, pc in others]
        reach *= accept
    outcomes += [(reach * pc, (len(block.tokens), c)) for c, pc in bonus[:fan_out]]
    return sorted(outcomes, key=lambda item: -item[0])


class SpeculationCache:
    """Drafts prepared for next-round outcomes of the round being verified (cleared every round)."""

    def __init__(self) -> None:
        self.blocks: dict[Outcome, DraftBlock] = {}

    def take(self, outcome: Outcome, length: int) -> DraftBlock | None:
        block = self.blocks.get(outcome)
        if block is not None:
            block.truncate(length)
        self.blocks.clear()
        return block


def _draft_rng(seed: int, position: int) -> np.random.Generator:
    """The drafting stream for a round whose prefix has ``position`` tokens (see module docstring)."""
    return np.random.default_rng([seed, position])


def generate_ssd(request: Request, config: SsdConfig = SsdConfig()) -> Iterator[int]:
    """Yield up to ``request.max_new_tokens`` ids, distributed exactly as target-only decoding would produce
    them.  A cancel cuts or refuses the pass it meets, drafting ahead's too (``Decoder.interrupt``)."""
    target, params, rng = request.target, request.params, request.rng
    drafter = request.drafter
    if drafter is None:
        raise EdgeSpecError("speculative speculative decoding needs the drafter model among the proposers")
    stats = request.stats
    yield from request.start()
    draft_seed = int(rng.integers(2**63))
    ready: DraftBlock | None = None  # drafts taken from the speculation cache for this round
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="edge-spec-verify") as worker:
        while not request.done:
            gamma = min(config.gamma, request.room())

            # 1. drafts: ready from the cache (hit) or drafted now (miss)
            clock = request.clock()
            if ready is not None:
                block = ready
                stats.speculation_hits += 1
            else:
                rule = _rule(params, draft_seed, request.committed, gamma, config.fan_out)
                block = drafter.propose(request.committed, gamma, rule)
                stats.speculation_misses += bool(gamma)
            clock.drafted()

            # 2. verify in the background; meanwhile draft ahead for the likely outcomes
            pending: Future = worker.submit(target.forward, [request.pending] + block.tokens, len(block.tokens) + 1)
            cache = SpeculationCache()
            if block.tokens:
                _prepare(
                    drafter,
                    request.committed,
                    block,
                    params,
                    draft_seed,
                    config,
                    pending.done,
                    cache,
                    stats,
                    room_after=lambda prefix: request.room(
                        prefix, request.emitted + len(prefix) - len(request.committed)
                    ),
                )
            outputs = pending.result()
            result = verify_chain(block.tokens, block.q_rows, outputs["logits"], params, rng, len(request.committed))
            clock.verified()
            request.record_round(block, result.accepted, result.tokens, clock)

            # 3. roll back; the next round's drafts come from the cache if this outcome was prepared
            next_committed = request.committed + result.tokens
            next_room = request.room(next_committed, request.emitted + len(result.tokens))
            ready = cache.take((result.accepted, result.tokens[-1]), min(config.gamma, next_room))
            yield from request.accept(result.accepted, result.tokens, outputs)


def _rule(
    params: SamplingParams,
    draft_seed: int,
    prefix: list[int],
    gamma: int,
    fan_out: int,
    should_stop: Callable[[], bool] | None = None,
) -> DraftRule:
    """Drafting for a round after ``prefix``: the prefix-keyed stream, the top tokens SSD predicts from;
    ``should_stop()`` True (the verify pass is done) ends drafting ahead."""
    return DraftRule(
        params, _draft_rng(draft_seed, len(prefix)), gamma, alternatives=fan_out + 1, should_stop=should_stop
    )


def _prepare(
    drafter: ModelDrafter,
    committed: list[int],
    block: DraftBlock,
    params: SamplingParams,
    draft_seed: int,
    config: SsdConfig,
    verified: Callable[[], bool],
    cache: SpeculationCache,
    stats: SpecStats,
    *,
    room_after: Callable[[list[int]], int],
) -> None:
    """Draft the next round for the most likely outcomes of ``block`` until ``verified()`` (speculations
    -1) or for exactly ``config.speculations`` outcomes, each no longer than the next round may verify
    (``room_after(prefix)``: the context and the token budget bound it as they bound this round).  Its
    drafter steps and head time count in ``stats`` like those of the critical path, so the head's cost
    per step stays one figure."""
    started = time.perf_counter()
    head_before = drafter.head_seconds
    budget, timed = config.speculations, config.speculations < 0

    def stop() -> bool:
        return timed and verified()

    bonus: list[tuple[int, float]] = []
    if not stop() and budget != 0:  # look-ahead after the last draft: the bonus-token candidates
        logits, ids = drafter.next_logits(committed + block.tokens)
        bonus = top_tokens(drafter_probs(logits, params), ids, config.fan_out)
        stats.draft_steps += 1
    prepared = 0
    for _, (accepted, token) in predict_outcomes(block, bonus, config.fan_out):
        if stop() or (not timed and prepared >= budget):
            break
        prefix = committed + block.tokens[:accepted] + [token]
        gamma = min(config.gamma, room_after(prefix))
        spec = drafter.propose(prefix, gamma, _rule(params, draft_seed, prefix, gamma, config.fan_out, stop))
        stats.draft_steps += spec.steps
        if spec.complete:
            spec.steps = 0  # counted here, where they ran, not again when the block is used
            cache.blocks[(accepted, token)] = spec
            prepared += 1
    stats.speculations_prepared += prepared
    stats.prepare_seconds += time.perf_counter() - started
    stats.head_seconds += drafter.head_seconds - head_before
