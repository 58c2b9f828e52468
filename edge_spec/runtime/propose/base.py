"""What every proposer answers: the interface the loops draft through, and the block of drafts it returns.

A proposer is anything that can guess the next tokens of the sequence: a drafter model, the
sequence itself (prompt lookup), a free guess for an otherwise wasted verify row, and a
feature-level head that reads the target's hidden states (EAGLE-3).  The loops see only this interface, in
the spirit of llama.cpp's ``common_speculative`` (begin / draft / accept) and HF's
``CandidateGenerator``:

* ``begin(prompt_ids, outputs)`` -- a request starts: read the prompt (a model drafter prefills it);
  ``outputs`` are the target's prefill outputs (``features`` of the prompt positions it computed, when
  the target exports them).
* ``propose(committed, room, rule)`` -- up to ``min(rule.gamma, room)`` drafts after ``committed``.
* ``observe(tokens, outputs, accepted)`` -- the verify pass's tokens as kept (the pending token and
  the accepted drafts), the target's outputs of that pass (logits, and ``features`` when the target
  exports them) and how many drafts it accepted: what a feature-level drafter conditions on.
* ``rewind(length)`` -- the sequence was cut back to ``length`` tokens; forget what lies beyond.

Exactness never depends on the proposer: the verifier only needs the exact q each draft was drawn
from (``DraftBlock.q_rows``; a point mass for drafts that are a function of the prefix).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from edge_spec.runtime.constrain import Constraint
from edge_spec.runtime.verify.sampling import SamplingParams


class StopRule(Protocol):
    """The schedule's rule inside a round (``schedule.policy.DraftRound``): after each draft, keep
    it or not and draft another or not, from the drafter's confidence in it."""

    def add(self, confidence: float, may_drop: bool = True) -> tuple[bool, bool]: ...


@dataclass
class DraftRule:
    """How to draft this round: sampling settings, the most drafts, and when to stop earlier."""

    params: SamplingParams
    rng: np.random.Generator
    gamma: int
    min_confidence: float = 0.0  # stop once the drafter's probability of its token falls below this
    stop: StopRule | None = None  # the adaptive schedule's per-draft rule (None: draft up to gamma)
    alternatives: int = 0  # > 0: also record the top tokens per step (SSD predicts outcomes from them)
    should_stop: Callable[[], bool] | None = None  # asked before every step; True ends the block, incomplete
    # what the answer may contain (None: anything), in the state after ``committed``; a proposer may advance
    # it along its drafts and leave it there (the round's verification goes on from where it stops)
    constraint: Constraint | None = None


@dataclass
class DraftBlock:
    """One round's drafts: target ids, (when sampling) their full-vocabulary q rows, the head rows
    each was chosen among (None: full vocabulary; empty for drafts no head chose), the drafter's confidence in each, and the latency
    of each single-token step (catch-up steps that feed several tokens are left out)."""

    source: str = ""  # the proposer's registry name
    tokens: list[int] = field(default_factory=list)
    q_rows: list[np.ndarray | None] = field(default_factory=list)  # None: a point mass on that draft
    candidates: list[np.ndarray | None] = field(default_factory=list)
    confidences: list[float] = field(default_factory=list)  # drafter probability of each proposed token
    step_seconds: list[float] = field(default_factory=list)
    steps: int = 0  # model steps this block cost (a dropped last draft still cost its step)
    alternatives: list[list[tuple[int, float]]] = field(default_factory=list)  # top (id, prob) per step, if asked
    complete: bool = True  # False when should_stop cut the block short
    matched: int = 0  # sequence drafts: how many tokens of the sequence's suffix their source matched
    cached: bool = False  # suffix drafts: only earlier requests' text (the suffix cache) has the first one
    lean: bool = False  # no drafts and no spare row: verify in the fewest rows exactness allows here

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` drafts (a prefix of a chain is a valid chain)."""
        for rows in (self.tokens, self.q_rows, self.candidates, self.confidences, self.alternatives):
            del rows[length:]


def through_end(tokens: list[int], end_ids: frozenset[int]) -> list[int]:
    """``tokens`` up to and including the first that ends the answer: a draft after it could never be
    emitted, so verifying it would only cost a row."""
    for i, token in enumerate(tokens):
        if token in end_ids:
            return tokens[: i + 1]
    return tokens


def point_mass_block(source: str, tokens: list[int], params: SamplingParams) -> DraftBlock:
    """Drafts that are a function of the prefix alone (lookup, guesses): q is a point mass on each
    (and no head rows were involved, so they have no ``candidates``); none past an end token."""
    tokens = through_end(tokens, params.end_ids)
    block = DraftBlock(source, tokens=list(tokens), confidences=[1.0] * len(tokens))
    if not params.deterministic:
        block.q_rows.extend([None] * len(tokens))  # a point mass on each (``verify.chain``: never written out)
    return block


class Proposer(Protocol):
    """See the module docstring.  ``kind`` tells the schedule how to use it:

    * ``"model"`` -- costs a step per draft (``step_estimate`` seconds, plus ``catch_up_seconds`` per
      token a round leaves it to catch up on beyond one); the schedule decides how many.  The loops
      time the round's drafting by the first such proposer (``busy_seconds``, ``head_seconds``).
    * ``"sequence"`` -- free to ask; its drafts are taken when they promise more tokens per second
      than the model's, or always, before anyone else's, when the proposer is ``certain`` (its drafts
      cannot be rejected: tokens the grammar forces).  One that is ``own_first`` is judged on its first
      drafts on their own (they are not the free guess's token).
    * ``"filler"`` -- free; asked only when a round has no drafts but its verify pass has a spare row.

    The proposers of this package subclass it, so the roles below have their defaults.
    """

    name: str
    kind: str
    step_estimate: float | None
    certain: bool = False  # a sequence proposer whose drafts are all accepted: taken first and whole
    own_first: bool = False  # a sequence proposer whose first draft the schedule judges on its own
    catch_up_seconds: float = 0.0  # a model proposer's price of each extra token it reads in a step
    busy_seconds: float = 0.0  # a model proposer's steps so far, whole (the round's clock reads it)
    head_seconds: float = 0.0  # the part of them in its LM head

    def covered(self, prompt_ids: list[int]) -> int:
        """How many leading prompt positions this proposer could skip re-reading (a target whose cache
        holds more must compute the rest again, so that the proposer sees their outputs)."""

    def begin(self, prompt_ids: list[int], outputs: dict[str, np.ndarray]) -> None: ...

    def propose(self, committed: list[int], room: int, rule: DraftRule) -> DraftBlock: ...

    def observe(self, tokens: list[int], outputs: dict[str, np.ndarray], accepted: int) -> None: ...

    def rewind(self, length: int) -> None: ...


class SequenceProposer(Proposer):
    """A proposer that drafts from the committed sequence alone: no prompt to read, nothing to learn
    from the target's outputs, nothing to forget (committed tokens are never taken back within a
    request).  Subclasses give ``name``, ``kind`` and ``propose``."""

    step_estimate = 0.0  # free to ask

    def __init__(self, context) -> None:
        self.context = context  # propose.context.ProposerContext: the request's shared n-gram index

    def covered(self, prompt_ids: list[int]) -> int:
        return len(prompt_ids)

    def begin(self, prompt_ids: list[int], outputs: dict[str, np.ndarray]) -> None:
        pass

    def observe(self, tokens: list[int], outputs: dict[str, np.ndarray], accepted: int) -> None:
        pass

    def rewind(self, length: int) -> None:
        pass
