"""The speculative decoding loop: draft a chain, verify it in one target pass, roll back, emit.

Read it top to bottom like gpt-fast's ``speculative_decode`` or llama.cpp's ``common/speculative.cpp``:

1. Draft: the planner (``schedule.planner``) picks the proposer -- a prompt-lookup match that pays,
   else the drafter model with this round's stop rule, else a free guess for the spare row of a
   batch-invariant pass -- and the proposer drafts (``propose``).  A stop asked for (the engine's
   cancel) ends the loop in whichever model pass it cuts or refuses (``Decoder.interrupt``).
2. Verify: one target pass over ``[pending, d1..dγ]`` gives γ + 1 rows; greedy or coupled match, or
   rejection sampling (``verify.chain``) returns the accepted drafts plus one correction/bonus token.
3. Roll back the caches to the accepted prefix, show the proposers the target's outputs, emit.

Under a constraint (structured output) the target's rows are masked to what the grammar allows after
each draft, the drafter draws from its masked distribution (the q the verifier gets), drafts the
grammar forbids are cut before the pass, and tokens the grammar forces are drafted first, for free.

Exactness does not depend on the proposer: greedy output equals target-only greedy output, and
sampled output follows the target's distribution, because the verifier sees the same processed
target distribution ``p`` the autoregressive loop samples from, and the exact ``q`` each draft was
drawn from (zero outside a trimmed head; a point mass for lookup drafts and guesses).
"""

from __future__ import annotations

from collections.abc import Iterator

from edge_spec.runtime.loops.config import ChainConfig
from edge_spec.runtime.loops.request import Request
from edge_spec.runtime.schedule.planner import DraftPlanner
from edge_spec.runtime.verify.chain import verify_chain


def generate_chain(request: Request, config: ChainConfig = ChainConfig()) -> Iterator[int]:
    """Yield up to ``request.max_new_tokens`` ids, distributed exactly as target-only decoding would produce
    them (under the request's constraint: as target-only decoding masked to what it allows would)."""
    target, params, rng, memory = request.target, request.params, request.rng, request.memory
    calibration = memory.calibration(params.regime) if memory else None
    planner = DraftPlanner(
        request.proposers,
        target,
        config.gamma,
        config.adaptive,
        config.min_confidence,
        calibration,
        memory.overhead if memory else None,
    )
    yield from request.start()
    while not request.done:
        # 1. draft: the planner picks who drafts and how many
        clock = request.clock()
        block = planner.draft(request.committed, request.room(), params, rng, request.constraint)
        masks = request.constrain(block)  # under a constraint: drafts it forbids go, each row's mask
        clock.drafted()

        # 2. verify: one target pass over [pending, d1..dγ] -> γ + 1 rows
        outputs = target.forward([request.pending] + block.tokens, len(block.tokens) + 1, lean=block.lean)
        rows = request.masked(outputs["logits"], masks)
        result = verify_chain(block.tokens, block.q_rows, rows, params, rng, len(request.committed))
        clock.verified()
        planner.update(block, result, clock.outside_seconds)
        request.record_round(block, result.accepted, result.tokens, clock)

        # 3. roll back to the accepted prefix; the correction/bonus token becomes pending
        yield from request.accept(result.accepted, result.tokens, outputs)
