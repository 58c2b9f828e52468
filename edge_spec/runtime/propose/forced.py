"""Forced tokens: what the grammar leaves no choice about, drafted for free.

Under a constraint, long stretches of an answer are fixed by the grammar: a schema's keys and the
punctuation around them, the rest of an enum value once its first letters are out.  The constraint names
them (``Constraint.forced_tokens``); drafted as a sequence (q = a point mass, verified like a prompt
lookup's drafts) they are always accepted, because the target's masked distribution there allows that
token alone.  So they cost one verify row each and no drafter step, and the planner takes them first.
"""

from __future__ import annotations

from edge_spec.runtime.propose.base import DraftBlock, DraftRule, SequenceProposer, point_mass_block


class ForcedTokens(SequenceProposer):
    """The ``forced`` proposer (drafts only under a constraint)."""

    name = "forced"
    kind = "sequence"
    certain = True

    def propose(self, committed: list[int], room: int, rule: DraftRule) -> DraftBlock:
        forced = rule.constraint.forced_tokens() if rule.constraint is not None else []
        return point_mass_block(self.name, forced[: min(rule.gamma, room)], rule.params)
