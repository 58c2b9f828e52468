"""Plain autoregressive decoding: the baseline every speculative mode must reproduce exactly."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np

from edge_spec.runtime.constrain import Constraint
from edge_spec.runtime.logprobs import LogprobRecorder
from edge_spec.runtime.model.decoder import Decoder
from edge_spec.runtime.verify.coupled import draw_sampled
from edge_spec.runtime.verify.sampling import SamplingParams, logits_to_probs, mask_logits


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


def generate_autoregressive(
    target: Decoder,
    prompt_ids: list[int],
    params: SamplingParams,
    rng: np.random.Generator,
    max_new_tokens: int,
    constraint: Constraint | None = None,
    logprobs: LogprobRecorder | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> Iterator[int]:
    """Yield up to ``max_new_tokens`` ids; the caller stops early (eos, stop string, cancel) by closing us,
    or by ``should_stop()`` turning True, asked before each pass after the prompt's.
    ``constraint``: each token is chosen among the tokens it allows (the masked logits).  ``logprobs``:
    records each token's entry from its raw row before the token is yielded."""
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
            if should_stop is not None and should_stop():
                return
            logits = target.forward([token])["logits"][-1]
