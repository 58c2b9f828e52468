"""Free guesses: a draft for the spare row of a batch-invariant verify pass.

A round without drafts still runs a two-row pass when the target is batch-invariant and this device
needs the pad row for it (``Decoder.min_rows``; not where one-row passes were found exact).  Instead of a throw-away copy, that row carries a guess -- what followed the
latest earlier occurrence of the last tokens, else the last token again -- verified like a lookup
draft (a point mass q), so it costs nothing and is kept whenever the target agrees.
"""

from __future__ import annotations

from edge_spec.runtime.propose.base import DraftBlock, DraftRule, SequenceProposer, point_mass_block


class FreeGuess(SequenceProposer):
    """The ``guess`` proposer (a filler: asked only for an otherwise empty round with a spare row)."""

    name = "guess"
    kind = "filler"

    def propose(self, committed: list[int], room: int, rule: DraftRule) -> DraftBlock:
        guess, matched = self.context.ngrams.match(committed, 1)
        block = point_mass_block(self.name, (guess or committed[-1:])[: min(1, room)], rule.params)
        block.matched = matched  # 0: the last token again (how likely it is right: schedule.acceptance)
        return block
