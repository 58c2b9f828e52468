"""One answer's constraint: the grammar's state after the tokens so far, as masks over the target's rows.

The state moves with the sequence: :meth:`Constraint.advance` after every token that is kept (emitted, or
drafted), :meth:`Constraint.rollback` when drafts are rejected.  It is a function of the tokens consumed
(:attr:`Constraint.tokens`) alone, which is what keeps speculative decoding lossless under a constraint:
the verifier's mask at a position is the one target-only decoding would apply after the same tokens.

So a round walks the grammar once: the drafter advances the constraint along its drafts, masking each
step, and leaves it there; the verifier takes the masks of that walk (:meth:`Constraint.masks`) instead
of walking again, and the round's end takes back only the rejected drafts.  Each advance keeps the mask
in force before its token (the last :data:`KEPT_MASKS`), and a roll-back restores the mask of the state
it returns to, so that nothing is computed twice for one state.

End tokens are allowed where the grammar may stop, and are not handed to the grammar engine: llguidance
takes back one token too many when asked to roll back an end token it consumed, and nothing follows an
end token anyway (the mask after one allows only end tokens again).
"""

from __future__ import annotations

import numpy as np
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

from edge_spec.errors import EdgeSpecError
from edge_spec.runtime.constrain.compile import GrammarRefused, compile_grammar
from edge_spec.runtime.constrain.grammar import first_line
from edge_spec.runtime.constrain.vocabulary import GrammarVocabulary

KEPT_MASKS = 64  # masks kept for the last tokens consumed: more than one round drafts (each 1 byte per row)


class ConstraintViolation(RuntimeError):
    """A token the grammar does not allow was about to be consumed: whatever chose it ignored the mask
    (a bug, never a user's mistake).  The constraint's state is left as it was."""


class Constraint:
    """See the module docstring.  ``grammar``: from :func:`~edge_spec.runtime.constrain.grammar_for`;
    ``response_format``: the format it was read from, when one was (a JSON schema is shown to the model)."""

    def __init__(self, grammar: str, vocabulary: GrammarVocabulary, response_format: dict | None = None) -> None:
        self.vocabulary = vocabulary
        self.response_format = response_format
        try:
            self._matcher = compile_grammar(grammar, vocabulary)
        except GrammarRefused as exc:
            raise EdgeSpecError(f"response_format: {exc}") from None
        self._bits = allocate_token_bitmask(1, vocabulary.width)
        self._allowed: np.ndarray | None = None  # the mask of the current state, once computed
        self._ended = 0  # end tokens consumed at the tail of ``tokens`` (the grammar engine never saw them)
        self.tokens: list[int] = []  # consumed, in order
        self._masks: list[
            np.ndarray | None
        ] = []  # the mask in force before each of the last tokens (None: not computed)

    def allowed(self) -> np.ndarray:
        """Boolean mask over the target's rows: the tokens that may come next (read-only; only end tokens
        once the grammar is complete).  Raises :class:`EdgeSpecError` when the grammar allows nothing."""
        if self._allowed is None:
            if self._ended:
                allowed = np.zeros(self.vocabulary.width, dtype=bool)
                allowed[list(self.vocabulary.end_ids)] = True
            else:
                allowed = self.library_allowed() & self.vocabulary.usable
                # the grammar engine reads added tokens as special: its mask can pass one whose text the
                # grammar spells and then refuse to consume it, so each such token is asked directly
                for token in self.vocabulary.added_ids[allowed[self.vocabulary.added_ids]].tolist():
                    if token not in self.vocabulary.end_ids and self._matcher.validate_tokens([token]) != 1:
                        allowed[token] = False
            if not allowed.any():
                raise EdgeSpecError(
                    "response_format: the grammar allows no token of this model's vocabulary "
                    f"after {len(self.tokens)} tokens"
                )
            allowed.setflags(write=False)
            self._allowed = allowed
        return self._allowed

    def library_allowed(self) -> np.ndarray:
        """The grammar engine's own mask, before padding rows are taken out (what :meth:`allowed` refines)."""
        self._check()
        fill_next_token_bitmask(self._matcher, self._bits, 0)
        width = self.vocabulary.width
        return np.unpackbits(self._bits.astype("<i4", copy=False).view(np.uint8), bitorder="little", count=width).view(
            bool
        )

    def advance(self, token: int) -> None:
        """Consume ``token``; :class:`ConstraintViolation` (state unchanged) if the grammar forbids it."""
        token = int(token)
        if self._ended or token in self.vocabulary.end_ids:
            ok = bool(self.allowed()[token])
        elif self._allowed is not None:
            ok = 0 <= token < self.vocabulary.width and bool(self._allowed[token])
        else:
            ok = (
                0 <= token < self.vocabulary.width
                and bool(self.vocabulary.usable[token])
                and self._matcher.validate_tokens([token]) == 1
            )
        if not ok:
            raise ConstraintViolation(f"token {token} is not allowed by the grammar after {len(self.tokens)} tokens")
        if token in self.vocabulary.end_ids:
            self._ended += 1
        elif not self._matcher.consume_token(token):
            raise ConstraintViolation(
                f"the grammar engine refused token {token}: {first_line(self._matcher.get_error())}"
            )
        self.tokens.append(token)
        self._masks.append(self._allowed)
        if len(self._masks) > KEPT_MASKS:
            del self._masks[0]
        self._allowed = None

    def rollback(self, count: int) -> None:
        """Take back the last ``count`` tokens consumed."""
        if not 0 <= count <= len(self.tokens):
            raise ValueError(f"cannot take back {count} of {len(self.tokens)} tokens")
        if count == 0:
            return
        ended = min(count, self._ended)
        self._ended -= ended
        if count > ended and not self._matcher.rollback(count - ended):
            raise RuntimeError(
                f"the grammar engine could not take back {count} tokens: {first_line(self._matcher.get_error())}"
            )
        del self.tokens[-count:]
        kept = len(self._masks) - count
        self._allowed = self._masks[kept] if kept >= 0 else None  # the mask of the state returned to
        del self._masks[max(kept, 0) :]

    def masks(self, count: int) -> list[np.ndarray]:
        """The masks in force before each of the last ``count`` tokens consumed, in order: those computed on
        the way (a drafter's walk), and any that were not computed then, now (by walking back and again)."""
        if not 0 <= count <= len(self.tokens):
            raise ValueError(f"cannot give the masks of {count} of {len(self.tokens)} tokens")
        masks = self._masks[len(self._masks) - count :] if count else []
        if len(masks) == count and all(mask is not None for mask in masks):
            return list(masks)
        tokens = self.tokens[len(self.tokens) - count :]
        self.rollback(count)
        masks = []
        for token in tokens:
            masks.append(self.allowed())
            self.advance(token)
        return masks

    def forced_tokens(self) -> list[int]:
        """The tokens the grammar forces from here on (possibly none): the grammar engine's fast-forward
        tokens, or the single token the mask allows.  Drafted, they are accepted whatever the sampling."""
        self._check()
        if self._ended:
            return []
        forced = []
        for token in self._matcher.compute_ff_tokens():
            if not self.vocabulary.usable[token]:
                break
            forced.append(int(token))
        if not forced:
            ids = np.flatnonzero(self.allowed())
            if ids.size == 1:
                forced = [int(ids[0])]
        return forced

    def is_finished(self) -> bool:
        """The grammar is complete and takes nothing more: only an end token may follow."""
        self._check()
        return self._ended > 0 or self._matcher.is_stopped()

    def copy(self) -> "Constraint":
        """An independent constraint in the same state."""
        other = Constraint.__new__(Constraint)
        other.vocabulary = self.vocabulary
        other.response_format = self.response_format
        other._matcher = self._matcher.deep_copy()
        other._bits = allocate_token_bitmask(1, self.vocabulary.width)
        other._allowed = self._allowed
        other._ended = self._ended
        other.tokens = list(self.tokens)
        other._masks = list(self._masks)
        return other

    def _check(self) -> None:
        if self._matcher.is_error():
            raise RuntimeError(f"the grammar engine failed: {first_line(self._matcher.get_error())}")
