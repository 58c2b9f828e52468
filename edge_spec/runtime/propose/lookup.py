"""Prompt lookup: draft the continuation of the latest earlier occurrence of the last tokens.

Code edits, RAG answers, summaries and multi-turn chats copy long spans from the prompt or from earlier
in the answer.  There, the sequence itself is a drafter that costs microseconds instead of a drafter
step, so a round costs only its verify pass.  The drafts are a deterministic function of the prefix,
i.e. drawn from a point mass q = δ: the speculative verifier accepts a draft x with probability p(x)
and otherwise samples norm((p - δ_x)^+), which is exact like any other q (greedy: accepted iff x is
the target's argmax).  Whether a match is worth a round is the schedule's call (``schedule.sources``).
"""

from __future__ import annotations

from edge_spec.runtime.propose.base import DraftBlock, DraftRule, SequenceProposer, point_mass_block
from edge_spec.runtime.propose.ngrams import LOOKUP_MIN_N


class PromptLookup(SequenceProposer):
    """The ``lookup`` proposer: matches of at least ``LOOKUP_MIN_N`` tokens."""

    name = "lookup"
    kind = "sequence"

    def propose(self, committed: list[int], room: int, rule: DraftRule) -> DraftBlock:
        drafts, matched = self.context.ngrams.match(committed, min(rule.gamma, room), min_n=LOOKUP_MIN_N)
        block = point_mass_block(self.name, drafts, rule.params)
        block.matched = matched
        return block
