"""No draft past a token that ends the answer: it could never be emitted, so it would only cost a
drafter step and a verify row."""

from __future__ import annotations

import numpy as np
import pytest

from edge_spec.runtime.engine import Engine
from edge_spec.runtime.loops.config import ChainConfig
from edge_spec.runtime.propose.base import DraftRule, point_mass_block, through_end
from edge_spec.runtime.propose.model import ChainDrafter
from edge_spec.runtime.verify.sampling import SamplingParams

VOCAB = 16


class ScriptedDrafter(ChainDrafter):
    """Proposes ``script`` in order (each with almost all the probability)."""

    name = "scripted"

    def __init__(self, script: list[int]) -> None:
        super().__init__(VOCAB)
        self.script = script
        self.steps = 0

    def _logits(self) -> np.ndarray:
        logits = np.zeros(VOCAB)
        logits[self.script[self.steps]] = 10.0
        self.steps += 1
        return logits

    def start(self, committed: list[int]) -> tuple[np.ndarray, None, int]:
        return self._logits(), None, 1

    def step(self, token: int) -> tuple[np.ndarray, None]:
        return self._logits(), None

    def start_empty(self, committed: list[int]) -> None:
        pass


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_drafter_stops_after_an_end_token(temperature):
    params = SamplingParams(temperature=temperature, end_ids=frozenset({7}))
    drafter = ScriptedDrafter([3, 7, 5, 6])
    block = drafter.propose([1, 2], room=10, rule=DraftRule(params, np.random.default_rng(0), gamma=4))
    assert block.tokens == [3, 7] and block.steps == 2
    # without end tokens the same script is drafted to gamma (the negative control)
    free = ScriptedDrafter([3, 7, 5, 6]).propose(
        [1, 2], room=10, rule=DraftRule(SamplingParams(), np.random.default_rng(0), gamma=4)
    )
    assert free.tokens == [3, 7, 5, 6] and free.steps == 4


def test_sequence_drafts_stop_at_an_end_token():
    assert through_end([4, 9, 2, 9], frozenset({9})) == [4, 9]
    assert through_end([4, 2], frozenset({9})) == [4, 2]
    block = point_mass_block("lookup", [4, 9, 2], SamplingParams(temperature=0.5, end_ids=frozenset({9})))
    assert block.tokens == [4, 9] and block.q_rows == [None, None]  # a point mass on each


@pytest.fixture(scope="module")
def engine(int4_bundle):
    return Engine.from_bundle(int4_bundle, threads=1, mode="spec", draft_head="trim-160")


@pytest.mark.parametrize(
    "config",
    [
        ChainConfig(gamma=4, adaptive=False, proposers=("model", "guess")),
        ChainConfig(gamma=4, adaptive=False, proposers=("lookup", "guess")),
    ],
)
def test_answers_ending_early_stay_exact_and_draft_nothing_past_the_end(engine, monkeypatch, config):
    """Make a token the answer repeats the end token: answers end where the target's own do, and no
    round verifies a draft that follows a drafted end token."""
    messages = [{"role": "user", "content": "a b c d a b c d a b"}]
    reference = engine.complete(messages, max_new_tokens=40, temperature=0, mode="ar", exact=True).token_ids
    end = max(set(reference[8:]), key=reference[8:].count)  # drafters propose it in mid-chain
    engine.config = config
    monkeypatch.setattr(engine.bundle.tokenizer, "eos_token_ids", {end})
    seen = []
    original = engine.bundle.target.forward

    def forward(tokens, *args, **kwargs):
        seen.append(list(tokens))
        return original(tokens, *args, **kwargs)

    monkeypatch.setattr(engine.bundle.target, "forward", forward)
    answer = engine.complete(messages, max_new_tokens=40, temperature=0).token_ids
    assert answer == reference[: reference.index(end)]
    assert all(end not in tokens[1:-1] for tokens in seen[1:])  # an end token is only ever a round's last draft
