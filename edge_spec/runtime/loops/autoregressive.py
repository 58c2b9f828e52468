"""Plain autoregressive decoding: the baseline every speculative mode must reproduce exactly."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np

from edge_spec.runtime.loops.config import ArConfig
from edge_spec.runtime.verify.coupled import draw_sampled
from edge_spec.runtime.verify.sampling import SamplingParams, logits_to_probs, mask_logits

if TYPE_CHECKING:  # the request module chooses its first token here
    from edge_spec.runtime.loops.request import Request


def choose_token(
    logits: np.ndarray,
    params: SamplingParams,
    rng: np.random.Generator,
    position: int,
    allowed: np.ndarray | None = None,
) -> int:
    """The token at sequence index ``position``: greedy = first argmax (no softmax needed); coupled =
    the race with that position's noise; otherwise drawn from the processed distribution.  ``allowed``:
    a constraint's mask, applied to the logits first."""
    logits = mask_logits(logits, allowed)
    if params.greedy:
        return int(np.argmax(logits))
    probs = logits_to_probs(logits, params)
    return draw_sampled(probs, params, rng, position, probs.shape[-1])


def generate_autoregressive(request: Request, config: ArConfig = ArConfig()) -> Iterator[int]:
    """Yield up to ``request.max_new_tokens`` ids; the caller stops early (eos, stop string) by closing us,
    a cancel by cutting or refusing a pass of the target (``Decoder.interrupt``).  Under the request's
    constraint each token is chosen among the tokens it allows (the masked logits); the stats'
    ``token_logprobs``, when kept, get each token's entry from its raw row before the token is yielded."""
    target, constraint, logprobs = request.target, request.constraint, request.stats.token_logprobs
    prompt_ids, params, rng, max_new_tokens = request.prompt_ids, request.params, request.rng, request.max_new_tokens
    logits = target.prefill(prompt_ids)["logits"][-1]
    for step in range(max_new_tokens):
        allowed = constraint.allowed() if constraint is not None else None
        token = choose_token(logits, params, rng, len(prompt_ids) + step, allowed)
        if constraint is not None:
            constraint.advance(token)
        if logprobs is not None:
            logprobs.record(logits, token)
        yield token
        if step + 1 < max_new_tokens:
            logits = target.forward([token])["logits"][-1]
