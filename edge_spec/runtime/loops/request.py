"""What the speculative loops share: one request's sequence, its prologue, roll-back, emission and clock.

* ``committed`` is every token of the sequence so far; its last token is *pending*: emitted, but
  not yet in the target's cache.  Every round verifies ``[pending, drafts...]`` in one target pass.
* :meth:`Request.start` reads the prompt into the target and emits the first token exactly as
  autoregressive decoding would; every proposer reads the prompt before that token when the prompt
  brought few new tokens, after it when it brought many.
* :meth:`Request.accept` cuts the target's cache (and the proposers') to the accepted prefix, shows
  the proposers the target's outputs, and emits the accepted drafts plus the correction/bonus token.
  When the stats keep ``token_sources``, every emitted token's source goes there just before it is
  yielded: the proposer of the round :meth:`Request.record_round` recorded for an accepted draft,
  "target" for the first token and each correction/bonus.  When the stats keep ``token_logprobs``,
  every emitted token's entry goes there too, from the target's raw row for it: the prefill's last row
  for the first token, the verify pass's row of its position for the others (``logprobs``).
* Under a constraint (structured output) each round's drafts are walked once: the drafter advances it
  along its drafts as it masks them, and :meth:`Request.constrain` keeps those steps and their masks
  (walking on only along drafts no proposer walked); every verified row of the target is masked to what
  it allows there (:meth:`Request.masked`: greedy takes the masked argmax, sampling the masked
  distribution), and :meth:`Request.accept` takes back the rejected drafts alone, so the constraint
  follows ``committed`` between rounds.
* A stop asked for (the engine's cancel) is the decoders' business, not the loops': a pass under way is
  cut and a pass about to start is refused (``Decoder.interrupt``, ``Decoder.stop_requested``), and the
  loop ends there with :class:`~edge_spec.runtime.model.decoder.PassInterrupted`, having yielded only
  verified tokens, so a cancel waits for no pass.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np

from edge_spec.runtime.constrain import Constraint
from edge_spec.runtime.loops.autoregressive import choose_token
from edge_spec.runtime.loops.stats import TARGET, SpecStats
from edge_spec.runtime.model.decoder import Decoder
from edge_spec.runtime.propose.base import DraftBlock, Proposer
from edge_spec.runtime.schedule.memory import ScheduleMemory
from edge_spec.runtime.verify.sampling import SamplingParams, mask_logits

READ_BEFORE_FIRST = 128  # new prompt tokens up to which the proposers read the prompt before the first token


class Request:
    """One request, from prompt to ``max_new_tokens``: what every loop takes, with its configuration (see
    the module docstring).  ``proposers``: who drafts (none in target-only decoding); ``stats``: what the
    loop did; ``constraint``: what the answer may contain, fresh; ``memory``: what the chain schedule
    learned in earlier requests with this drafter (``schedule.memory``, updated in place)."""

    def __init__(
        self,
        target: Decoder,
        proposers: list[Proposer],
        prompt_ids: list[int],
        params: SamplingParams,
        rng: np.random.Generator,
        max_new_tokens: int,
        stats: SpecStats | None = None,
        constraint: Constraint | None = None,
        memory: ScheduleMemory | None = None,
    ) -> None:
        self.target, self.proposers = target, proposers
        self.memory = memory
        self.constraint = constraint  # what the answer may contain; follows ``committed``
        self._walked = 0  # drafts of this round the constraint was advanced over (see constrain)
        self.prompt_ids, self.params, self.rng = list(prompt_ids), params, rng
        self.max_new_tokens = max_new_tokens
        self.stats = stats if stats is not None else SpecStats()
        self.committed: list[int] = []
        self.emitted = 0
        self.drafter = next((p for p in proposers if p.kind == "model"), None)  # whose steps and head are timed
        self._round_source = "none"  # who drafted the round being accepted (set by record_round)

    @property
    def pending(self) -> int:
        return self.committed[-1]

    @property
    def done(self) -> bool:
        return self.emitted >= self.max_new_tokens

    def start(self) -> Iterator[int]:
        """Prefill the target, and emit its first token; the proposers read the prompt before that token
        when the target read at most :data:`READ_BEFORE_FIRST` new tokens, else after it.

        Why both: the first token needs the target alone.  After a long prompt (seconds of the target's
        reading) the drafter's reading would only hold it back, so it delays the second token instead
        (llama.cpp's draft context, too, reads the prompt at the first draft), and an answer that ends at
        its first token never runs the drafter.  After a short one the first token comes in a tenth of a
        second either way, and the drafter's reading (a third of the target's) is better paid there than
        as a pause inside a short answer: on the bench's translations (14-token answers) it was a fifth
        of their decode time."""
        covered = min(p.covered(self.prompt_ids) for p in self.proposers) if self.proposers else len(self.prompt_ids)
        self.target.rewind(min(self.target.length, covered))  # recompute what a proposer has no outputs of
        new_tokens = len(self.prompt_ids) - self.target.reusable(self.prompt_ids)
        outputs = self.target.prefill(self.prompt_ids)
        if new_tokens <= READ_BEFORE_FIRST:
            self._proposers_read(outputs)
        allowed = self.constraint.allowed() if self.constraint is not None else None
        token = choose_token(outputs["logits"][-1], self.params, self.rng, len(self.prompt_ids), allowed)
        if self.constraint is not None:
            self.constraint.advance(token)
        self.committed = self.prompt_ids + [token]
        yield from self.emit([token], rows=outputs["logits"][-1:])
        if new_tokens > READ_BEFORE_FIRST and not self.done:
            self._proposers_read(outputs)

    def _proposers_read(self, outputs: dict[str, np.ndarray]) -> None:
        for proposer in self.proposers:
            proposer.begin(self.prompt_ids, outputs)

    def room(self, committed: list[int] | None = None, emitted: int | None = None) -> int:
        """Most drafts a round may verify: one more token is always emitted, and the context must hold them."""
        committed = self.committed if committed is None else committed
        emitted = self.emitted if emitted is None else emitted
        return max(min(self.max_new_tokens - emitted - 1, self.target.capacity - len(committed) - 1), 0)

    def constrain(self, block: DraftBlock) -> list[np.ndarray] | None:
        """The mask of each of the round's verify rows: one per draft kept, plus the row after the last
        (None: no constraint).  The drafts a proposer walked the constraint along (the drafter's) keep the
        masks of that walk; the constraint is walked on along the rest, and the block cut before the first
        draft it forbids (the masked target could never accept it)."""
        constraint = self.constraint
        if constraint is None:
            return None
        ahead = len(constraint.tokens) - (len(self.committed) - len(self.prompt_ids))  # walked by the proposer
        walked = constraint.tokens[len(constraint.tokens) - ahead :]
        kept = next((i for i, (a, b) in enumerate(zip(walked, block.tokens)) if a != b), min(ahead, len(block.tokens)))
        constraint.rollback(ahead - kept)  # a walk past what the block kept (none from the drafter)
        masks = constraint.masks(kept)
        for i, token in enumerate(block.tokens[kept:], kept):
            allowed = constraint.allowed()
            if not allowed[token]:
                block.truncate(i)
                break
            masks.append(allowed)
            constraint.advance(token)
        self._walked = len(masks)
        masks.append(constraint.allowed())
        return masks

    def masked(self, rows: np.ndarray, masks: list[np.ndarray] | None) -> np.ndarray:
        """The target's verify rows with what the constraint forbids at each set to -inf."""
        return rows if masks is None else mask_logits(rows, np.stack(masks))

    def clock(self) -> "RoundClock":
        return RoundClock(self.drafter, self.target)

    def accept(
        self, accepted: int, tokens: list[int], outputs: dict[str, np.ndarray], path: list[int] | None = None
    ) -> Iterator[int]:
        """Keep the pending token and ``accepted`` drafts (a tree: the nodes of ``path``) in the caches;
        emit ``tokens`` (accepted drafts + correction/bonus), which leaves the last one pending."""
        base = len(self.committed) - 1  # cache length before this round
        if path is None:
            self.target.rewind(base + 1 + accepted)
        else:
            self.target.keep_path(base, path)
        fed = [self.pending] + list(tokens[:-1]) if path is None else []
        for proposer in self.proposers:
            proposer.observe(fed, outputs, accepted)
            proposer.rewind(base + 1 + accepted)
        if self.constraint is not None:  # keep the accepted drafts, then the correction/bonus token
            self.constraint.rollback(self._walked - accepted)
            self.constraint.advance(tokens[-1])
            self._walked = 0
        self.committed.extend(tokens)
        rows = outputs["logits"][path] if path is not None else outputs["logits"]  # token i's row: i, or path[i]
        yield from self.emit(tokens, [self._round_source] * accepted + [TARGET], rows)

    def emit(
        self, tokens: list[int], sources: list[str] | None = None, rows: np.ndarray | None = None
    ) -> Iterator[int]:
        """Yield ``tokens`` up to the budget; ``sources`` (default: all the target's) go to the stats'
        ``token_sources`` when kept, one per token yielded; ``rows[i]``, the target's raw row that
        ``tokens[i]`` was chosen from, gives its entry in ``token_logprobs`` when kept."""
        kept = self.stats.token_sources
        logprobs = self.stats.token_logprobs
        for i, token in enumerate(tokens):
            if self.done:
                return
            self.emitted += 1
            if kept is not None:
                kept.append(sources[i] if sources is not None else TARGET)
            if logprobs is not None:
                logprobs.record(rows[i], token)
            yield token

    def record_round(
        self,
        block: DraftBlock,
        accepted: int,
        emitted: list[int],
        clock: "RoundClock",
        drafted: int | None = None,
        first_accepted: bool | None = None,
    ) -> None:
        self._round_source = block.source or "none"
        self.stats.record_round(
            block,
            accepted,
            accepted > 0 if first_accepted is None else first_accepted,
            emitted,
            drafted=drafted,
            draft_seconds=clock.draft_seconds,
            verify_seconds=clock.verify_seconds,
            head_seconds=clock.head_seconds,
        )


class RoundClock:
    """Where one round's time went: drafting (and the drafter's head within it), then verifying, and
    the part of both spent outside the target's pass and the drafter's steps (``outside_seconds``:
    planning, lookup, verification maths -- a price per round, whatever its length, that favours rounds
    which emit more tokens; each draft step's own Python is in the step's cost already)."""

    def __init__(self, drafter: Proposer | None, target: Decoder | None = None) -> None:
        self._drafter = drafter
        self._target = target
        self._head_start = self._head()
        self._models_start = self._models()
        self.started = time.perf_counter()
        self.draft_seconds = self.verify_seconds = self.head_seconds = self.outside_seconds = 0.0
        self._verify_started = self.started

    def drafted(self) -> None:
        self._verify_started = time.perf_counter()
        self.draft_seconds = self._verify_started - self.started
        self.head_seconds = self._head() - self._head_start

    def verified(self) -> None:
        now = time.perf_counter()
        self.verify_seconds = now - self._verify_started
        in_models = self._models() - self._models_start
        self.outside_seconds = max(now - self.started - in_models, 0.0)

    def _head(self) -> float:
        return self._drafter.head_seconds if self._drafter is not None else 0.0

    def _models(self) -> float:
        """Seconds the target's passes and the drafter's whole steps have taken so far."""
        target = sum(self._target.stats.seconds.values()) if self._target is not None else 0.0
        return target + (self._drafter.busy_seconds if self._drafter is not None else 0.0)
