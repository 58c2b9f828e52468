"""Plain autoregressive decoding: the baseline every speculative mode must reproduce exactly."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from edge_spec.runtime.model.decoder import Decoder
from edge_spec.runtime.verify.sampling import SamplingParams, logits_to_probs, sample


def choose_token(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """Greedy = first argmax (no softmax needed); otherwise sample from the processed distribution."""
    if params.greedy:
        return int(np.argmax(logits))
    return sample(logits_to_probs(logits, params), rng)


def generate_autoregressive(
    target: Decoder, prompt_ids: list[int], params: SamplingParams, rng: np.random.Generator, max_new_tokens: int
) -> Iterator[int]:
    """Yield up to ``max_new_tokens`` ids; the caller stops early (eos, stop string, cancel) by closing us."""
    logits = target.prefill(prompt_ids)["logits"][-1]
    for step in range(max_new_tokens):
        token = choose_token(logits, params, rng)
        yield token
        if step + 1 < max_new_tokens:
            logits = target.forward([token])["logits"][-1]
